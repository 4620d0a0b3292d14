package scoped

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clocktesting "k8s.io/utils/clock/testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/deploy/workload"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// recorder is an Observer that keeps what it hears.
type recorder struct {
	mu                             sync.Mutex
	renewed, rejected, reinstalled int
	failures                       []string
}

func (r *recorder) Renewed(_ time.Time, rejected, reinstalled bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.renewed++
	if rejected {
		r.rejected++
	}
	if reinstalled {
		r.reinstalled++
	}
}

func (r *recorder) Failed(step string, err error, _ time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failures = append(r.failures, step+": "+err.Error())
}

func (r *recorder) get() (renewed, rejected, reinstalled int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.renewed, r.rejected, r.reinstalled
}

const wantUser = "system:serviceaccount:kube-system:kubelet-authenticator-node-attestation-controller"

// TestIdentity runs an Identity against a real kube-apiserver: it installs
// the ServiceAccount with the admin credential, its clients are that
// ServiceAccount and hold only deploy/workload's rules, its token is
// renewed under the same clients, a ServiceAccount deleted behind its back
// is installed again as soon as the API server rejects the token, and a
// credential that may not request tokens installs nothing.
func TestIdentity(t *testing.T) {
	wl := harness.StartControlPlane(t, "workload")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	t.Run("a credential that may not request tokens installs nothing", func(t *testing.T) {
		certPEM, keyPEM := wl.IssueClientCert(t, "not-an-admin")
		id, err := New(Config{Admin: wl.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM})})
		if err != nil {
			t.Fatal(err)
		}
		cs, err := kubernetes.NewForConfig(id.RESTConfig())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := harness.WhoAmI(ctx, cs); err == nil || !strings.Contains(err.Error(), errNotConnected.Error()) {
			t.Fatalf("before Connect a request went out: %v", err)
		}
		if err := id.Connect(ctx); !errors.Is(err, ErrNotAdmin) {
			t.Fatalf("Connect = %v, want ErrNotAdmin", err)
		}
		if user, err := harness.WhoAmI(ctx, cs); err != nil || user.Username != "not-an-admin" {
			t.Errorf("the clients of a credential used as given authenticate as %q, %v; want not-an-admin", user.Username, err)
		}
		if _, err := wl.Client.CoreV1().ServiceAccounts("kube-system").Get(ctx, id.ServiceAccount().Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("the ServiceAccount exists (%v): a credential that may not request tokens installed it", err)
		}
	})

	t.Run("renewed before expiry, under the same client", func(t *testing.T) {
		rec := &recorder{}
		fc := clocktesting.NewFakeClock(time.Now())
		g := &grantor{clock: fc, life: MinTokenLifetime}
		// The API server's shortest lifetime, renewed 3 s into it (or as
		// soon as the floor allows).
		id := connect(t, Config{Admin: g.wrap(wl.AdminConfig), TokenLifetime: MinTokenLifetime, RenewBefore: MinTokenLifetime - 3*time.Second, Observer: rec, Clock: fc})
		if id.Username() != wantUser {
			t.Errorf("Username = %s, want %s", id.Username(), wantUser)
		}
		if life := id.Expiry().Sub(fc.Now()); life > MinTokenLifetime || life < MinTokenLifetime-time.Minute {
			t.Errorf("the token lives another %s, want about %s", life, MinTokenLifetime)
		}
		cs, err := kubernetes.NewForConfig(id.RESTConfig())
		if err != nil {
			t.Fatal(err)
		}
		user, err := harness.WhoAmI(ctx, cs)
		if err != nil {
			t.Fatal(err)
		}
		if user.Username != wantUser {
			t.Fatalf("the client authenticates as %s, want %s", user.Username, wantUser)
		}
		if _, err := cs.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{}); err != nil {
			t.Errorf("the identity may not list CSRs: %v", err)
		}
		if _, err := cs.CoreV1().Secrets(metav1.NamespaceSystem).List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
			t.Errorf("listing Secrets as the identity: %v, want Forbidden: it must hold deploy/workload's rules only", err)
		}

		first, _ := id.Token()
		stop := run(t, id)
		drive(t, fc, 3*MinRenewInterval, func() bool { n, _, _ := rec.get(); return n >= 2 })
		stop()
		if n, _, _ := rec.get(); n < 2 {
			t.Fatalf("%d renewals in %s, want 2", n, 3*MinRenewInterval)
		}
		now, _ := id.Token()
		if now.AccessToken == first.AccessToken {
			t.Error("the token was reported renewed but is the same")
		}
		if user, err := harness.WhoAmI(ctx, cs); err != nil || user.Username != wantUser {
			t.Errorf("after renewal the same client authenticates as %q, %v", user.Username, err)
		}
		if _, rejected, reinstalled := rec.get(); rejected+reinstalled != 0 || len(rec.failures) != 0 {
			t.Errorf("scheduled renewals: %d rejected, %d reinstalled, failures %v; want none", rejected, reinstalled, rec.failures)
		}
	})

	t.Run("deleted ServiceAccount installed again when its token is rejected", func(t *testing.T) {
		rec := &recorder{}
		// Default renewal (40 min): only a rejected token renews it here.
		id := connect(t, Config{Admin: wl.AdminConfig, Observer: rec})
		rctx, stop := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); id.Run(rctx) }()
		defer func() { stop(); <-done }()
		cs, err := kubernetes.NewForConfig(id.RESTConfig())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := harness.WhoAmI(ctx, cs); err != nil {
			t.Fatal(err)
		}
		sa := id.ServiceAccount()
		if err := wl.Client.CoreV1().ServiceAccounts(sa.Namespace).Delete(ctx, sa.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		var sawUnauthorized bool
		harness.WaitFor(t, 60*time.Second, func() (bool, error) {
			_, err := cs.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{})
			sawUnauthorized = sawUnauthorized || apierrors.IsUnauthorized(err)
			_, rejected, reinstalled := rec.get()
			return err == nil && rejected > 0 && reinstalled > 0, nil
		})
		if !sawUnauthorized {
			t.Error("the deleted ServiceAccount's token was never rejected; the test did not test the rejected path")
		}
		if _, err := wl.Client.CoreV1().ServiceAccounts(sa.Namespace).Get(ctx, sa.Name, metav1.GetOptions{}); err != nil {
			t.Errorf("the ServiceAccount was not installed again: %v", err)
		}
		if user, err := harness.WhoAmI(ctx, cs); err != nil || user.Username != wantUser {
			t.Errorf("after re-installation the same client authenticates as %q, %v", user.Username, err)
		}
	})

}

