package capi

import (
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	crcontroller "sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/bounds"
	"sigs.k8s.io/kubelet-authenticator/signer/controller"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
	"sigs.k8s.io/kubelet-authenticator/signer/scoped"
	"sigs.k8s.io/kubelet-authenticator/signer/shard"
	"sigs.k8s.io/kubelet-authenticator/signer/trust"
)

// Defaults of ClusterReconciler.
const (
	// DefaultRecheckPeriod is how often an opted-in Cluster's Secrets are
	// read again: Secrets are not watched (a watch needs list on every
	// Secret of the management cluster), so a rotated kubeconfig or CA is
	// picked up within this period.
	DefaultRecheckPeriod = 5 * time.Minute
	// missingSecretRetry is how soon a Cluster whose Secrets do not exist yet
	// is looked at again.
	missingSecretRetry = 15 * time.Second
)

// Default rate limits of a workload cluster's client: enough for a
// bootstrap storm of a few hundred nodes (two writes per CSR), well within
// what API Priority and Fairness gives a workload controller.
const (
	DefaultClientQPS   = 100
	DefaultClientBurst = 200
)

// ClusterReconciler runs one CSR controller per opted-in workload cluster.
// It starts a controller when a Cluster opts in and its Secrets exist,
// restarts it when the kubeconfig, the CA or the authorized attestors
// change, and stops it when the Cluster opts out or is deleted. It is also
// a manager.Runnable (leader-elected) that stops every controller when the
// manager stops.
type ClusterReconciler struct {
	// Client is the manager's cached client (Clusters, Machines).
	Client client.Client
	// APIReader reads Secrets and authoritative Machine lists from the API
	// server, so that the manager never caches Secrets' data.
	APIReader client.Reader
	// Verifiers is the table of providers the signer knows.
	Verifiers map[string]attestor.Verifier
	// MaxLifetime caps issued certificates' lifetime.
	MaxLifetime time.Duration
	// Metrics records CSR decisions; may be nil.
	Metrics controller.Metrics
	// Events, when set, records every CSR decision as an Event on its
	// Machine (events.go).
	Events record.EventRecorder
	// ClientOnly names the providers that issue client certificates only
	// (insecure): their serving signer names are refused.
	ClientOnly []string
	// ChallengeKeys seal the challenges the controller writes (the
	// controller keys, shared by all replicas, rotated); required when a
	// verifier challenges.
	ChallengeKeys attestor.ChallengeKeys
	// Identities applies trust on first use; may be nil (no TOFU).
	Identities engine.IdentityBinder
	// Workers per workload cluster; 0 means 2.
	Workers int
	// UnauthorizedListPeriod is how often the requests to signer names a
	// Cluster cannot be signed through are listed (controller.Config
	// SweepPeriod); 0 means controller.DefaultSweepPeriod.
	UnauthorizedListPeriod time.Duration
	// ClientQPS and ClientBurst rate-limit each workload cluster's client;
	// 0 means DefaultClientQPS and DefaultClientBurst. Every signed CSR
	// costs two writes (approval, certificate).
	ClientQPS   float32
	ClientBurst int
	// RecheckPeriod; 0 means DefaultRecheckPeriod.
	RecheckPeriod time.Duration
	// MinRetry and MaxRetry bound each CSR controller's backoff; 0 means
	// the controller's defaults.
	MinRetry, MaxRetry time.Duration
	// RESTConfig, when set, adjusts each workload cluster's client config
	// (tests; user agent and rate limits are set before it runs).
	RESTConfig func(*rest.Config)
	// ProbePeriod is how often each workload API server is probed;
	// 0 means DefaultProbePeriod.
	ProbePeriod time.Duration
	// LockdownPeriod is how often lockdown is enforced again in Clusters
	// that ask for it; 0 means DefaultLockdownPeriod.
	LockdownPeriod time.Duration
	// MaxConcurrentReconciles bounds how many Clusters are reconciled at
	// once; 0 means 4.
	MaxConcurrentReconciles int
	// ServingCA is the lifetime and rotation of the serving CAs (package
	// trust); zero values mean its defaults.
	ServingCA trust.Policy
	// TrustMetrics, when set, counts serving CA rotations.
	TrustMetrics trust.Metrics
	// Clock decides serving CA rotation and serving certificates' validity;
	// nil means the real clock.
	Clock clock.PassiveClock
	// PodCertificateTiming places pod certificates' notBefore and
	// beginRefreshAt; the zero value is the signer's (set in test builds
	// only, podcert.Timing).
	PodCertificateTiming podcert.Timing
	// TokenLifetime and TokenRenewBefore are the lifetime of the tokens of
	// the controller's identity in each workload cluster and how long
	// before expiry they are renewed (package scoped; 0 means its defaults).
	TokenLifetime, TokenRenewBefore time.Duration
	// IdentityMetrics, when set, counts token renewals and failures.
	IdentityMetrics IdentityMetrics
	// StatusPeriod is how often the ClusterAttestations are brought up to
	// date (status.go); 0 means DefaultStatusPeriod.
	StatusPeriod time.Duration
	// Limits bound every request to each workload API server (package
	// bounds); zero fields mean its defaults.
	Limits bounds.Limits
	// MaxCachedCSRs and MaxCachedCSRBytes are the budget of CSRs cached
	// per workload cluster; 0 means DefaultMaxCachedCSRs and
	// DefaultMaxCachedCSRBytes.
	MaxCachedCSRs     int
	MaxCachedCSRBytes int64
	// BoundsRetry and MaxBoundsRetry bound the backoff of a cluster that
	// exceeded a bound (bounds.go); 0 means DefaultBoundsRetry and
	// DefaultMaxBoundsRetry.
	BoundsRetry, MaxBoundsRetry time.Duration
	// BoundsMetrics, when set, counts the bounds exceeded.
	BoundsMetrics BoundsMetrics
	// Namespace is the controller's own namespace, where tenants cannot
	// write: deleted Machines' pending revocations are kept there
	// (revoke.go). Empty keeps them in memory only.
	Namespace string
	// Shards, when set, shares the opted-in Clusters with the other
	// replicas of its ring (shard.go): this replica serves those assigned
	// to it whose claim it holds, and runs without leader election.
	Shards *shard.Ring
	// Discovery lists the kinds the management cluster serves (kinds.go);
	// nil means one made from the manager's config in SetupWithManager.
	Discovery discovery.DiscoveryInterface
	// WatchFilter, when set, limits the Clusters served to those labelled
	// cluster.x-k8s.io/watch-filter=<WatchFilter> (Cluster API's
	// --watch-filter).
	WatchFilter string

	mu      sync.Mutex
	base    context.Context
	started chan struct{}
	running map[types.NamespacedName]*workload
	// deleted are the Machines of served Clusters seen deleted whose node
	// names are not revoked yet (revoke.go).
	deleted map[types.NamespacedName][]*clusterv1.Machine
	// idle are the Clusters seen but not served, and why: their
	// ClusterAttestations say so (status.go).
	idle map[types.NamespacedName]idleCluster
	// backoff are the Clusters that exceeded a bound and wait to be
	// connected to again; wake has them reconciled then (bounds.go).
	backoff map[types.NamespacedName]*boundsBackoff
	wake    chan event.GenericEvent

	kindsOnce sync.Once
	kindCache *servedKinds
}

