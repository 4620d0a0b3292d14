package capi

import (
	"cmp"
	"context"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/periodic"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
)

// Reasons of the Events revocation records on a Cluster.
const (
	// ReasonNodeRevoked: a deleted Machine's node name is refused in the
	// workload cluster (package revoke).
	ReasonNodeRevoked = "NodeRevoked"
	// ReasonRevokedNodeAccepted: a certificate issued to a new Machine of a
	// revoked node name is accepted.
	ReasonRevokedNodeAccepted = "RevokedNodeCertificateAccepted"
	// ReasonRevocationExpired: a revoked name is dropped from the list,
	// every certificate issued before its revocation having expired.
	ReasonRevocationExpired = "NodeRevocationExpired"
	// ReasonRevocationFailed: the revocations could not be written to the
	// workload cluster; retried.
	ReasonRevocationFailed = "NodeRevocationFailed"
)

// revocation is the revocation side of one workload.
type revocation struct {
	rv *revoke.Revoker

	mu   sync.Mutex
	loop *periodic.Loop // keepRevocations, once started
	// paused: the Cluster was paused when last reconciled.
	paused bool
}

// clusterPaused notes whether the Cluster is paused now, and has the
// revocations kept at once when it was and is no longer: the deletions
// that waited are enforced then, not at the next period.
func (v *revocation) clusterPaused(now bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	was := v.paused
	v.paused = now
	if was && !now && v.loop != nil {
		v.loop.Wake()
	}
}

// wake has the revocations kept now: a Machine was deleted. Before
// keepRevocations starts there is nothing to wake; its first run comes
// after the deletion was noted and reads it.
func (v *revocation) wake() {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.loop != nil {
		v.loop.Wake()
	}
}

// Pending revocations are kept in the management cluster, in the
// controller's namespace (ClusterReconciler.Namespace) where tenants cannot
// write, one ConfigMap per deleted Machine, until its node names are
// revoked in the workload cluster: a Cluster that opts out, or whose
// kubeconfig is refused, before that has them revoked when it is served
// again, and so does the next leader.
const (
	// PendingRevocationPrefix begins the name of a pending revocation's
	// ConfigMap; the deleted Machine's UID follows.
	PendingRevocationPrefix = "ka-revoke-"
	// LabelPendingRevocation marks a pending revocation's ConfigMap.
	LabelPendingRevocation = "kubelet-authenticator.x-k8s.io/pending-revocation"
	// KeyPendingCluster holds the Cluster's namespace/name, and
	// KeyPendingMachine the deleted Machine (what revocation reads of it:
	// names, UID, nodeRef, addresses) as JSON.
	KeyPendingCluster = "cluster"
	KeyPendingMachine = "machine.json"
	// pendingWriteTimeout bounds the write of a pending revocation from
	// the informer's deletion hook.
	pendingWriteTimeout = 10 * time.Second
)

