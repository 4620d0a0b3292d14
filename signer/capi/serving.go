package capi

import (
	"context"
	"fmt"
	"maps"
	"net"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
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
)

// AnnotationApproveKubeletServing, "true" on an opted-in Cluster, makes the
// controller approve (or deny) kubelet's own kubernetes.io/kubelet-serving
// CSRs in its workload cluster; kube-controller-manager signs them.
const AnnotationApproveKubeletServing = "kubelet-authenticator.x-k8s.io/approve-kubelet-serving"

// ServingCASecretSuffix names `<cluster>-kubelet-serving-ca`, the serving CA
// the controller keeps for a workload cluster (tls.crt, tls.key), in the
// Cluster's namespace and owned by the Cluster.
const ServingCASecretSuffix = "-kubelet-serving-ca"

// servingCAValidity is the validity of a serving CA the controller makes.
const servingCAValidity = serving.DefaultCAValidity

// ApproveKubeletServing reports whether cluster asks for kubelet-serving
// approval.
func ApproveKubeletServing(cluster *clusterv1.Cluster) bool {
	return cluster.Annotations[AnnotationApproveKubeletServing] == "true"
}

// EnsureServingCA returns the cluster's serving CA, creating its Secret
// (ECDSA P-256, self-signed) when there is none. Creation is atomic: when
// two callers race, both end up with the one that was created first.
func EnsureServingCA(ctx context.Context, c client.Client, r client.Reader, cluster *clusterv1.Cluster) (*issue.CA, []byte, error) {
	nn := types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name + ServingCASecretSuffix}
	var s corev1.Secret
	err := r.Get(ctx, nn, &s)
	if apierrors.IsNotFound(err) {
		certPEM, keyPEM, gerr := serving.NewCA(fmt.Sprintf("kubelet-serving-ca %s/%s", cluster.Namespace, cluster.Name), time.Now(), servingCAValidity)
		if gerr != nil {
			return nil, nil, gerr
		}
		s = corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{
				Name: nn.Name, Namespace: nn.Namespace,
				Labels: map[string]string{clusterv1.ClusterNameLabel: cluster.Name},
				OwnerReferences: []metav1.OwnerReference{{
					APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: cluster.Name, UID: cluster.UID,
				}},
			},
			Type: corev1.SecretTypeTLS,
			Data: map[string][]byte{corev1.TLSCertKey: certPEM, corev1.TLSPrivateKeyKey: keyPEM},
		}
		err = c.Create(ctx, &s)
		if apierrors.IsAlreadyExists(err) {
			err = r.Get(ctx, nn, &s)
		}
	}
	if err != nil {
		return nil, nil, fmt.Errorf("unable to read or create the serving CA secret %s: %w", nn, err)
	}
	certPEM, keyPEM := s.Data[corev1.TLSCertKey], s.Data[corev1.TLSPrivateKeyKey]
	ca, err := issue.LoadCA(certPEM, keyPEM)
	if err != nil {
		return nil, nil, fmt.Errorf("secret %s: %w", nn, err)
	}
	return ca, append(append([]byte(nil), certPEM...), keyPEM...), nil
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
	out := &serving.Machine{Namespace: m.Namespace, Name: m.Name, ProviderID: m.Spec.ProviderID, Annotations: maps.Clone(m.Annotations)}
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
			Machines: ServingMachines{m}, CA: ca, MaxLifetime: r.MaxLifetime, Metrics: r.Metrics,
		}
	}
	if approveKubelet {
		out[certificatesv1.KubeletServingSignerName] = &serving.KubeletServingApprover{
			Client: cs, Cluster: cluster, Machines: ServingMachines{m}, Metrics: r.Metrics,
		}
	}
	return out
}