// kinds is the manager's RESTMapper behind one list of the infrastructure
// kinds the management cluster serves (kinds.go), shared by every
// Cluster's Machine matcher.
func (r *ClusterReconciler) kinds() meta.RESTMapper {
	r.kindsOnce.Do(func() {
		discover := func() (sets.Set[string], error) {
			return nil, errors.New("no discovery client for the management cluster")
		}
		if r.Discovery != nil {
			discover = discoverKinds(r.Discovery, infrastructureGroup)
		}
		r.kindCache = newServedKinds(r.Client.RESTMapper(), infrastructureGroup, discover, r.clock())
	})
	return r.kindCache
}

type workload struct {
	hash       string
	state      *state
	revocation *revocation
	ctrl       *controller.Controller
	cancel     context.CancelFunc
	done       chan struct{}
	started    time.Time
	run        workloadRun
}

// workloadRun is what a workload's goroutines run with (start).
type workloadRun struct {
	id         *scoped.Identity
	obs        *identityObserver
	cfg        *rest.Config // the controller's own identity's, bounded
	cs         workloadClient
	pub        *trust.Publisher
	clusterRef *corev1.ObjectReference
	trusted    []*x509.Certificate
	over       *overBounds
}

// SetupWithManager registers the reconciler, the Machine index and the
// Runnable with mgr.
func (r *ClusterReconciler) SetupWithManager(ctx context.Context, mgr ctrl.Manager) error {
	r.init()
	if r.Discovery == nil {
		cfg := rest.CopyConfig(mgr.GetConfig())
		cfg.Timeout = discoveryTimeout
		dc, err := discovery.NewDiscoveryClientForConfig(cfg)
		if err != nil {
			return fmt.Errorf("unable to make a discovery client for the management cluster: %w", err)
		}
		r.Discovery = dc
	}
	if err := mgr.GetFieldIndexer().IndexField(ctx, &clusterv1.Machine{}, IndexProviderID, ProviderIDIndexer); err != nil {
		return fmt.Errorf("unable to index Machines by provider ID: %w", err)
	}
	if err := mgr.Add(r); err != nil {
		return err
	}
	leader := r.NeedLeaderElection()
	return ctrl.NewControllerManagedBy(mgr).
		Named("kubelet-authenticator-cluster").
		WithOptions(crcontroller.Options{MaxConcurrentReconciles: cmp.Or(r.MaxConcurrentReconciles, 4), NeedLeaderElection: &leader}).
		For(&clusterv1.Cluster{}, builder.WithPredicates(r.watchFilter())).
		// A ClusterAttestation's spec is its Cluster's policy: a change
		// (a new generation) reconciles that Cluster.
		Watches(&v1alpha1.ClusterAttestation{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			return []reconcile.Request{{NamespacedName: client.ObjectKeyFromObject(o)}}
		}), builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Watches(&clusterv1.Machine{}, handler.Funcs{
			CreateFunc: func(_ context.Context, e event.CreateEvent, _ workqueue.TypedRateLimitingInterface[reconcile.Request]) {
				r.resync(e.Object)
			},
			UpdateFunc: func(_ context.Context, e event.UpdateEvent, _ workqueue.TypedRateLimitingInterface[reconcile.Request]) {
				r.resync(e.ObjectNew)
			},
			DeleteFunc: func(_ context.Context, e event.DeleteEvent, _ workqueue.TypedRateLimitingInterface[reconcile.Request]) {
				r.servedMachineDeleted(e.Object)
			},
		}).
		WatchesRawSource(source.Channel(r.wake, &handler.EnqueueRequestForObject{})).
		Complete(r)
}