// TestRenewalFloor: a workload API server is tenant input, and one that
// grants tokens of seconds must not make the controller renew every few
// seconds (each renewal applies deploy/workload with the admin credential
// and requests a token). Such a token is refused, at Connect and in Run,
// as the cluster's error; and whatever the server grants or the settings
// ask, an Identity renews at most once per MinRenewInterval. Ten simulated
// minutes cost at most ten TokenRequests (without the floors: about 600
// with 2-second tokens, 200 with a renewal 3 s into each token).
func TestRenewalFloor(t *testing.T) {
	wl := harness.StartControlPlane(t, "workload")
	const window = 10 * time.Minute
	maxRenewals := int(window / MinRenewInterval)

	t.Run("a short-lived token is refused at connect", func(t *testing.T) {
		fc := clocktesting.NewFakeClock(time.Now())
		g := &grantor{clock: fc, life: 2 * time.Second}
		id, err := New(Config{Admin: g.wrap(wl.AdminConfig), Clock: fc})
		if err != nil {
			t.Fatal(err)
		}
		err = id.Connect(context.Background())
		var e *Error
		if !errors.Is(err, ErrShortLifetime) || !errors.As(err, &e) || e.Step != StepToken {
			t.Fatalf("Connect to a server granting 2-second tokens = %v, want a %s step error wrapping ErrShortLifetime", err, StepToken)
		}
		if _, err := id.Token(); err == nil {
			t.Error("the refused token is in use")
		}
	})

	for _, tc := range []struct {
		name string
		life time.Duration // granted after Connect
	}{
		{"a server granting 2-second tokens", 2 * time.Second},
		{"renewal settings 3 s into each token", MinTokenLifetime},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := &recorder{}
			fc := clocktesting.NewFakeClock(time.Now())
			g := &grantor{clock: fc, life: MinTokenLifetime}
			id := connect(t, Config{Admin: g.wrap(wl.AdminConfig), TokenLifetime: MinTokenLifetime, RenewBefore: MinTokenLifetime - 3*time.Second, Observer: rec, Clock: fc})
			first, _ := id.Token()
			g.set(tc.life)
			stop := run(t, id)
			drive(t, fc, window, func() bool { return false })
			stop()
			tokens, applies := g.counts()
			perRenewal := len(id.objects.Objects)
			t.Logf("%s: %d TokenRequests and %d applies in %s", tc.name, tokens, applies, window)
			if tokens > maxRenewals || applies > maxRenewals*perRenewal {
				t.Errorf("%d TokenRequests and %d applies in %s, want at most %d and %d (one renewal per %s)",
					tokens, applies, window, maxRenewals, maxRenewals*perRenewal, MinRenewInterval)
			}
			if tokens < maxRenewals-1 {
				t.Errorf("%d TokenRequests in %s, want about %d: renewal stopped", tokens, window, maxRenewals)
			}
			renewed, _, _ := rec.get()
			rec.mu.Lock()
			failures := slices.Clone(rec.failures)
			rec.mu.Unlock()
			if tc.life < MinGrantedLifetime {
				if renewed != 0 || len(failures) == 0 || !strings.Contains(failures[0], ErrShortLifetime.Error()) {
					t.Errorf("2-second tokens: %d renewals, failures %q; want none renewed, each refused as too short-lived", renewed, failures)
				}
				if now, _ := id.Token(); now.AccessToken != first.AccessToken {
					t.Error("the token in use is not the last good one")
				}
			} else if len(failures) != 0 {
				t.Errorf("failures %q, want none", failures)
			}
		})
	}
}

