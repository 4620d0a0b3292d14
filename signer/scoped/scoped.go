// Package scoped gives the controller an identity of its own in a workload
// cluster, so that the admin credential Cluster API hands it (the
// `<cluster>-kubeconfig` Secret) is not what it works with. With the admin
// credential it installs deploy/workload (a ServiceAccount and the
// least-privilege RBAC bound to it; package deploy/workload) by server-side
// apply, and asks the TokenRequest API for short-lived tokens of that
// ServiceAccount. Every steady-state client is built on RESTConfig, whose
// bearer token an Identity renews before it expires, without the clients
// (and their informers) being rebuilt. The admin credential is used again
// only to renew the token, and with it to apply the manifests again, which
// re-creates the ServiceAccount if it was deleted.
//
// The clients can be built before the identity is installed (New makes no
// request); they fail every request until Connect has succeeded. A
// credential that may not request tokens is no admin: Connect then
// installs nothing and the clients work as that credential, as given.
package scoped

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/oauth2"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"
	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/deploy/workload"
)

// Defaults and bounds of Config.
const (
	// DefaultTokenLifetime is the lifetime asked for each token.
	DefaultTokenLifetime = time.Hour
	// DefaultRenewBefore is how long before its expiry a token is renewed:
	// time enough for renewal to fail and be retried a good many times.
	DefaultRenewBefore = 20 * time.Minute
	// MinTokenLifetime is the shortest lifetime the TokenRequest API
	// grants (expirationSeconds ≥ 600).
	MinTokenLifetime = 10 * time.Minute
	// MaxTokenLifetime bounds the lifetime asked for: the tokens are meant
	// to be short-lived.
	MaxTokenLifetime = 24 * time.Hour
	// MinGrantedLifetime is the shortest lifetime, from the request by the
	// controller's clock to the token's expirationTimestamp, of a token the
	// controller accepts. The workload API server is tenant input: one
	// that grants tokens of seconds would make the controller renew every
	// few seconds, each time applying deploy/workload with the admin
	// credential. A kube-apiserver grants at least MinTokenLifetime; the
	// difference leaves room for clock skew between the two.
	MinGrantedLifetime = 5 * time.Minute
	// MinRenewInterval is the shortest time between two renewals (or
	// failed attempts) of one Identity's token, whatever the renewal
	// settings and whatever the workload API server answers, save the
	// first renewal of a rejected token (whose own pause grows from
	// minRejectedRenewal): one cluster's renewals cost the admin
	// credential at most one apply and TokenRequest a minute.
	MinRenewInterval = time.Minute
	// FieldManager is the server-side apply field manager of what the
	// controller installs.
	FieldManager = "node-attestation-controller"

	// requestTimeout bounds each renewal made with the admin credential,
	// and startTimeout all of Start: the caller's other work waits for it.
	requestTimeout = 30 * time.Second
	startTimeout   = 20 * time.Second
	// minRetry and maxRetry bound the backoff after a failed renewal.
	minRetry, maxRetry = time.Second, time.Minute
	// minRejectedRenewal and maxRejectedRenewal bound how soon a token the
	// API server rejected (401) is renewed: at once the first time, then
	// no sooner than minRejectedRenewal after the last renewal, doubling
	// while rejections go on, so that an API server that rejects every
	// token costs a renewal every few minutes, not a loop.
	minRejectedRenewal, maxRejectedRenewal = 10 * time.Second, 5 * time.Minute
)

// Steps of the set-up that can fail (Error.Step).
const (
	StepCheck   = "check"   // asking whether the credential may request tokens
	StepInstall = "install" // applying deploy/workload
	StepToken   = "token"   // TokenRequest
)