func (r *ClusterReconciler) init() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.started == nil {
		r.started = make(chan struct{})
		r.running = map[types.NamespacedName]*workload{}
		r.deleted = map[types.NamespacedName][]*clusterv1.Machine{}
		r.idle = map[types.NamespacedName]idleCluster{}
		r.backoff = map[types.NamespacedName]*boundsBackoff{}
		r.wake = make(chan event.GenericEvent)
	}
}

// NeedLeaderElection implements manager.LeaderElectionRunnable: only the
// leader runs workload controllers, unless the Clusters are shared among
// the replicas (Shards).
func (r *ClusterReconciler) NeedLeaderElection() bool { return r.Shards == nil }

// Start implements manager.Runnable: it holds the context workload
// controllers run under and stops them all when it is done.
func (r *ClusterReconciler) Start(ctx context.Context) error {
	r.init()
	if r.Shards != nil {
		// Never in the ring's goroutine: its renewals must not wait for
		// thousands of Clusters to be queued.
		r.Shards.Changed = func() { go r.reassign(ctx) }
		if err := r.Shards.Join(ctx); err != nil {
			if ctx.Err() != nil {
				return nil // stopped before it joined
			}
			return err
		}
		go r.Shards.Run(ctx)
	}
	r.mu.Lock()
	r.base = ctx
	close(r.started)
	r.mu.Unlock()
	go r.keepStatus(ctx)
	<-ctx.Done()
	r.mu.Lock()
	for nn, w := range r.running {
		w.cancel()
		<-w.done
		delete(r.running, nn)
	}
	r.mu.Unlock()
	if r.Shards != nil {
		r.leaveRing(klog.FromContext(ctx))
	}
	return nil
}

// resync asks the controller of a Machine's Cluster to look at its pending
// CSRs again: the Machine may have become ready.
func (r *ClusterReconciler) resync(o client.Object) {
	name := o.GetLabels()[clusterv1.ClusterNameLabel]
	if name == "" {
		return
	}
	r.mu.Lock()
	w := r.running[types.NamespacedName{Namespace: o.GetNamespace(), Name: name}]
	r.mu.Unlock()
	if w != nil {
		w.ctrl.Resync()
	}
}

// Running reports whether a CSR controller runs for cluster.
func (r *ClusterReconciler) Running(cluster types.NamespacedName) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.running[cluster]
	return ok
}

