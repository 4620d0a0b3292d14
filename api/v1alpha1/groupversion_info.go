// Package v1alpha1 is the kubelet-authenticator.x-k8s.io/v1alpha1 API of
// node-attestation-controller: ClusterAttestation, one per Cluster, whose
// spec is the Cluster's attestation policy (written by its operator) and
// whose status is what the controller makes of it (written by the
// controller). Deepcopy and the CRD (deploy/crd) are generated from these
// types: `make generate`.
//
// +kubebuilder:object:generate=true
// +groupName=kubelet-authenticator.x-k8s.io
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

var (
	// GroupVersion is the group and version of this API.
	GroupVersion = schema.GroupVersion{Group: "kubelet-authenticator.x-k8s.io", Version: "v1alpha1"}

	// ClusterAttestationGVK is ClusterAttestation's group, version and kind.
	ClusterAttestationGVK = GroupVersion.WithKind("ClusterAttestation")

	schemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)

	// AddToScheme adds the types of this API to a scheme.
	AddToScheme = schemeBuilder.AddToScheme
)

func addKnownTypes(scheme *runtime.Scheme) error {
	scheme.AddKnownTypes(GroupVersion, &ClusterAttestation{}, &ClusterAttestationList{})
	metav1.AddToGroupVersion(scheme, GroupVersion)
	return nil
}
