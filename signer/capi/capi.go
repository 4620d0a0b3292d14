// Package capi connects the signer to Cluster API on the management
// cluster: which Clusters opted in and which attestors they authorize, how
// to reach each workload cluster and sign with its CA (the `<cluster>-kubeconfig`
// and `<cluster>-ca` Secrets), which Machine a node belongs to, and the
// Cluster reconciler that runs one CSR controller per opted-in workload
// cluster.
package capi

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// AnnotationEnabled opts a Cluster in when it is "true" on the Cluster: the controller
// decides its CSRs under its policy (ParseClusterPolicy). Cluster API has
// no field for it; it is the one switch that stays an annotation.
const AnnotationEnabled = "kubelet-authenticator.x-k8s.io/enabled"

// Secrets Cluster API writes for every Cluster.
const (
	// KubeconfigSecretSuffix names `<cluster>-kubeconfig`, an admin
	// kubeconfig of the workload cluster under KubeconfigSecretKey.
	KubeconfigSecretSuffix = "-kubeconfig"
	KubeconfigSecretKey    = "value"
	// CASecretSuffix names `<cluster>-ca`, the workload cluster's CA
	// (tls.crt, tls.key): kube-apiserver trusts it for client certificates.
	CASecretSuffix = "-ca"
)

// Enabled reports whether cluster opted in.
func Enabled(cluster *clusterv1.Cluster) bool {
	return cluster.Annotations[AnnotationEnabled] == "true"
}

// ReadKubeconfig reads the workload cluster's kubeconfig from its
// `<cluster>-kubeconfig` Secret.
func ReadKubeconfig(ctx context.Context, r client.Reader, cluster types.NamespacedName) ([]byte, error) {
	s, err := readSecret(ctx, r, cluster.Namespace, cluster.Name+KubeconfigSecretSuffix)
	if err != nil {
		return nil, err
	}
	v := s.Data[KubeconfigSecretKey]
	if len(v) == 0 {
		return nil, fmt.Errorf("secret %s/%s has no %q key", s.Namespace, s.Name, KubeconfigSecretKey)
	}
	return v, nil
}

// ClusterCA is a workload cluster's CA as read from its `<cluster>-ca`
// Secret.
type ClusterCA struct {
	// CA signs the cluster's kubelet client certificates.
	CA *issue.CA
	// Bundle are the CAs evidence of binding v2 may name: only the
	// signing certificate, the one whose key the controller holds. Other
	// certificates in tls.crt are not: the Secret is tenant input, and a
	// tenant who appended another cluster's CA certificate would make
	// evidence copied from that cluster verify in its own.
	Bundle [][]byte
	// PEM is what the CA was loaded from (certificate and key).
	PEM []byte
}

// ReadCA reads the workload cluster's CA from its `<cluster>-ca` Secret. A
// Secret whose certificate and key are not one CA is a *RefusedCAError.
func ReadCA(ctx context.Context, r client.Reader, cluster types.NamespacedName) (*ClusterCA, error) {
	s, err := readSecret(ctx, r, cluster.Namespace, cluster.Name+CASecretSuffix)
	if err != nil {
		return nil, err
	}
	certPEM, keyPEM := s.Data[issue.SecretCertKey], s.Data[issue.SecretKeyKey]
	ca, err := issue.LoadCA(certPEM, keyPEM)
	if err != nil {
		return nil, &RefusedCAError{Secret: s.Name, Err: err}
	}
	return &ClusterCA{CA: ca, Bundle: [][]byte{ca.Cert.Raw}, PEM: append(append([]byte(nil), certPEM...), keyPEM...)}, nil
}

func readSecret(ctx context.Context, r client.Reader, ns, name string) (*corev1.Secret, error) {
	var s corev1.Secret
	if err := r.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &s); err != nil {
		return nil, fmt.Errorf("unable to read secret %s/%s: %w", ns, name, err)
	}
	return &s, nil
}