// Reconcile implements reconcile.Reconciler.
func (r *ClusterReconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	logger := klog.FromContext(ctx).WithValues("cluster", req.NamespacedName)
	select {
	case <-r.started:
	case <-ctx.Done():
		return reconcile.Result{}, ctx.Err()
	}
	if elsewhere, err := r.notAssigned(ctx, logger, req.NamespacedName); elsewhere || err != nil {
		return reconcile.Result{}, err
	}
	cluster, err := r.servedCluster(ctx, logger, req.NamespacedName)
	if cluster == nil {
		return reconcile.Result{}, err
	}
	if held, res, err := r.claim(ctx, logger, req.NamespacedName); !held {
		return res, err
	}
	s := &clusterScope{logger: logger, cluster: cluster, nn: req.NamespacedName}
	if s.policy, s.policyErrs, err = r.readPolicy(ctx, cluster); err != nil {
		return reconcile.Result{}, err
	}
	if d := r.inBackoff(cluster); d > 0 {
		return reconcile.Result{RequeueAfter: d}, nil
	}

	period := cmp.Or(r.RecheckPeriod, DefaultRecheckPeriod)
	if period < 0 {
		period = DefaultRecheckPeriod
	}
	refused, err := r.readWorkloadSecrets(ctx, s)
	if refused {
		return reconcile.Result{RequeueAfter: period}, nil
	}
	var next time.Time // when the serving CAs change next
	if err == nil {
		next, err = r.ensure(ctx, s)
	}
	if apierrors.IsNotFound(err) {
		logger.Info("Waiting for the Cluster's Secrets", "err", err.Error())
		r.setIdle(s.nn, s.idle(ReasonWaitingForSecrets, err.Error()))
		return reconcile.Result{RequeueAfter: missingSecretRetry}, nil
	}
	if err != nil {
		return reconcile.Result{}, err
	}
	r.setIdle(s.nn, nil)
	r.mu.Lock()
	w := r.running[s.nn]
	r.mu.Unlock()
	if w != nil {
		p := paused(cluster)
		w.revocation.clusterPaused(p)
		w.state.update(func(s *ClusterStatus) { s.Paused = p })
	}
	if d := next.Sub(r.now()); !next.IsZero() && d < period {
		period = max(d, time.Second)
	}
	return reconcile.Result{RequeueAfter: period}, nil
}

// clusterScope is what one reconcile of an opted-in Cluster reads, phase
// by phase: the Cluster and its policy (Reconcile), its CA and kubeconfig
// (readWorkloadSecrets), then what ensure builds from them.
type clusterScope struct {
	logger     klog.Logger
	cluster    *clusterv1.Cluster
	nn         types.NamespacedName
	policy     ClusterPolicy
	policyErrs field.ErrorList
	ca         *ClusterCA
	kubeconfig []byte
	restConfig *rest.Config
}

// idle is the status of the opted-in Cluster while it is not served.
func (s *clusterScope) idle(reason, message string) *idleCluster {
	return &idleCluster{uid: s.cluster.UID, generation: s.cluster.Generation, optedIn: true, reason: reason, message: message}
}

// servedCluster reads the Cluster and returns it if it is to be served;
// otherwise it stops its controller, records why, and returns nil.
func (r *ClusterReconciler) servedCluster(ctx context.Context, logger klog.Logger, nn types.NamespacedName) (*clusterv1.Cluster, error) {
	var cluster clusterv1.Cluster
	if err := r.Client.Get(ctx, nn, &cluster); err != nil {
		if !apierrors.IsNotFound(err) {
			return nil, err
		}
		r.stop(logger, nn, "Cluster deleted")
		r.setIdle(nn, nil)
		return nil, r.forget(ctx, nn)
	}
	switch {
	case r.filtered(&cluster):
		r.stop(logger, nn, "Cluster not selected by --watch-filter")
		r.setIdle(nn, nil)
		return nil, r.forget(ctx, nn)
	case !cluster.DeletionTimestamp.IsZero():
		r.stop(logger, nn, "Cluster is being deleted")
		r.setIdle(nn, nil)
		return nil, r.forget(ctx, nn)
	case !Enabled(&cluster):
		r.stop(logger, nn, "Cluster opted out")
		r.setIdle(nn, &idleCluster{generation: cluster.Generation, reason: ReasonOptedOut})
		return nil, r.forget(ctx, nn)
	}
	return &cluster, nil
}