// MachineDeleted is called for every Machine the manager's informer sees
// deleted (the trust-on-first-use cleaner's deletion hook, signer/tofu).
// The node names of a Machine of a served Cluster, or of an opted-in one
// not served now (its kubeconfig refused, say), are revoked in its workload
// cluster: the deletion is recorded in the management cluster first, so
// that it is not forgotten when the Cluster stops being served before that.
func (r *ClusterReconciler) MachineDeleted(obj client.Object) {
	m, ok := obj.(*clusterv1.Machine)
	if !ok {
		return
	}
	name := m.Labels[clusterv1.ClusterNameLabel]
	if name == "" {
		return
	}
	nn := types.NamespacedName{Namespace: m.Namespace, Name: name}
	r.mu.Lock()
	idle, isIdle := r.idle[nn]
	served := r.running[nn] != nil || (isIdle && idle.optedIn)
	base := r.base
	r.mu.Unlock()
	var cluster *clusterv1.Cluster
	if base != nil {
		var c clusterv1.Cluster
		if r.Client.Get(base, nn, &c) == nil {
			cluster = &c
		}
	}
	if !served {
		// Opted in but not served at this moment (starting, its workload
		// API server unreachable): certificates may have been issued.
		served = cluster != nil && Enabled(cluster)
	}
	if !served {
		return // not served: nothing was issued through this controller
	}
	if cluster != nil && paused(cluster) {
		// Revoked later if it is still gone once the Cluster is unpaused
		// (unseenDeletions).
		klog.FromContext(base).Info("A Machine of a paused Cluster was deleted: its node names are not revoked while the Cluster is paused",
			"cluster", nn, "machine", klog.KObj(m))
		return
	}
	d := deletedMachine(m)
	if r.Namespace != "" && base != nil {
		ctx, cancel := context.WithTimeout(base, pendingWriteTimeout)
		err := r.recordPending(ctx, nn, d)
		cancel()
		if err != nil {
			// Still revoked while this process leads and serves the
			// Cluster (below); forgotten if it stops first.
			klog.FromContext(base).Error(err, "Unable to record a deleted Machine's pending revocation", "cluster", nn, "machine", klog.KObj(m))
		}
	}
	if r.Shards != nil && !r.Shards.Mine(nn.String()) {
		return // recorded: the replica the Cluster is assigned to reads it
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if !slices.ContainsFunc(r.deleted[nn], func(o *clusterv1.Machine) bool { return o.UID == d.UID }) {
		r.deleted[nn] = append(r.deleted[nn], d)
	}
	if w := r.running[nn]; w != nil {
		w.revocation.wake()
	}
}

// deletedMachine is what revocation keeps of a deleted Machine.
func deletedMachine(m *clusterv1.Machine) *clusterv1.Machine {
	d := &clusterv1.Machine{ObjectMeta: metav1.ObjectMeta{Namespace: m.Namespace, Name: m.Name, UID: m.UID,
		Labels: map[string]string{clusterv1.ClusterNameLabel: m.Labels[clusterv1.ClusterNameLabel]}}}
	d.Status.NodeRef = m.Status.NodeRef
	d.Status.Addresses = slices.Clone(m.Status.Addresses)
	return d
}

func pendingName(uid types.UID) string { return PendingRevocationPrefix + string(uid) }

// recordPending writes the pending revocation of the deleted Machine d of
// Cluster nn.
func (r *ClusterReconciler) recordPending(ctx context.Context, nn types.NamespacedName, d *clusterv1.Machine) error {
	raw, err := json.Marshal(d)
	if err != nil {
		return fmt.Errorf("unable to encode Machine %s/%s: %w", d.Namespace, d.Name, err)
	}
	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Namespace: r.Namespace, Name: pendingName(d.UID), Labels: map[string]string{LabelPendingRevocation: "true"}},
		Data:       map[string]string{KeyPendingCluster: nn.String(), KeyPendingMachine: string(raw)},
	}
	if err := r.Client.Create(ctx, cm); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("unable to create ConfigMap %s/%s: %w", cm.Namespace, cm.Name, err)
	}
	return nil
}

// pendingRevocations returns the deleted Machines of Cluster nn whose node
// names are not revoked yet: those this process saw deleted and those
// recorded in the management cluster. Records of Clusters that no longer
// exist are removed.
func (r *ClusterReconciler) pendingRevocations(ctx context.Context, logger klog.Logger, nn types.NamespacedName) ([]*clusterv1.Machine, error) {
	r.mu.Lock()
	pending := slices.Clone(r.deleted[nn])
	r.mu.Unlock()
	if r.Namespace == "" {
		return pending, nil
	}
	var list corev1.ConfigMapList
	if err := r.APIReader.List(ctx, &list, client.InNamespace(r.Namespace), client.MatchingLabels{LabelPendingRevocation: "true"}); err != nil {
		return pending, fmt.Errorf("unable to list pending revocations: %w", err)
	}
	var errs []error
	for i := range list.Items {
		cm := &list.Items[i]
		if cm.Data[KeyPendingCluster] != nn.String() {
			r.dropOrphanedPending(ctx, logger, cm)
			continue
		}
		var d clusterv1.Machine
		if err := json.Unmarshal([]byte(cm.Data[KeyPendingMachine]), &d); err != nil || d.UID == "" || cm.Name != pendingName(d.UID) {
			errs = append(errs, fmt.Errorf("pending revocation %s/%s is not readable", cm.Namespace, cm.Name))
			continue
		}
		if d.Namespace != nn.Namespace || d.Labels[clusterv1.ClusterNameLabel] != nn.Name {
			errs = append(errs, fmt.Errorf("pending revocation %s/%s names Machine %s/%s of another Cluster", cm.Namespace, cm.Name, d.Namespace, d.Name))
			continue
		}
		if !slices.ContainsFunc(pending, func(o *clusterv1.Machine) bool { return o.UID == d.UID }) {
			pending = append(pending, &d)
		}
	}
	return pending, errors.Join(errs...)
}

