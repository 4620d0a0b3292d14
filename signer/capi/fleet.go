package capi

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"k8s.io/apimachinery/pkg/types"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/signer/periodic"
)

// Defaults of the per-cluster loops.
const (
	// DefaultProbePeriod is how often each workload cluster's API server is
	// asked whether it is ready.
	DefaultProbePeriod = 30 * time.Second
	// probeTimeout bounds one probe, so that a cluster that does not answer
	// is reported disconnected promptly.
	probeTimeout = 5 * time.Second
	// DefaultLockdownPeriod is how often lockdown is enforced again.
	DefaultLockdownPeriod = time.Minute
	// stopGrace bounds how long stopping a workload controller is waited
	// for, so that a controller stuck on an unreachable cluster does not
	// hold up the reconciler (and with it every other cluster).
	stopGrace = 10 * time.Second
)

// ClusterStatus is what the controller knows about one workload cluster it
// serves, for metrics and tests.
type ClusterStatus struct {
	Cluster types.NamespacedName
	// ClusterUID is the UID of the Cluster object served, and
	// ObservedGeneration its metadata.generation.
	ClusterUID         types.UID
	ObservedGeneration int64
	// AuthorizedAttestors are the providers the Cluster authorizes, and
	// SignerNames the signer names of theirs the controller decides in the
	// workload cluster (a client-only provider's serving signer name, which
	// is refused, is not among them).
	AuthorizedAttestors []string
	SignerNames         []string
	// Connected is true when the last probe of the workload API server
	// (/readyz) succeeded; LastContact is when one last did, and LastError
	// the last probe's error.
	Connected   bool
	LastContact time.Time
	LastError   string
	// Synced is true once the CSR controller has listed the cluster's CSRs.
	Synced bool
	// QueueDepth is the number of CSRs waiting to be decided.
	QueueDepth int
	// Lockdown is true when bootstrap auto-approve bindings are kept
	// disarmed; LockdownRemoved counts the bindings disarmed since the
	// controller started, and LockdownError is the last enforcement (or
	// restoration) error.
	// LockdownEnforced is true once the last enforcement succeeded (false
	// when lockdown is not asked for, or once it was lifted).
	// LockdownHeld says why the bindings lockdown disarmed are not
	// restored although lockdown is not asked for (lockdown.go).
	Lockdown         bool
	LockdownEnforced bool
	LockdownRemoved  int
	LockdownError    string
	LockdownHeld     string
	// Paused is true while the Cluster is paused (Cluster API's
	// spec.paused or paused annotation): revocation waits, and so does
	// lifting lockdown; CSRs are still decided.
	Paused bool
	// ServingApproval is true when kubelet-serving CSRs are approved.
	ServingApproval bool
	// Generation counts the controllers started for this Cluster (one more
	// each time its kubeconfig, CA or settings change).
	Generation int
	// ServingCAExpiry is when the serving CA that signs expires, and
	// ServingCAs how many serving CAs are published (two during a
	// rotation).
	ServingCAExpiry time.Time
	ServingCAs      int
	// TrustBundlesPublished is true when the last publication of the
	// serving CAs as ClusterTrustBundles succeeded; TrustBundleError is why
	// it did not.
	TrustBundlesPublished bool
	TrustBundleError      string
	// ScopedIdentity is true when the controller works through tokens of
	// its own ServiceAccount in the workload cluster (package scoped), false
	// when it works as the kubeconfig's user (one that is not an admin).
	// TokenExpiry is when the current token expires, TokenRenewals how many
	// times it was renewed since the controller started, and IdentityError
	// the last renewal's error.
	ScopedIdentity bool
	TokenExpiry    time.Time
	TokenRenewals  int
	IdentityError  string
	// RevokedNodes is how many node names of deleted Machines are refused
	// in the workload cluster (package revoke); RevocationErrors counts the
	// failed attempts to write the revocations since the controller
	// started, and RevocationError is the last one's error.
	RevokedNodes     int
	RevocationErrors int
	RevocationError  string
	// PolicyErrors are the problems of the Cluster's policy
	// (ParseClusterPolicy); empty when there are none.
	PolicyErrors string
	// PolicySource says where the policy was read.
	PolicySource v1alpha1.PolicySource
	// LastDecision is the last CSR the controller approved, denied or
	// failed in the workload cluster; zero before the first.
	LastDecision Decision
}

// Decision is one CSR decision, as the controller's Recorder reports it.
type Decision struct {
	Time time.Time
	// CSR is the request's name, Machine the Machine it matched (empty
	// when it matched none).
	CSR     string
	Machine string
	// Outcome is controller.DecisionApproved, DecisionDenied or
	// DecisionFailed; Reason and Message are the decision's.
	Outcome string
	Reason  string
	Message string
}

// state is the mutable part of a workload's status.
type state struct {
	mu sync.Mutex
	ClusterStatus
}

// update changes the status by f. The errors it keeps are cut to
// maxStatusError bytes: they quote what a tenant's API server answered,
// and each opted-in Cluster holds its own for as long as it is served.
func (s *state) update(f func(*ClusterStatus)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(&s.ClusterStatus)
	c := &s.ClusterStatus
	for _, e := range []*string{&c.LastError, &c.LockdownError, &c.TrustBundleError, &c.IdentityError, &c.RevocationError} {
		*e = briefError(*e)
	}
}

// maxStatusError is the most of an error's text a Cluster's status keeps.
const maxStatusError = 1024

// briefError returns msg, or its first maxStatusError bytes (whole
// characters) with how much was cut, copied so that the cut text is not
// kept alive.
func briefError(msg string) string {
	if len(msg) <= maxStatusError {
		return msg
	}
	n := maxStatusError
	for n > 0 && !utf8.RuneStart(msg[n]) {
		n--
	}
	return fmt.Sprintf("%s… (%d more bytes)", msg[:n], len(msg)-n)
}

func (s *state) snapshot() ClusterStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ClusterStatus
}

// Statuses returns the status of every workload cluster a controller runs
// for, sorted by Cluster.
func (r *ClusterReconciler) Statuses() []ClusterStatus {
	r.mu.Lock()
	ws := make([]*workload, 0, len(r.running))
	for _, w := range r.running {
		ws = append(ws, w)
	}
	r.mu.Unlock()
	out := make([]ClusterStatus, 0, len(ws))
	for _, w := range ws {
		st := w.state.snapshot()
		st.Synced = w.ctrl.HasSynced()
		st.QueueDepth = w.ctrl.QueueLen()
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b ClusterStatus) int { return strings.Compare(a.Cluster.String(), b.Cluster.String()) })
	return out
}

// probe asks the workload API server for /readyz every period and records
// the outcome, until ctx is done, on a timer (it returns at once). Its
// first run is at once, before the controller's identity is installed, and
// fails; start wakes the returned loop once it is, so that a Cluster served
// reads reachable then, not a period later.
func probe(ctx context.Context, cs workloadClient, st *state, period time.Duration) *periodic.Loop {
	return periodic.Start(ctx, func(ctx context.Context) (time.Duration, bool) {
		pctx, cancel := context.WithTimeout(ctx, probeTimeout)
		defer cancel()
		_, err := cs.CoreV1().RESTClient().Get().AbsPath("/readyz").DoRaw(pctx)
		if ctx.Err() != nil {
			return 0, false
		}
		st.update(func(s *ClusterStatus) {
			s.Connected = err == nil
			if err == nil {
				s.LastContact, s.LastError = time.Now(), ""
			} else {
				s.LastError = err.Error()
			}
		})
		return period, true
	})
}