// readWorkloadSecrets reads the Cluster's CA and kubeconfig into s. It
// reports refused when either is refused (recorded on the Cluster), and
// returns the error of a read, NotFound included.
func (r *ClusterReconciler) readWorkloadSecrets(ctx context.Context, s *clusterScope) (refused bool, err error) {
	// The CA first: a Secret whose certificate its key does not prove
	// could name another cluster's CA, which evidence is bound to.
	s.ca, err = ReadCA(ctx, r.APIReader, s.nn)
	if refusedCA := (*RefusedCAError)(nil); errors.As(err, &refusedCA) {
		r.refuseCA(s.logger, s.cluster, refusedCA)
		r.setIdle(s.nn, s.idle(ReasonCARefused, refusedCA.Error()))
		return true, nil
	}
	if err != nil {
		return false, err
	}
	if s.kubeconfig, err = ReadKubeconfig(ctx, r.APIReader, s.nn); err != nil {
		return false, err
	}
	// The kubeconfig is tenant input: checked before anything is read or
	// connected to on its behalf.
	s.restConfig, err = WorkloadRESTConfig(s.kubeconfig)
	if fields, isRefused := refusedFields(err); isRefused {
		r.refuseKubeconfig(s.logger, s.cluster, fields, err)
		r.setIdle(s.nn, s.idle(ReasonKubeconfigRefused, fmt.Sprintf("Secret %s not used: %v", s.cluster.Name+KubeconfigSecretSuffix, err)))
		return true, nil
	}
	return false, err
}

// ensure runs a controller for the Cluster with this configuration,
// replacing one with another. It returns when the serving CAs change next.
func (r *ClusterReconciler) ensure(ctx context.Context, s *clusterScope) (time.Time, error) {
	servingCAs, err := r.ensureServingCA(ctx, s.cluster)
	if err != nil {
		return time.Time{}, err
	}
	next := servingCAs.NextChange
	policyErrors := r.checkPolicy(s.logger, s.cluster, &s.policy, s.policyErrs)
	hash, err := workloadInputs{Kubeconfig: s.kubeconfig, CA: s.ca.PEM, ClusterUID: string(s.cluster.UID),
		ServingCAs: servingCAs.Fingerprint(), Policy: s.policy.ClusterAttestationSpec}.hash()
	if err != nil {
		return next, err
	}
	r.mu.Lock()
	cur := r.running[s.nn]
	r.mu.Unlock()
	if cur != nil && cur.hash == hash {
		cur.state.update(func(st *ClusterStatus) {
			st.ObservedGeneration, st.PolicyErrors, st.PolicySource = s.cluster.Generation, policyErrors, s.policy.Source
		})
		return next, nil
	}

	profiles := r.profiles(s, servingCAs)
	st := r.newState(s, cur, servingCAs, profiles, policyErrors)
	w, err := r.newWorkload(s, servingCAs, profiles, st, hash)
	if err != nil {
		return next, err
	}
	if cur != nil {
		r.stop(s.logger, s.nn, reasonRestart)
	}
	if err := r.start(s, w); err != nil {
		return next, err
	}
	s.logger.Info("Started the CSR controller", "authorizedAttestors", s.policy.AuthorizedAttestors, "caExpires", s.ca.CA.Cert.NotAfter,
		"servingCAExpires", servingCAs.Signing.Cert.NotAfter, "servingCAs", len(servingCAs.Trusted))
	return next, nil
}

// newState is the status of the Cluster's new controller; the generation
// and the last decision carry over from the one it replaces.
func (r *ClusterReconciler) newState(s *clusterScope, cur *workload, servingCAs *trust.Authority, profiles []*engine.Profile, policyErrors string) *state {
	st := &state{ClusterStatus: ClusterStatus{
		Cluster: s.nn, ClusterUID: s.cluster.UID, ObservedGeneration: s.cluster.Generation,
		PolicyErrors: policyErrors, PolicySource: s.policy.Source,
		AuthorizedAttestors: s.policy.AuthorizedAttestors,
		SignerNames:         servedSignerNames(profiles, s.policy.AuthorizedAttestors),
		Lockdown:            s.policy.Lockdown, ServingApproval: s.policy.ApproveKubeletServing, Generation: 1,
		ServingCAExpiry: servingCAs.Signing.Cert.NotAfter, ServingCAs: len(servingCAs.Trusted),
	}}
	if cur != nil { // the last decision outlives a restart
		prev := cur.state.snapshot()
		st.Generation, st.LastDecision = prev.Generation+1, prev.LastDecision
	}
	return st
}

// profiles are the signing profiles of the Cluster's signers.
func (r *ClusterReconciler) profiles(s *clusterScope, servingCAs *trust.Authority) []*engine.Profile {
	return engine.Profiles(engine.ProfileSet{
		Verifiers:      r.Verifiers,
		ClientOnly:     r.ClientOnly,
		Client:         &issue.Signer{CA: s.ca.CA, MaxLifetime: r.MaxLifetime},
		Serving:        &issue.Signer{CA: servingCAs.Signing, Serving: true, MaxLifetime: r.MaxLifetime, Clock: r.Clock},
		KubeletServing: s.policy.ApproveKubeletServing,
	})
}