// dropOrphanedPending removes the pending revocation cm when its Cluster is
// gone: there is no workload cluster left to revoke anything in.
func (r *ClusterReconciler) dropOrphanedPending(ctx context.Context, logger klog.Logger, cm *corev1.ConfigMap) {
	ns, name, ok := strings.Cut(cm.Data[KeyPendingCluster], "/")
	if !ok {
		return
	}
	var cluster clusterv1.Cluster
	if err := r.APIReader.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &cluster); !apierrors.IsNotFound(err) {
		return
	}
	if err := r.Client.Delete(ctx, cm); err != nil && !apierrors.IsNotFound(err) {
		logger.Info("Unable to remove the pending revocation of a deleted Cluster", "configMap", klog.KObj(cm), "err", err.Error())
	}
}

// forgetPending removes the pending revocation of the deleted Machine d of
// Cluster nn, once its node names are revoked.
func (r *ClusterReconciler) forgetPending(ctx context.Context, nn types.NamespacedName, d *clusterv1.Machine) error {
	if r.Namespace != "" {
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: r.Namespace, Name: pendingName(d.UID)}}
		if err := r.Client.Delete(ctx, cm); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("unable to remove pending revocation %s/%s: %w", cm.Namespace, cm.Name, err)
		}
	}
	r.mu.Lock()
	r.deleted[nn] = slices.DeleteFunc(r.deleted[nn], func(o *clusterv1.Machine) bool { return o.UID == d.UID })
	r.mu.Unlock()
	return nil
}

// revokedNames returns the node names of the deleted Machine m to revoke
// (namesToRevoke), and which Machines of the Cluster still claim each
// (claimants), read from the API server: a Machine created a moment ago
// whose node was issued a certificate must keep it.
func (r *ClusterReconciler) revokedNames(ctx context.Context, nn types.NamespacedName, m *clusterv1.Machine) ([]string, func(string, types.UID) bool, error) {
	var list clusterv1.MachineList
	if err := r.APIReader.List(ctx, &list, client.InNamespace(nn.Namespace), client.MatchingLabels{clusterv1.ClusterNameLabel: nn.Name}); err != nil {
		return nil, nil, fmt.Errorf("unable to list the Cluster's Machines: %w", err)
	}
	return namesToRevoke(m), claimants(m, list.Items), nil
}

// namesToRevoke returns the node names of the deleted Machine m: its
// nodeRef once it has one, else every name it could have been issued a
// certificate for (claims), whoever else claims them (their certificates
// stay accepted: claimants). Names that cannot be node names are left out.
func namesToRevoke(m *clusterv1.Machine) []string {
	names := claimedNames(m)
	if m.Status.NodeRef.IsDefined() {
		names = []string{m.Status.NodeRef.Name}
	}
	return slices.DeleteFunc(slices.Compact(slices.Sorted(slices.Values(names))), func(n string) bool {
		return len(validation.IsDNS1123Subdomain(n)) > 0
	})
}

// claimants reports whether the Machine of UID uid, another than the
// deleted Machine m, is one of machines and claims node: the certificates
// issued to it for node stay accepted when node is revoked.
func claimants(m *clusterv1.Machine, machines []clusterv1.Machine) func(node string, uid types.UID) bool {
	return func(node string, uid types.UID) bool {
		return uid != m.UID && slices.ContainsFunc(machines, func(o clusterv1.Machine) bool { return o.UID == uid && claims(&o, node) })
	}
}

// keepRevocations keeps the revocations of one workload cluster until ctx
// is done: the policy, its binding and its parameter every period (they
// are restored when deleted, and expired names dropped), and the names of
// Machines deleted as soon as they are reported. It returns at once; the
// work runs on a timer (package periodic).
func (r *ClusterReconciler) keepRevocations(ctx context.Context, logger klog.Logger, cluster *corev1.ObjectReference, rv *revocation, st *state,
	period time.Duration) {
	nn := types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name}
	backoff := time.Second
	rv.mu.Lock()
	defer rv.mu.Unlock()
	rv.loop = periodic.Start(ctx, func(ctx context.Context) (time.Duration, bool) {
		err := r.revokeOnce(ctx, logger, nn, cluster, rv.rv, st)
		if ctx.Err() != nil {
			return 0, false
		}
		wait := period
		if err != nil {
			st.update(func(s *ClusterStatus) { s.RevocationErrors++; s.RevocationError = err.Error() })
			logger.Info("Revocations not written yet, will retry", "err", err.Error(), "in", backoff)
			if r.Events != nil {
				r.Events.Eventf(cluster, corev1.EventTypeWarning, ReasonRevocationFailed, "Unable to keep deleted Machines' node names revoked in the workload cluster: %v",
					err)
			}
			wait, backoff = backoff, min(2*backoff, period)
		} else {
			st.update(func(s *ClusterStatus) { s.RevocationError = "" })
			backoff = time.Second
		}
		return wait, true
	})
}