// Error is a failed step of installing the identity or getting its token.
type Error struct {
	Step string
	Err  error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// ErrNotAdmin is returned by Connect when the workload credential may not
// request tokens of the controller's ServiceAccount: it is not an admin
// credential, so there is nothing to install the identity with, and the
// Identity's clients work as that credential, as given.
var ErrNotAdmin = errors.New("the workload cluster's credential may not request tokens for the controller's ServiceAccount")

// ErrShortLifetime is wrapped by the *Error (StepToken) of a renewal whose
// token the workload API server granted for less than MinGrantedLifetime.
// The token is not used; the renewal is retried no sooner than
// MinRenewInterval later.
var ErrShortLifetime = errors.New("the workload API server granted a token too short-lived to use")

// errNotConnected fails the requests of an Identity's clients until
// Connect has succeeded.
var errNotConnected = errors.New("the controller's identity in the workload cluster is not installed yet")

// Config configures an Identity.
type Config struct {
	// Admin is the client configuration of the admin credential.
	Admin *rest.Config
	// TokenLifetime is the lifetime asked for each token; 0 means
	// DefaultTokenLifetime. The API server may grant less.
	TokenLifetime time.Duration
	// RenewBefore is how long before its expiry a token is renewed; 0
	// means DefaultRenewBefore. When a token lives no longer than that, it
	// is renewed halfway through its life; never sooner than
	// MinRenewInterval after the last renewal.
	RenewBefore time.Duration
	// Providers are the attestors the controller serves. A signer rule of
	// deploy/workload that names client (or serving) signer names of ours
	// is installed naming the client (serving) signer names of each of
	// them too: deploy/workload lists the release attestors, and a test
	// build serves more (null).
	Providers []string
	// Observer hears about renewals and failures in Run; may be nil.
	Observer Observer
	// Clock; nil means the real clock.
	Clock clock.WithTicker
}

// Validate reports what is wrong with the lifetime and renewal settings.
func (c *Config) Validate() error {
	var errs []error
	l, b := cmp.Or(c.TokenLifetime, DefaultTokenLifetime), cmp.Or(c.RenewBefore, DefaultRenewBefore)
	if l < MinTokenLifetime || l > MaxTokenLifetime {
		errs = append(errs, fmt.Errorf("token lifetime %s must be between %s (the TokenRequest API's minimum) and %s", l, MinTokenLifetime, MaxTokenLifetime))
	}
	if b <= 0 || b >= l {
		errs = append(errs, fmt.Errorf("token renewal %s before expiry must be positive and shorter than the token lifetime %s", b, l))
	}
	return errors.Join(errs...)
}

// Observer hears what an Identity's Run does. Its methods must not block.
type Observer interface {
	// Renewed: a new token, valid until expiry. rejected is true when the
	// API server had rejected the previous one (401), reinstalled when the
	// ServiceAccount had to be created again (it had been deleted).
	Renewed(expiry time.Time, rejected, reinstalled bool)
	// Failed: a renewal step failed; it is retried after retry.
	Failed(step string, err error, retry time.Duration)
}

// Identity is the controller's ServiceAccount in one workload cluster and
// its current token. It implements client-go's transport.ResettableTokenSource:
// a request answered 401 makes it renew the token early.
type Identity struct {
	cfg     Config
	sa      types.NamespacedName
	objects *workload.Manifests // shared, never written (manifestsFor)
	clock   clock.WithTicker
	reset   chan struct{}

	mu        sync.Mutex
	given     http.RoundTripper // set when the credential is used as given
	tok       *oauth2.Token
	issued    time.Time // when the request for tok was made
	uid       types.UID // of the ServiceAccount the token is for
	rejected  bool      // tok was answered 401
	lastReset time.Time // when a rejected token was last renewed
	resetWait time.Duration
}

// New returns the Identity of the controller in the workload cluster that
// cfg.Admin reaches. It makes no request: Connect installs it.
func New(cfg Config) (*Identity, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m, err := manifestsFor(cfg.Providers)
	if err != nil {
		return nil, err
	}
	// The admin clients are checked here and built when used (a renewal
	// every tens of minutes): an Identity holds no client of its own
	// between renewals.
	if _, _, err := adminClients(cfg.Admin); err != nil {
		return nil, err
	}
	id := &Identity{cfg: cfg, sa: m.ServiceAccount, objects: m, clock: cfg.Clock, reset: make(chan struct{}, 1)}
	if id.clock == nil {
		id.clock = clock.RealClock{}
	}
	return id, nil
}

// Connect asks whether the admin credential may request tokens of the
// controller's ServiceAccount; if so it installs deploy/workload and gets
// a first token, and the Identity's clients work with it (Run renews it).
// If not, it returns ErrNotAdmin and the clients work as that credential,
// as given. Any other failure is an *Error naming the step; Connect may be
// called again.
func (id *Identity) Connect(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	err := id.check(ctx)
	if errors.Is(err, ErrNotAdmin) {
		rt, terr := rest.TransportFor(id.cfg.Admin)
		if terr != nil {
			return &Error{Step: StepCheck, Err: fmt.Errorf("unable to build the workload cluster's transport: %w", terr)}
		}
		id.mu.Lock()
		id.given = rt
		id.mu.Unlock()
		return ErrNotAdmin
	}
	if err != nil {
		return err
	}
	_, err = id.renew(ctx)
	return err
}

// ServiceAccount names the identity.
func (id *Identity) ServiceAccount() types.NamespacedName { return id.sa }

// Username is the identity's user name in the workload cluster.
func (id *Identity) Username() string {
	return "system:serviceaccount:" + id.sa.Namespace + ":" + id.sa.Name
}

// Expiry is when the current token expires (zero before Connect, or
// when the credential is used as given).
func (id *Identity) Expiry() time.Time {
	id.mu.Lock()
	defer id.mu.Unlock()
	if id.tok == nil {
		return time.Time{}
	}
	return id.tok.Expiry
}

// RESTConfig returns the client configuration of the workload cluster's
// steady-state clients: the admin configuration's server, TLS and client
// settings without any of its credentials, authenticated by the
// identity's current token (client-go's resettable token source
// transport), or, after Connect returned ErrNotAdmin, by the credential as
// given. Until Connect has succeeded its requests fail.
func (id *Identity) RESTConfig() *rest.Config {
	cfg := rest.AnonymousClientConfig(id.cfg.Admin)
	cfg.WrapTransport = func(base http.RoundTripper) http.RoundTripper {
		return &credentialTransport{id: id, scoped: transport.ResettableTokenSourceWrapTransport(id)(base)}
	}
	return cfg
}

// credentialTransport sends a request with the identity's token, or
// through the given credential's transport, or not at all.
type credentialTransport struct {
	id     *Identity
	scoped http.RoundTripper
}

func (t *credentialTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	t.id.mu.Lock()
	tok, given := t.id.tok, t.id.given
	t.id.mu.Unlock()
	switch {
	case tok != nil:
		return t.scoped.RoundTrip(req)
	case given != nil:
		return given.RoundTrip(req)
	default:
		return nil, errNotConnected
	}
}

// Token implements oauth2.TokenSource: the current token. It never makes a
// request; Run renews the token.
func (id *Identity) Token() (*oauth2.Token, error) {
	id.mu.Lock()
	defer id.mu.Unlock()
	if id.tok == nil {
		return nil, errNotConnected
	}
	return id.tok, nil
}

// ResetTokenOlderThan implements transport.ResettableTokenSource: the API
// server answered 401 to a request made at t. If the current token is older,
// Run renews it at once (or, when rejections go on, after a growing pause).
func (id *Identity) ResetTokenOlderThan(t time.Time) {
	id.mu.Lock()
	older := id.issued.Before(t)
	if older {
		id.rejected = true
	}
	id.mu.Unlock()
	if older {
		select {
		case id.reset <- struct{}{}:
		default:
		}
	}
}

// Run renews the token before it expires, and early when the API server
// rejects it, until ctx is done. A failed renewal is retried with backoff
// (and reported to the Observer); the old token is used until then. It
// returns at once unless Connect has got a token.
func (id *Identity) Run(ctx context.Context) {
	if id.Expiry().IsZero() {
		return
	}
	retry := minRetry
	next := id.renewAt()
	last := id.issuedAt() // the last renewal or attempt
	failed := false       // the last attempt failed
	for {
		// No renewal sooner than MinRenewInterval after the last one,
		// whatever the reason, save a rejected token's first (below).
		next = latest(next, last.Add(MinRenewInterval))
		wait := next.Sub(id.clock.Now())
		t := id.clock.NewTimer(max(wait, 0))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
		case <-id.reset:
			t.Stop()
			// A rejected token is renewed at once the first time; while
			// rejections go on, or after a failed attempt, after a
			// growing pause and never sooner than the floor.
			if at := id.rejectedRenewalAt(); !at.IsZero() || failed {
				if at = latest(at, last.Add(MinRenewInterval)); at.After(id.clock.Now()) {
					if at.Before(next) {
						next = at
					}
					continue
				}
			}
		}
		id.mu.Lock()
		rejected := id.rejected
		id.mu.Unlock()
		last = id.clock.Now()
		reinstalled, err := id.renew(ctx)
		if ctx.Err() != nil {
			return
		}
		failed = err != nil
		if err != nil {
			var e *Error
			step := StepToken
			if errors.As(err, &e) {
				step = e.Step
			}
			next = latest(id.clock.Now().Add(retry), last.Add(MinRenewInterval))
			if id.cfg.Observer != nil {
				id.cfg.Observer.Failed(step, err, next.Sub(id.clock.Now()))
			}
			retry = min(2*retry, maxRetry)
			continue
		}
		retry = minRetry
		id.mu.Lock()
		if rejected {
			id.lastReset = id.clock.Now()
			id.resetWait = min(max(2*id.resetWait, minRejectedRenewal), maxRejectedRenewal)
		} else { // a token lived to its renewal: rejections start over
			id.lastReset, id.resetWait = time.Time{}, 0
		}
		id.mu.Unlock()
		if id.cfg.Observer != nil {
			id.cfg.Observer.Renewed(id.Expiry(), rejected, reinstalled)
		}
		next = id.renewAt()
	}
}

