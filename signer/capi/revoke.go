package capi

import (
	"cmp"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/signer/engine"
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
	rv   *revoke.Revoker
	wake chan struct{}
}

// MachineDeleted is called for every Machine the manager's informer sees
// deleted (the trust-on-first-use cleaner's deletion hook, signer/tofu).
// The node names of a Machine of a served Cluster are revoked in its
// workload cluster.
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
	defer r.mu.Unlock()
	w := r.running[nn]
	if w == nil {
		return // not served: nothing was issued through this controller
	}
	r.deleted[nn] = append(r.deleted[nn], m.DeepCopy())
	select {
	case w.revocation.wake <- struct{}{}:
	default:
	}
}

// revokedNames returns the node names of the deleted Machine m to revoke
// (namesToRevoke), given the Cluster's Machines as the cache has them.
func (r *ClusterReconciler) revokedNames(ctx context.Context, nn types.NamespacedName, m *clusterv1.Machine) ([]string, error) {
	var list clusterv1.MachineList
	if err := r.Client.List(ctx, &list, client.InNamespace(nn.Namespace), client.MatchingLabels{clusterv1.ClusterNameLabel: nn.Name}); err != nil {
		return nil, fmt.Errorf("unable to list the Cluster's Machines: %w", err)
	}
	return namesToRevoke(m, list.Items), nil
}

// namesToRevoke returns the node names of the deleted Machine m that no
// other of the Cluster's Machines claims: its nodeRef once it has one, else
// every name it could have been issued a certificate for (claims). Names
// that cannot be node names are left out.
func namesToRevoke(m *clusterv1.Machine, machines []clusterv1.Machine) []string {
	names := claimedNames(m)
	if m.Status.NodeRef.IsDefined() {
		names = []string{m.Status.NodeRef.Name}
	}
	return slices.DeleteFunc(slices.Compact(slices.Sorted(slices.Values(names))), func(n string) bool {
		return len(validation.IsDNS1123Subdomain(n)) > 0 ||
			slices.ContainsFunc(machines, func(o clusterv1.Machine) bool { return o.UID != m.UID && claims(&o, n) })
	})
}

// keepRevocations keeps the revocations of one workload cluster until ctx
// is done: the policy, its binding and its parameter every period (they
// are restored when deleted, and expired names dropped), and the names of
// Machines deleted as soon as they are reported.
func (r *ClusterReconciler) keepRevocations(ctx context.Context, logger klog.Logger, cluster *corev1.ObjectReference, rv *revocation, st *state, period time.Duration) {
	nn := types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name}
	backoff := time.Second
	for {
		err := r.revokeOnce(ctx, logger, nn, cluster, rv.rv, st)
		if ctx.Err() != nil {
			return
		}
		wait := period
		if err != nil {
			st.update(func(s *ClusterStatus) { s.RevocationErrors++; s.RevocationError = err.Error() })
			logger.Info("Revocations not written yet, will retry", "err", err.Error(), "in", backoff)
			if r.Events != nil {
				r.Events.Eventf(cluster, corev1.EventTypeWarning, ReasonRevocationFailed, "Unable to keep deleted Machines' node names revoked in the workload cluster: %v", err)
			}
			wait, backoff = backoff, min(2*backoff, period)
		} else {
			st.update(func(s *ClusterStatus) { s.RevocationError = "" })
			backoff = time.Second
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-rv.wake:
			t.Stop()
		case <-t.C:
		}
	}
}