func (r *ClusterReconciler) revokeOnce(ctx context.Context, logger klog.Logger, nn types.NamespacedName, cluster *corev1.ObjectReference, rv *revoke.Revoker,
	st *state) error {
	s, dropped, err := rv.Ensure(ctx)
	if err != nil {
		return err
	}
	for _, n := range dropped {
		logger.Info("Revoked node name expired: every certificate issued before its revocation has expired", "node", n)
		if r.Events != nil {
			r.Events.Eventf(cluster, corev1.EventTypeNormal, ReasonRevocationExpired,
				"Node %s is no longer listed as revoked: every certificate issued before its Machine was deleted has expired", n)
		}
	}
	var c clusterv1.Cluster
	if err := r.Client.Get(ctx, nn, &c); err == nil && paused(&c) {
		// Deletions wait: their pending records stay, and Machines
		// deleted meanwhile are found once it is unpaused.
		logger.V(2).Info("The Cluster is paused: deleted Machines are not revoked until it is unpaused")
		st.update(func(c *ClusterStatus) { c.RevokedNodes = len(s.Entries) })
		return nil
	}
	pending, err := r.pendingRevocations(ctx, logger, nn)
	var errs []error
	if err != nil {
		errs = append(errs, err)
	}
	unseen, err := r.unseenDeletions(ctx, nn, s, pending)
	if err != nil {
		errs = append(errs, err)
	}
	for _, m := range append(pending, unseen...) {
		found := slices.Contains(unseen, m)
		names, claimed, err := r.revokedNames(ctx, nn, m)
		if found {
			// The names it was issued certificates for, from the record.
			names = nil
		}
		var listed []string
		if err == nil {
			var out *revoke.State
			out, listed, err = rv.Revoke(ctx, revoke.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID}, names, claimed)
			if err == nil {
				s = out
			}
		}
		if err == nil && !found {
			err = r.forgetPending(ctx, nn, m)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("machine %s/%s: %w", m.Namespace, m.Name, err))
			continue
		}
		how := "was deleted"
		if found {
			how = "was found deleted (its deletion was not seen: the Cluster was not served then)"
		}
		for _, n := range listed {
			e := s.Find(n)
			if e == nil {
				continue
			}
			logger.Info("Revoked a deleted Machine's node name", "machine", klog.KObj(m), "node", n, "until", e.Until, "acceptedOfLiveMachines", len(e.Accepted),
				"deletionSeen", !found)
			if r.Events != nil {
				r.Events.Eventf(cluster, corev1.EventTypeNormal, ReasonNodeRevoked,
					"Node %s revoked in the workload cluster: its Machine %s %s; certificates issued to it before now are refused until %s",
					n, m.Name, how, e.Until.Format(time.RFC3339))
			}
		}
	}
	st.update(func(c *ClusterStatus) { c.RevokedNodes = len(s.Entries) })
	return errors.Join(errs...)
}

// paused reports whether cluster is paused, as Cluster API pauses it: its
// spec.paused, or the cluster.x-k8s.io/paused annotation. clusterctl move
// pauses a Cluster, creates its objects in the target management cluster,
// and then deletes them here: the Machines it deletes live on there, so
// their nodes must keep their certificates.
func paused(cluster *clusterv1.Cluster) bool {
	if ptr.Deref(cluster.Spec.Paused, false) {
		return true
	}
	_, ok := cluster.Annotations[clusterv1.PausedAnnotation]
	return ok
}

// maxUnseenChecks bounds the Machines unseenDeletions reads from the API
// server in one round: the record it reads them from lives in the
// workload cluster, whose tenant may write it. The rest are read in the
// rounds after.
const maxUnseenChecks = 8