// latest returns the later of a and b.
func latest(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// issuedAt is when the current token was requested.
func (id *Identity) issuedAt() time.Time {
	id.mu.Lock()
	defer id.mu.Unlock()
	return id.issued
}

// rejectedRenewalAt is the earliest time a rejected token may be renewed.
func (id *Identity) rejectedRenewalAt() time.Time {
	id.mu.Lock()
	defer id.mu.Unlock()
	if id.lastReset.IsZero() {
		return time.Time{}
	}
	return id.lastReset.Add(id.resetWait)
}

// renewAt is when the current token is due for renewal.
func (id *Identity) renewAt() time.Time {
	id.mu.Lock()
	defer id.mu.Unlock()
	return RenewAt(id.issued, id.tok.Expiry, cmp.Or(id.cfg.RenewBefore, DefaultRenewBefore))
}

// RenewAt returns when a token requested at issued and expiring at expiry
// is renewed: renewBefore its expiry, or halfway through its life when it
// lives no longer than renewBefore.
func RenewAt(issued, expiry time.Time, renewBefore time.Duration) time.Time {
	life := expiry.Sub(issued)
	if renewBefore < life {
		return expiry.Add(-renewBefore)
	}
	return issued.Add(life / 2)
}

// check asks whether the credential may request tokens of the
// ServiceAccount (a SelfSubjectAccessReview, which every user may make).
func (id *Identity) check(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	admin, _, err := adminClients(id.cfg.Admin)
	if err != nil {
		return &Error{Step: StepCheck, Err: err}
	}
	r, err := admin.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authorizationv1.SelfSubjectAccessReview{
		Spec: authorizationv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &authorizationv1.ResourceAttributes{
			Namespace: id.sa.Namespace, Verb: "create", Resource: "serviceaccounts", Subresource: "token", Name: id.sa.Name,
		}},
	}, metav1.CreateOptions{})
	if err != nil {
		return &Error{Step: StepCheck, Err: fmt.Errorf("unable to ask whether the workload cluster's credential may request tokens: %w", err)}
	}
	if !r.Status.Allowed {
		return ErrNotAdmin
	}
	return nil
}

