package capi

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
)

// AnnotationRequireClusterBinding is the deprecated annotation of
// ClusterAttestationSpec.RequireClusterBinding: "true" on an opted-in Cluster accepts
// only evidence that commits to the workload cluster's CA (binding v2: TPM
// evidence v3 and v4, cloud evidence v2) from every provider that has such a
// version; a node that files older evidence is told the versions to use
// (supported-versions) and files anew. Unset or "false": older evidence is
// accepted too, for nodes not yet upgraded.
const AnnotationRequireClusterBinding = "kubelet-authenticator.x-k8s.io/require-cluster-binding"

// ReasonCARefused is the reason of the Warning Event on a Cluster, and of
// its ClusterAttestation's Ready condition, whose `<cluster>-ca` Secret is
// refused (RefusedCAError).
const ReasonCARefused = "CARefused"

// RefusedCAError is a `<cluster>-ca` Secret the controller will not sign
// with: its certificate does not parse or is no CA, or its key is not the
// certificate's. Evidence names the cluster by its CA certificate, so a
// Secret whose key does not prove the certificate could claim another
// cluster's CA as its own.
type RefusedCAError struct {
	Secret string
	Err    error
}

func (e *RefusedCAError) Error() string {
	return fmt.Sprintf("secret %s refused: %v", e.Secret, e.Err)
}

func (e *RefusedCAError) Unwrap() error { return e.Err }

// refuseCA stops cluster's controller, if one runs, and says why: in the
// log and in an Event on the Cluster.
func (r *ClusterReconciler) refuseCA(logger klog.Logger, cluster *clusterv1.Cluster, err *RefusedCAError) {
	nn := types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name}
	r.stop(logger, nn, "CA refused")
	logger.Info("Refusing the workload cluster's CA: its certificate and key must be one CA", "secret", err.Secret, "err", err.Err.Error())
	r.clusterEvent(cluster, corev1.EventTypeWarning, ReasonCARefused, "Secret %s not used: %v", err.Secret, err.Err)
}
