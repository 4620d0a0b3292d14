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
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation/field"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// Annotations on a Cluster object (Cluster API has no field for them).
const (
	// AnnotationEnabled opts a Cluster in when it is "true".
	AnnotationEnabled = "kubelet-authenticator.x-k8s.io/enabled"
	// AnnotationAuthorizedAttestors lists the providers whose evidence the
	// Cluster accepts, comma-separated ("tpm,aws").
	AnnotationAuthorizedAttestors = "kubelet-authenticator.x-k8s.io/authorized-attestors"
	// AnnotationPolicyPrefix and AnnotationPolicySuffix frame the
	// annotation holding the Cluster's policy document for one provider:
	// kubelet-authenticator.x-k8s.io/<provider>-policy (the TPM boot-state
	// policy: kubelet-authenticator.x-k8s.io/tpm-policy).
	AnnotationPolicyPrefix = "kubelet-authenticator.x-k8s.io/"
	AnnotationPolicySuffix = "-policy"
)

// Policies returns the Cluster's policy documents, by provider.
func Policies(cluster *clusterv1.Cluster) map[string][]byte {
	out := map[string][]byte{}
	for k, v := range cluster.Annotations {
		rest, ok := strings.CutPrefix(k, AnnotationPolicyPrefix)
		if !ok {
			continue
		}
		if p, ok := strings.CutSuffix(rest, AnnotationPolicySuffix); ok && p != "" {
			out[p] = []byte(v)
		}
	}
	return out
}

// MaxPolicySize bounds a policy annotation (a TPM boot policy is a few
// KiB; every annotation of an object together may hold 256 KiB).
const MaxPolicySize = 64 << 10

// PolicyValidator is implemented by verifiers whose providers take a
// policy document (the TPM boot policy): it reports every problem of doc.
type PolicyValidator interface {
	ValidatePolicy(doc []byte) error
}

// ValidateAnnotations checks an opted-in Cluster's annotations against the
// providers the signer knows (verifiers) and returns every problem: an
// authorized attestor or a policy for a provider this signer does not
// serve, a policy over MaxPolicySize or one its verifier refuses, and a
// switch that is neither "true" nor "false". Nothing here changes what the
// controller does: requests of an unknown attestor are denied, and those
// under a policy that does not parse are retried until it is fixed; the
// errors make that visible (the ClusterAttestation's PolicyValid condition
// and an Event on the Cluster).
func ValidateAnnotations(cluster *clusterv1.Cluster, verifiers map[string]attestor.Verifier) field.ErrorList {
	var errs field.ErrorList
	annotations := field.NewPath("metadata", "annotations")
	known := slices.Sorted(maps.Keys(verifiers))
	for _, p := range AuthorizedAttestors(cluster) {
		if _, ok := verifiers[p]; !ok {
			errs = append(errs, field.NotSupported(annotations.Key(AnnotationAuthorizedAttestors), p, known))
		}
	}
	if len(AuthorizedAttestors(cluster)) == 0 {
		errs = append(errs, field.Required(annotations.Key(AnnotationAuthorizedAttestors), "no attestor is authorized: every request is denied"))
	}
	policies := Policies(cluster)
	for _, p := range slices.Sorted(maps.Keys(policies)) {
		path, doc := annotations.Key(AnnotationPolicyPrefix+p+AnnotationPolicySuffix), policies[p]
		v, ok := verifiers[p]
		switch {
		case !ok:
			errs = append(errs, field.NotSupported(path, p, known))
		case len(doc) > MaxPolicySize:
			errs = append(errs, field.TooLong(path, "", MaxPolicySize))
		default:
			if pv, ok := v.(PolicyValidator); ok {
				if err := pv.ValidatePolicy(doc); err != nil {
					errs = append(errs, field.Invalid(path, field.OmitValueType{}, err.Error()))
				}
			}
		}
	}
	for _, a := range []string{AnnotationLockdown, AnnotationApproveKubeletServing, AnnotationRequireClusterBinding} {
		if v, ok := cluster.Annotations[a]; ok && v != "true" && v != "false" {
			errs = append(errs, field.NotSupported(annotations.Key(a), v, []string{"true", "false"}))
		}
	}
	return errs
}

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

// AuthorizedAttestors returns the providers cluster authorizes, in order,
// without blanks or duplicates.
func AuthorizedAttestors(cluster *clusterv1.Cluster) []string {
	var out []string
	for p := range strings.SplitSeq(cluster.Annotations[AnnotationAuthorizedAttestors], ",") {
		p = strings.TrimSpace(p)
		if p != "" && !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out
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