// adminConfig is the workload cluster's admin client configuration: the
// tenant's kubeconfig with our user agent and rate limits, every answer
// read through the bounds (package bounds), one exceeded stopping the
// Cluster's controller for a while (bounds.go).
func (r *ClusterReconciler) adminConfig(s *clusterScope, over *overBounds) (*rest.Config, func(http.RoundTripper) http.RoundTripper) {
	cfg := rest.CopyConfig(s.restConfig)
	cfg.UserAgent = "node-attestation-controller"
	// Protobuf, as kube-controller-manager talks to its API server: a
	// request or watch event decodes in a fraction of the CPU JSON takes.
	// Clients of types without protobuf (dynamic ones) ask for JSON.
	cfg.ContentType = runtime.ContentTypeProtobuf
	cfg.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	cfg.QPS, cfg.Burst = DefaultClientQPS, DefaultClientBurst
	if r.ClientQPS > 0 {
		cfg.QPS = r.ClientQPS
	}
	if r.ClientBurst > 0 {
		cfg.Burst = r.ClientBurst
	}
	if r.RESTConfig != nil {
		r.RESTConfig(cfg)
	}
	bound := r.Limits.Wrap(over.exceeded)
	cfg.Wrap(bound)
	return cfg, bound
}

// newWorkload builds the Cluster's controller and what it runs with: the
// controller's own identity in the workload cluster (every client works
// through its tokens, identity.go), the clients, the publisher of the
// serving CAs and the revocation of deleted Machines' certificates.
func (r *ClusterReconciler) newWorkload(s *clusterScope, servingCAs *trust.Authority, profiles []*engine.Profile, st *state, hash string) (*workload, error) {
	over := &overBounds{r: r, logger: s.logger, cluster: s.cluster}
	admin, bound := r.adminConfig(s, over)
	obs := &identityObserver{r: r, logger: s.logger, cluster: s.cluster, st: st}
	id, err := scoped.New(scoped.Config{Admin: admin, TokenLifetime: r.TokenLifetime, RenewBefore: r.TokenRenewBefore,
		Providers: slices.Sorted(maps.Keys(r.Verifiers)), Observer: obs})
	if err != nil {
		return nil, fmt.Errorf("unable to set up the controller's identity in the workload cluster: %w", err)
	}
	cfg := id.RESTConfig()
	cfg.Wrap(bound)
	cs, err := newWorkloadClient(cfg)
	if err != nil {
		return nil, fmt.Errorf("unable to build the workload cluster's client: %w", err)
	}
	authorized := s.policy.AuthorizedAttestors
	pub, err := newPublisher(cfg, r.servingSignerNames(authorized), s.cluster.UID)
	if err != nil {
		return nil, fmt.Errorf("unable to build the workload cluster's client: %w", err)
	}
	clusterRef := &corev1.ObjectReference{APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster",
		Namespace: s.nn.Namespace, Name: s.nn.Name, UID: s.cluster.UID}
	revocation := r.newRevocation(cs)
	c, err := controller.New(controller.Config{
		Cluster: s.nn.String(),
		Client:  cs,
		Engine: engine.Config{
			Profiles:              profiles,
			Authorized:            authorized,
			Policies:              s.policy.Documents(),
			ClusterUID:            string(s.cluster.UID),
			ClusterCAs:            s.ca.Bundle,
			RequireClusterBinding: s.policy.RequireClusterBinding,
			Machines:              &Matcher{Cache: r.Client, Live: r.APIReader, Namespace: s.nn.Namespace, Cluster: s.nn.Name, Mapper: r.kinds()},
			Identities:            r.Identities,
			ChallengeKeys:         r.ChallengeKeys,
		},
		Metrics:           r.Metrics,
		Events:            r.decisionEvents(s.cluster, st),
		Workers:           cmp.Or(max(r.Workers, 0), 2),
		SweepPeriod:       r.UnauthorizedListPeriod,
		MinRetry:          r.MinRetry,
		MaxRetry:          r.MaxRetry,
		Issuing:           &acceptor{r: r, rv: revocation.rv, cluster: clusterRef, st: st},
		ListPageSize:      bounds.DefaultListPageSize,
		MaxCachedCSRs:     r.maxCachedCSRs(),
		MaxCachedCSRBytes: r.maxCachedCSRBytes(),
		OverBudget:        over.budgetExceeded,
	})
	if err != nil {
		return nil, err
	}
	return &workload{hash: hash, state: st, revocation: revocation, ctrl: c, done: make(chan struct{}),
		run: workloadRun{id: id, obs: obs, cfg: cfg, cs: cs, pub: pub, clusterRef: clusterRef, trusted: servingCAs.Trusted, over: over}}, nil
}

