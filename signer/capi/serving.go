package capi

import (
	"context"
	"fmt"
	"maps"
	"net"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/controller"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/serving"
	"sigs.k8s.io/kubelet-authenticator/signer/trust"
)

// AnnotationApproveKubeletServing, "true" on an opted-in Cluster, makes the
// controller approve (or deny) kubelet's own kubernetes.io/kubelet-serving
// CSRs in its workload cluster; kube-controller-manager signs them.
const AnnotationApproveKubeletServing = "kubelet-authenticator.x-k8s.io/approve-kubelet-serving"

// ServingCASecretSuffix names `<cluster>-kubelet-serving-ca`, the serving
// CAs the controller keeps for a workload cluster, in the Cluster's
// namespace and owned by the Cluster: tls.crt and tls.key sign, and
// trust.SecretPreviousKey holds the older CAs still published (package
// trust).
const ServingCASecretSuffix = "-kubelet-serving-ca"

// ApproveKubeletServing reports whether cluster asks for kubelet-serving
// approval.
func ApproveKubeletServing(cluster *clusterv1.Cluster) bool {
	return cluster.Annotations[AnnotationApproveKubeletServing] == "true"
}

// ensureServingCA returns the cluster's serving CAs, making, rotating and
// dropping them as the reconciler's policy says (package trust). Changes
// are atomic: when two callers race, both end up with what was written
// first.
func (r *ClusterReconciler) ensureServingCA(ctx context.Context, cluster *clusterv1.Cluster) (*trust.Authority, error) {
	store := &trust.Store{Client: r.Client, Reader: r.APIReader, Clock: r.Clock, Policy: r.ServingCA, Metrics: r.TrustMetrics}
	return store.Ensure(ctx, trust.SecretRef{
		NamespacedName: types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name + ServingCASecretSuffix},
		Cluster:        cluster.Namespace + "/" + cluster.Name,
		Labels:         map[string]string{clusterv1.ClusterNameLabel: cluster.Name},
		OwnerReferences: []metav1.OwnerReference{{
			APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: cluster.Name, UID: cluster.UID,
		}},
	})
}

// ServingMachines adapts a Matcher to serving.Machines.
type ServingMachines struct{ *Matcher }

// Match implements serving.Machines.
func (s ServingMachines) Match(ctx context.Context, nodeName, providerID string) (*serving.Machine, error) {
	var list clusterv1.MachineList
	if err := s.Cache.List(ctx, &list, client.InNamespace(s.Namespace),
		client.MatchingFields{IndexProviderID: providerID},
		client.MatchingLabels{clusterv1.ClusterNameLabel: s.Cluster}); err != nil {
		return nil, fmt.Errorf("unable to list Machines: %w", err)
	}
	m, err := Match(s.ofCluster(list.Items), nodeName, providerID)
	if err != nil && len(checks.Failures(err)) > 0 {
		var live clusterv1.MachineList
		if lerr := s.Live.List(ctx, &live, client.InNamespace(s.Namespace),
			client.MatchingLabels{clusterv1.ClusterNameLabel: s.Cluster}); lerr != nil {
			return nil, fmt.Errorf("unable to list Machines: %w", lerr)
		}
		m, err = Match(s.ofCluster(live.Items), nodeName, providerID)
	}
	if err != nil {
		return nil, err
	}
	return servingMachine(m), nil
}

// ForNode implements serving.Machines: the one Machine that is node
// nodeName, asking the API server before reporting none.
func (s ServingMachines) ForNode(ctx context.Context, nodeName string) (*serving.Machine, error) {
	find := func(r client.Reader) (*serving.Machine, error) {
		var list clusterv1.MachineList
		if err := r.List(ctx, &list, client.InNamespace(s.Namespace), client.MatchingLabels{clusterv1.ClusterNameLabel: s.Cluster}); err != nil {
			return nil, fmt.Errorf("unable to list Machines: %w", err)
		}
		var found []*clusterv1.Machine
		items := s.ofCluster(list.Items)
		for i := range items {
			if claims(&items[i], nodeName) {
				found = append(found, &items[i])
			}
		}
		switch {
		case len(found) == 0:
			return nil, deny(ReasonMachineNotFound, "no Machine of the Cluster is node %q", nodeName)
		case len(found) > 1:
			return nil, deny(ReasonDuplicateProviderID, "%d Machines claim node name %q; remove the stale ones", len(found), nodeName)
		case !found[0].DeletionTimestamp.IsZero():
			return nil, deny(ReasonMachineDeleting, "Machine %s of node %q is being deleted", found[0].Name, nodeName)
		}
		return servingMachine(found[0]), nil
	}
	m, err := find(s.Cache)
	if err != nil && len(checks.Failures(err)) > 0 {
		m, err = find(s.Live)
	}
	return m, err
}

func servingMachine(m *clusterv1.Machine) *serving.Machine {
	out := &serving.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID, ProviderID: m.Spec.ProviderID, Annotations: maps.Clone(m.Annotations)}
	for _, a := range m.Status.Addresses {
		switch a.Type {
		case clusterv1.MachineHostName, clusterv1.MachineInternalDNS, clusterv1.MachineExternalDNS:
			out.DNSNames = append(out.DNSNames, a.Address)
		case clusterv1.MachineInternalIP, clusterv1.MachineExternalIP:
			if ip := net.ParseIP(a.Address); ip != nil {
				out.IPs = append(out.IPs, ip)
			}
		}
	}
	return out
}

// servingHandlers returns the controller's handlers for serving signer
// names: one attested serving signer per provider the signer knows, and,
// when the Cluster asks for it, the kubelet-serving approver.
func (r *ClusterReconciler) servingHandlers(cluster string, cs kubernetes.Interface, m *Matcher, authorized []string, ca *issue.CA, approveKubelet bool) map[string]controller.Handler {
	out := map[string]controller.Handler{}
	for p, v := range r.Verifiers {
		out[attestor.ServingSignerName(p)] = &serving.AttestedSigner{
			Client: cs, Cluster: cluster, Provider: p, Verifier: v, Authorized: authorized,
			Machines: ServingMachines{m}, CA: ca, MaxLifetime: r.MaxLifetime, Metrics: r.Metrics, Now: r.now,
			Identities: r.Identities,
		}
	}
	if approveKubelet {
		out[certificatesv1.KubeletServingSignerName] = &serving.KubeletServingApprover{
			Client: cs, Cluster: cluster, Machines: ServingMachines{m}, Metrics: r.Metrics,
		}
	}
	return out
}