// grantor wraps a workload API server's admin transport: it counts the
// TokenRequests and applies an Identity makes, and rewrites each token's
// expirationTimestamp to the fake clock's now plus life, as a server
// granting that lifetime would (the token itself is the real one).
type grantor struct {
	clock *clocktesting.FakeClock

	mu              sync.Mutex
	life            time.Duration
	tokens, applies int
}

func (g *grantor) set(life time.Duration) { g.mu.Lock(); g.life = life; g.mu.Unlock() }

func (g *grantor) counts() (tokens, applies int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.tokens, g.applies
}

func (g *grantor) wrap(admin *rest.Config) *rest.Config {
	cfg := rest.CopyConfig(admin)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(req *http.Request) (*http.Response, error) { return g.roundTrip(rt, req) })
	})
	return cfg
}

func (g *grantor) roundTrip(rt http.RoundTripper, req *http.Request) (*http.Response, error) {
	isToken := req.Method == http.MethodPost && strings.HasSuffix(req.URL.Path, "/token")
	g.mu.Lock()
	if isToken {
		g.tokens++
	}
	if req.Method == http.MethodPatch {
		g.applies++
	}
	g.mu.Unlock()
	if isToken { // read and rewritten as JSON, whatever the client prefers
		req = req.Clone(req.Context())
		req.Header.Set("Accept", "application/json")
	}
	resp, err := rt.RoundTrip(req)
	if err != nil || !isToken || resp.StatusCode != http.StatusCreated {
		return resp, err
	}
	defer resp.Body.Close()
	var tr map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&tr); err != nil {
		return nil, fmt.Errorf("the test reads TokenRequests as JSON: %w", err)
	}
	g.mu.Lock()
	exp := g.clock.Now().Add(g.life).UTC().Format(time.RFC3339)
	g.mu.Unlock()
	if err := unstructured.SetNestedField(tr, exp, "status", "expirationTimestamp"); err != nil {
		return nil, err
	}
	body, err := json.Marshal(tr)
	if err != nil {
		return nil, err
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	resp.ContentLength = int64(len(body))
	resp.Header.Del("Content-Length")
	return resp, nil
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// run runs id until the returned function is called.
func run(t *testing.T, id *Identity) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); id.Run(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

// drive steps fc a second at a time, each time Run waits on it, for span
// or until done.
func drive(t *testing.T, fc *clocktesting.FakeClock, span time.Duration, done func() bool) {
	t.Helper()
	for end := fc.Now().Add(span); fc.Now().Before(end) && !done(); {
		deadline := time.Now().Add(30 * time.Second)
		for !fc.HasWaiters() {
			if time.Now().After(deadline) {
				t.Fatal("Run is not waiting on the clock")
			}
			time.Sleep(time.Millisecond)
		}
		fc.Step(time.Second)
	}
}

// connect returns a connected Identity of cfg.
func connect(t *testing.T, cfg Config) *Identity {
	t.Helper()
	id, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := id.Connect(context.Background()); err != nil {
		t.Fatal(err)
	}
	return id
}

// TestProvidersExtendSignerRules: the installed ClusterRole grants the
// signer verbs for the signer names of every provider served (a test
// build's null), as it does for the release ones, and nothing more.
func TestProvidersExtendSignerRules(t *testing.T) {
	m, err := workload.Load()
	if err != nil {
		t.Fatal(err)
	}
	extendSignerRules(m, []string{"tpm", "null"})
	var role rbacv1.ClusterRole
	for _, o := range m.Objects {
		if o.GetKind() == "ClusterRole" {
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &role); err != nil {
				t.Fatal(err)
			}
		}
	}
	grants := func(verb, name string) bool {
		for _, r := range role.Rules {
			if slices.Contains(r.Resources, "signers") && slices.Contains(r.Verbs, verb) && slices.Contains(r.ResourceNames, name) {
				return true
			}
		}
		return false
	}
	for _, w := range []struct {
		verb, name string
		want       bool
	}{
		{"sign", attestor.ClientSignerName("null"), true},
		{"sign", attestor.ServingSignerName("null"), true},
		{"attest", attestor.ServingSignerName("null"), true},
		{"attest", attestor.ClientSignerName("null"), false},
		{"sign", attestor.ClientSignerName("tpm"), true},
		{"sign", "kubernetes.io/kubelet-serving", false},
	} {
		if got := grants(w.verb, w.name); got != w.want {
			t.Errorf("%s on signer %s granted: %t, want %t", w.verb, w.name, got, w.want)
		}
	}
	for _, r := range role.Rules {
		if n := len(r.ResourceNames); n != len(slices.Compact(slices.Sorted(slices.Values(r.ResourceNames)))) {
			t.Errorf("rule %v names a signer twice", r)
		}
	}
}