// start runs w as the Cluster's controller under the manager's context.
// The probe reports the cluster disconnected until the controller's
// identity is installed; everything else waits for it, and the CSR
// controller also for the serving CAs to be published (a new serving CA
// signs once it is).
func (r *ClusterReconciler) start(s *clusterScope, w *workload) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.base == nil || r.base.Err() != nil {
		return errors.New("the manager is stopping")
	}
	// The controller logs under the manager's logger (it adds the cluster),
	// not under this reconcile's.
	wctx, cancel := context.WithCancel(r.base)
	w.cancel, w.started = cancel, time.Now()
	r.running[s.nn] = w
	run := w.run
	run.over.running(w)
	background := klog.FromContext(wctx).WithValues("cluster", s.nn)
	probing := probe(wctx, run.cs, w.state, cmp.Or(r.ProbePeriod, DefaultProbePeriod))
	go func() {
		defer close(w.done)
		if !r.connect(wctx, s.logger, s.cluster, run.id, run.obs) {
			return
		}
		probing.Wake()
		go run.id.Run(wctx)
		r.keepRevocations(wctx, background, run.clusterRef, w.revocation, w.state, r.revocationPeriod())
		go r.keepPodCertificates(wctx, background, s.cluster, s.policy.Pods, run.cfg, w.ctrl.Engine())
		if s.policy.Lockdown {
			r.lockdown(wctx, background, run.cs, w.state)
		} else {
			r.unlock(wctx, background, run.cs, w.state, s.nn)
		}
		published := make(chan struct{})
		keepPublished(wctx, run.pub, run.trusted, w.state, cmp.Or(r.RecheckPeriod, DefaultRecheckPeriod), published)
		select {
		case <-published:
		case <-wctx.Done():
			return
		}
		if err := w.ctrl.Run(wctx); err != nil && wctx.Err() == nil {
			s.logger.Error(err, "CSR controller stopped")
		}
	}()
	return nil
}

// Reasons of the Events on a Cluster about its policy.
const (
	// ReasonPolicyInvalid: the policy has problems (ParseClusterPolicy).
	ReasonPolicyInvalid = "PolicyInvalid"
	// ReasonPolicyAnnotationsDeprecated: the policy is read from the
	// Cluster's deprecated annotations.
	ReasonPolicyAnnotationsDeprecated = "PolicyAnnotationsDeprecated"
	// ReasonPolicyAnnotationsIgnored: the Cluster carries deprecated
	// policy annotations beside a ClusterAttestation spec, which wins.
	ReasonPolicyAnnotationsIgnored = "PolicyAnnotationsIgnored"
)

// readPolicy reads cluster's policy: its ClusterAttestation (from the
// cache) and its annotations, parsed once (ParseClusterPolicy).
func (r *ClusterReconciler) readPolicy(ctx context.Context, cluster *clusterv1.Cluster) (ClusterPolicy, field.ErrorList, error) {
	att := &v1alpha1.ClusterAttestation{}
	err := r.Client.Get(ctx, client.ObjectKeyFromObject(cluster), att)
	switch {
	case apierrors.IsNotFound(err):
		att = nil
	case err != nil:
		return ClusterPolicy{}, nil, fmt.Errorf("unable to read ClusterAttestation %s/%s: %w", cluster.Namespace, cluster.Name, err)
	}
	policy, errs := ParseClusterPolicy(cluster, att, r.Verifiers)
	return policy, errs, nil
}

// workloadInputs is everything a workload's controller is built from: a
// change restarts it.
type workloadInputs struct {
	Kubeconfig []byte
	CA         []byte
	ClusterUID string
	ServingCAs string
	Policy     v1alpha1.ClusterAttestationSpec
}

func (w workloadInputs) hash() (string, error) {
	b, err := json.Marshal(w)
	if err != nil {
		return "", fmt.Errorf("unable to hash the workload's configuration: %w", err)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:]), nil
}