// renew applies deploy/workload and requests a new token. It reports
// whether the ServiceAccount was created anew (another UID than the last
// token's).
func (id *Identity) renew(ctx context.Context) (reinstalled bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	admin, dyn, err := adminClients(id.cfg.Admin)
	if err != nil {
		return false, &Error{Step: StepInstall, Err: err}
	}
	uid, err := id.install(ctx, dyn)
	if err != nil {
		return false, &Error{Step: StepInstall, Err: err}
	}
	secs := int64(cmp.Or(id.cfg.TokenLifetime, DefaultTokenLifetime) / time.Second)
	issued := id.clock.Now()
	tr, err := admin.CoreV1().ServiceAccounts(id.sa.Namespace).CreateToken(ctx, id.sa.Name, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &secs},
	}, metav1.CreateOptions{})
	if err != nil {
		return false, &Error{Step: StepToken, Err: fmt.Errorf("unable to request a token for ServiceAccount %s: %w", id.sa, err)}
	}
	expiry := tr.Status.ExpirationTimestamp.Time
	if tr.Status.Token == "" || !expiry.After(issued) {
		return false, &Error{Step: StepToken, Err: fmt.Errorf("the token requested for ServiceAccount %s is empty or expired (expiry %s)", id.sa, expiry)}
	}
	if life := expiry.Sub(issued); life < MinGrantedLifetime {
		return false, &Error{Step: StepToken,
			Err: fmt.Errorf("%w: ServiceAccount %s's token lives %s, less than %s (check the API server's --service-account-max-token-expiration and its clock)",
				ErrShortLifetime, id.sa, life.Round(time.Second), MinGrantedLifetime)}
	}
	id.mu.Lock()
	defer id.mu.Unlock()
	reinstalled = id.uid != "" && id.uid != uid
	id.tok = &oauth2.Token{AccessToken: tr.Status.Token, TokenType: "Bearer", Expiry: expiry}
	id.issued, id.uid, id.rejected = issued, uid, false
	return reinstalled, nil
}