func (r *ClusterReconciler) revokeOnce(ctx context.Context, logger klog.Logger, nn types.NamespacedName, cluster *corev1.ObjectReference, rv *revoke.Revoker, st *state) error {
	s, dropped, err := rv.Ensure(ctx)
	if err != nil {
		return err
	}
	for _, n := range dropped {
		logger.Info("Revoked node name expired: every certificate issued before its revocation has expired", "node", n)
		if r.Events != nil {
			r.Events.Eventf(cluster, corev1.EventTypeNormal, ReasonRevocationExpired, "Node %s is no longer listed as revoked: every certificate issued before its Machine was deleted has expired", n)
		}
	}
	r.mu.Lock()
	pending := slices.Clone(r.deleted[nn])
	r.mu.Unlock()
	var errs []error
	for _, m := range pending {
		names, err := r.revokedNames(ctx, nn, m)
		if err == nil && len(names) > 0 {
			var out *revoke.State
			out, err = rv.Revoke(ctx, revoke.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID}, names)
			if err == nil {
				s = out
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("Machine %s/%s: %w", m.Namespace, m.Name, err))
			continue
		}
		r.mu.Lock()
		r.deleted[nn] = slices.DeleteFunc(r.deleted[nn], func(d *clusterv1.Machine) bool { return d == m })
		r.mu.Unlock()
		if len(names) == 0 {
			logger.Info("Deleted Machine's node names are claimed by other Machines; nothing revoked", "machine", klog.KObj(m))
			continue
		}
		for _, n := range names {
			e := s.Find(n)
			logger.Info("Revoked a deleted Machine's node name", "machine", klog.KObj(m), "node", n, "until", e.Until)
			if r.Events != nil {
				r.Events.Eventf(cluster, corev1.EventTypeNormal, ReasonNodeRevoked,
					"Node %s revoked in the workload cluster: its Machine %s was deleted; certificates issued to it before now are refused until %s",
					n, m.Name, e.Until.Format(time.RFC3339))
			}
		}
	}
	st.update(func(c *ClusterStatus) { c.RevokedNodes = len(s.Entries) })
	return errors.Join(errs...)
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
func (a *acceptor) Issuing(ctx context.Context, node string, m *engine.Machine, cert *x509.Certificate) error {
	if m == nil || m.UID == "" {
		return errors.New("no Machine matched")
	}
	e, err := a.rv.Accept(ctx, node, revoke.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID}, cert)
	if err != nil && !errors.Is(err, revoke.ErrRevokedMachine) {
		a.st.update(func(s *ClusterStatus) { s.RevocationErrors++; s.RevocationError = err.Error() })
		if apierrors.IsForbidden(err) || apierrors.IsNotFound(err) || errors.Is(err, revoke.ErrMalformed) {
			// Revocation cannot work in this cluster until this is fixed
			// (its RBAC, an API server without ValidatingAdmissionPolicy, or a
			// record someone else edited): signing does not
			// wait for it. Were the name revoked, the node would be refused
			// until it is fixed and the certificate renewed.
			klog.FromContext(ctx).Info("Issuing without checking the revoked node names", "node", node, "err", err.Error())
			return nil
		}
	}
	if err != nil {
		return err
	}
	if e != nil {
		klog.FromContext(ctx).Info("Accepted a certificate for a revoked node name, issued to a new Machine", "node", node, "revokedMachine", e.Machine.String(), "revokedUntil", e.Until)
		if a.r.Events != nil {
			a.r.Events.Eventf(a.cluster, corev1.EventTypeNormal, ReasonRevokedNodeAccepted,
				"Node %s: the certificate issued to Machine %s is accepted; certificates issued before Machine %s was deleted stay refused until %s",
				node, m.Name, e.Machine.Name, e.Until.Format(time.RFC3339))
		}
	}
	return nil
}

// newRevocation returns the revocation side of a workload cluster.
func (r *ClusterReconciler) newRevocation(cs kubernetes.Interface) *revocation {
	return &revocation{
		rv:   &revoke.Revoker{Client: cs, Lifetime: r.MaxLifetime, Clock: r.Clock},
		wake: make(chan struct{}, 1),
	}
}

// revocationPeriod is how often the policy objects are checked.
func (r *ClusterReconciler) revocationPeriod() time.Duration {
	return cmp.Or(r.RecheckPeriod, DefaultRecheckPeriod)
}