// checkPolicy returns the problems of cluster's policy as one message,
// empty when there are none. When they, or where the policy is read from,
// differ from what the Cluster's controller last had, it says so: in the
// log and in an Event on the Cluster (problems, deprecated annotations
// read, or annotations ignored beside the spec).
func (r *ClusterReconciler) checkPolicy(logger klog.Logger, cluster *clusterv1.Cluster, policy *ClusterPolicy, errs field.ErrorList) string {
	var msg string
	if len(errs) > 0 {
		msg = errs.ToAggregate().Error()
	}
	r.mu.Lock()
	cur := r.running[types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name}]
	r.mu.Unlock()
	var last ClusterStatus
	if cur != nil {
		last = cur.state.snapshot()
	}
	if cur == nil || last.PolicySource != policy.Source {
		switch {
		case policy.Source == v1alpha1.PolicySourceAnnotations:
			logger.Info("The Cluster's policy is read from deprecated annotations: move it to the spec of its ClusterAttestation")
			r.clusterEvent(cluster, corev1.EventTypeWarning, ReasonPolicyAnnotationsDeprecated,
				"The policy of Cluster %s is read from its annotations, which are deprecated: write it as the spec of ClusterAttestation %s (docs/status.md)", cluster.Name,
				cluster.Name)
		case len(policy.IgnoredAnnotations) > 0:
			logger.Info("The Cluster's deprecated policy annotations are ignored: its ClusterAttestation has a spec", "annotations", policy.IgnoredAnnotations)
			r.clusterEvent(cluster, corev1.EventTypeWarning, ReasonPolicyAnnotationsIgnored,
				"Annotations %s of Cluster %s are ignored: the spec of ClusterAttestation %s is the policy; remove them", truncate(strings.Join(policy.IgnoredAnnotations,
					", "), 1024), cluster.Name, cluster.Name)
		}
	}
	if (cur == nil && msg == "") || (cur != nil && last.PolicyErrors == msg) {
		return msg
	}
	if msg == "" {
		logger.Info("The Cluster's policy is valid again")
		return msg
	}
	logger.Info("The Cluster's policy has problems", "errors", msg)
	r.clusterEvent(cluster, corev1.EventTypeWarning, ReasonPolicyInvalid, "Policy of Cluster %s: %s (details in its ClusterAttestation)", cluster.Name,
		truncate(msg, 1024))
	return msg
}

// reasonRestart is why a workload's controller is stopped to start another.
const reasonRestart = "configuration changed"

// ReasonKubeconfigRefused is the reason of the Warning Event on a Cluster
// whose `<cluster>-kubeconfig` Secret is refused (RefusedKubeconfigError).
const ReasonKubeconfigRefused = "KubeconfigRefused"

// refuseKubeconfig stops cluster's controller, if one runs, and says why:
// in the log and in an Event on the Cluster, naming the fields refused.
func (r *ClusterReconciler) refuseKubeconfig(logger klog.Logger, cluster *clusterv1.Cluster, fields []string, err error) {
	nn := types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name}
	r.stop(logger, nn, "kubeconfig refused")
	secret := nn.Name + KubeconfigSecretSuffix
	logger.Info("Refusing the workload cluster's kubeconfig: it must carry only inline credentials", "secret", secret, "fields", fields, "err", err.Error())
	if r.Events != nil {
		ref := &corev1.ObjectReference{APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Namespace: nn.Namespace, Name: nn.Name, UID: cluster.UID}
		r.Events.Eventf(ref, corev1.EventTypeWarning, ReasonKubeconfigRefused, "Secret %s not used: %v", secret, err)
	}
}

// idleCluster is a Cluster seen and not served: opted out, or opted in
// and not served yet (reason and message say why).
type idleCluster struct {
	uid             types.UID
	generation      int64
	optedIn         bool
	reason, message string
	// bound is the bound the workload API server exceeded, when that is why.
	bound string
}

// Reasons a Cluster is not served, in its ClusterAttestation.
const (
	ReasonOptedOut          = "OptedOut"
	ReasonWaitingForSecrets = "WaitingForSecrets"
)

// setIdle records why cluster is not served, or (nil) that it is served or
// gone.
func (r *ClusterReconciler) setIdle(cluster types.NamespacedName, idle *idleCluster) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if idle == nil {
		delete(r.idle, cluster)
		return
	}
	r.idle[cluster] = *idle
}

func (r *ClusterReconciler) stop(logger klog.Logger, nn types.NamespacedName, why string) {
	r.mu.Lock()
	w := r.running[nn]
	delete(r.running, nn)
	if why != reasonRestart && why != reasonBounds {
		delete(r.deleted, nn)
	}
	if why != reasonBounds {
		delete(r.backoff, nn)
	}
	r.mu.Unlock()
	if w == nil {
		return
	}
	w.cancel()
	select {
	case <-w.done:
		logger.Info("Stopped the CSR controller", "why", why)
	case <-time.After(stopGrace):
		// It stops on its own once its requests time out; the Cluster's
		// new controller (if any) does not wait for it.
		logger.Info("CSR controller is still stopping, moving on", "why", why, "waited", stopGrace)
	}
}