// unseenDeletions returns the Machines of Cluster nn that the record of
// the certificates issued in its workload cluster (s.Issued) names and
// that are gone, other than those pending already: Machines deleted while
// no replica served the Cluster (it was opted out, or had no leader), whose
// deletion no informer saw. A Machine counts as gone only when neither the
// cache nor the API server holds a Machine of its namespace and name: one
// created again under its name (clusterctl move gives it a new UID) is
// not, so that moving a Cluster revokes nothing. What the record names in
// another namespace is not the Cluster's, and is ignored.
func (r *ClusterReconciler) unseenDeletions(ctx context.Context, nn types.NamespacedName, s *revoke.State,
	pending []*clusterv1.Machine) ([]*clusterv1.Machine, error) {
	if s == nil || r.APIReader == nil {
		return nil, nil
	}
	var out []*clusterv1.Machine
	seen := map[types.UID]bool{}
	for _, m := range pending {
		seen[m.UID] = true
	}
	checks := 0
	for _, c := range s.Issued {
		m := c.Machine
		if seen[m.UID] || m.Namespace != nn.Namespace {
			continue
		}
		seen[m.UID] = true
		key := types.NamespacedName{Namespace: m.Namespace, Name: m.Name}
		var live clusterv1.Machine
		if err := r.Client.Get(ctx, key, &live); !apierrors.IsNotFound(err) {
			continue // there, or not known to be gone
		}
		if checks == maxUnseenChecks {
			break
		}
		checks++
		if err := r.APIReader.Get(ctx, key, &live); !apierrors.IsNotFound(err) {
			if err != nil {
				return out, fmt.Errorf("unable to read Machine %s: %w", key, err)
			}
			continue
		}
		d := &clusterv1.Machine{ObjectMeta: metav1.ObjectMeta{Namespace: m.Namespace, Name: m.Name, UID: m.UID,
			Labels: map[string]string{clusterv1.ClusterNameLabel: nn.Name}}}
		out = append(out, d)
	}
	return out, nil
}

// acceptor accepts, before it is handed out, a certificate issued for a
// revoked node name to a live Machine. It implements controller.IssueHook.
type acceptor struct {
	r       *ClusterReconciler
	rv      *revoke.Revoker
	cluster *corev1.ObjectReference
	st      *state
}

// Issuing implements controller.IssueHook.
func (a *acceptor) Issuing(ctx context.Context, node string, m *engine.Machine, cert *x509.Certificate, att revoke.Attestation) error {
	if m == nil || m.UID == "" {
		return errors.New("no Machine matched")
	}
	e, err := a.rv.Accept(ctx, node, revoke.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID}, cert, att)
	if err != nil && !errors.Is(err, revoke.ErrRevokedMachine) {
		a.st.update(func(s *ClusterStatus) { s.RevocationErrors++; s.RevocationError = err.Error() })
	}
	if revoke.Unenforceable(err) {
		klog.FromContext(ctx).Info("Issuing without checking the revoked node names", "node", node, "err", err.Error())
		return nil
	}
	if err != nil {
		return err
	}
	if e != nil {
		klog.FromContext(ctx).Info("Accepted a certificate for a revoked node name, issued to a new Machine", "node", node, "revokedMachine", e.Machine.String(),
			"revokedUntil", e.Until)
		if a.r.Events != nil {
			a.r.Events.Eventf(a.cluster, corev1.EventTypeNormal, ReasonRevokedNodeAccepted,
				"Node %s: the certificate issued to Machine %s is accepted; certificates issued before Machine %s was deleted stay refused until %s",
				node, m.Name, e.Machine.Name, e.Until.Format(time.RFC3339))
		}
	}
	return nil
}

// Denying implements controller.IssueHook: the denial of node's renewal
// is recorded before it is written, so that the pod signer holds the
// node's pod certificates back after the workload cluster has deleted the
// denied request.
func (a *acceptor) Denying(ctx context.Context, node, request, reason string) error {
	err := a.rv.Deny(ctx, node, request, reason)
	if err != nil {
		a.st.update(func(s *ClusterStatus) { s.RevocationErrors++; s.RevocationError = err.Error() })
	}
	if revoke.Unenforceable(err) {
		klog.FromContext(ctx).Info("Denying without recording the denial", "node", node, "err", err.Error())
		return nil
	}
	return err
}

// newRevocation returns the revocation side of a workload cluster.
func (r *ClusterReconciler) newRevocation(cs revoke.Client) *revocation {
	return &revocation{
		rv: &revoke.Revoker{Client: cs, Lifetime: r.MaxLifetime, Clock: r.Clock},
	}
}

// revocationPeriod is how often the policy objects are checked.
func (r *ClusterReconciler) revocationPeriod() time.Duration {
	return cmp.Or(r.RecheckPeriod, DefaultRecheckPeriod)
}