func TestRenewAt(t *testing.T) {
	t0 := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		life, before, want time.Duration
	}{
		{time.Hour, 20 * time.Minute, 40 * time.Minute},
		{10 * time.Minute, 10*time.Minute - 3*time.Second, 3 * time.Second},
		// The API server granted less than asked: halfway.
		{10 * time.Minute, 20 * time.Minute, 5 * time.Minute},
		{20 * time.Minute, 20 * time.Minute, 10 * time.Minute},
	} {
		if got := RenewAt(t0, t0.Add(tc.life), tc.before).Sub(t0); got != tc.want {
			t.Errorf("RenewAt(life %s, before %s) = +%s, want +%s", tc.life, tc.before, got, tc.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		c  Config
		ok bool
	}{
		{Config{}, true},
		{Config{TokenLifetime: 10 * time.Minute, RenewBefore: 9 * time.Minute}, true},
		{Config{TokenLifetime: 5 * time.Minute, RenewBefore: time.Minute}, false},
		{Config{TokenLifetime: 48 * time.Hour}, false},
		{Config{TokenLifetime: 30 * time.Minute, RenewBefore: 30 * time.Minute}, false},
		{Config{RenewBefore: -time.Minute}, false},
	} {
		if err := tc.c.Validate(); (err == nil) != tc.ok {
			t.Errorf("Validate(%+v) = %v, want ok=%t", tc.c, err, tc.ok)
		}
	}
}