// install applies every object of deploy/workload (server-side apply,
// forced: the controller owns these objects) and returns the
// ServiceAccount's UID.
func (id *Identity) install(ctx context.Context, dyn dynamic.Interface) (types.UID, error) {
	var uid types.UID
	for _, o := range id.objects.Objects {
		gvr, _ := workload.Resource(o.GroupVersionKind()) // Load checked it
		var ri dynamic.ResourceInterface = dyn.Resource(gvr)
		if ns := o.GetNamespace(); ns != "" {
			ri = dyn.Resource(gvr).Namespace(ns)
		}
		got, err := ri.Apply(ctx, o.GetName(), o, metav1.ApplyOptions{FieldManager: FieldManager, Force: true})
		if err != nil {
			return "", fmt.Errorf("unable to apply %s %s: %w", o.GetKind(), namespacedName(o.GetNamespace(), o.GetName()), err)
		}
		if o.GetKind() == "ServiceAccount" {
			uid = got.GetUID()
		}
	}
	return uid, nil
}

// adminClients returns the clients of the admin credential.
func adminClients(cfg *rest.Config) (kubernetes.Interface, dynamic.Interface, error) {
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("unable to build the admin client: %w", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("unable to build the admin client: %w", err)
	}
	return cs, dyn, nil
}

// manifests are deploy/workload as installed for each set of providers,
// loaded once per process: every Identity of the same providers shares
// them, and none writes them (apply sends a copy).
var manifests sync.Map // strings.Join(providers, ",") -> *workload.Manifests

// manifestsFor returns deploy/workload with its signer rules extended to
// providers.
func manifestsFor(providers []string) (*workload.Manifests, error) {
	key := strings.Join(providers, ",")
	if m, ok := manifests.Load(key); ok {
		return m.(*workload.Manifests), nil
	}
	m, err := workload.Load()
	if err != nil {
		return nil, err
	}
	extendSignerRules(m, providers)
	got, _ := manifests.LoadOrStore(key, m)
	return got.(*workload.Manifests), nil
}

// extendSignerRules makes every ClusterRole rule on signers that names a
// client (serving) signer name of ours name the client (serving) signer
// names of providers too.
func extendSignerRules(m *workload.Manifests, providers []string) {
	for _, o := range m.Objects {
		if o.GetKind() != "ClusterRole" {
			continue
		}
		rules, _, _ := unstructured.NestedSlice(o.Object, "rules")
		for _, r := range rules {
			rule, ok := r.(map[string]any)
			if !ok {
				continue
			}
			resources, _, _ := unstructured.NestedStringSlice(rule, "resources")
			names, _, _ := unstructured.NestedStringSlice(rule, "resourceNames")
			if !slices.Contains(resources, "signers") {
				continue
			}
			out := slices.Clone(names)
			for _, prefix := range []string{attestor.ClientSignerPrefix, attestor.ServingSignerPrefix} {
				if !slices.ContainsFunc(names, func(n string) bool { return strings.HasPrefix(n, prefix) }) {
					continue
				}
				for _, p := range providers {
					if n := prefix + p; !slices.Contains(out, n) {
						out = append(out, n)
					}
				}
			}
			_ = unstructured.SetNestedStringSlice(rule, out, "resourceNames")
		}
		_ = unstructured.SetNestedSlice(o.Object, rules, "rules")
	}
}

func namespacedName(ns, name string) string {
	if ns == "" {
		return name
	}
	return ns + "/" + name
}
