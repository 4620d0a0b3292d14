package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Limits of a ClusterAttestation's spec, enforced by its schema when it is
// written and again by the controller when it reads it.
const (
	// MaxAuthorizedAttestors bounds spec.authorizedAttestors.
	MaxAuthorizedAttestors = 32
	// MaxPolicies bounds how many policy documents spec.policies holds.
	MaxPolicies = 8
	// MaxPolicySize bounds one policy document (a TPM boot policy is a few
	// KiB).
	MaxPolicySize = 64 << 10
)

// ClusterAttestationSpec is a Cluster's attestation policy: which attestors'
// evidence its nodes may join with, what each provider's policy document
// says, and the Cluster-wide switches. The Cluster opts in with its
// annotation kubelet-authenticator.x-k8s.io/enabled: "true"; without it
// this spec is kept but not used.
//
// +kubebuilder:validation:XValidation:rule="!has(self.policies) || self.policies.all(p, p in self.authorizedAttestors)",message="spec.policies has a document for an attestor spec.authorizedAttestors does not list: authorize the attestor or drop its policy"
type ClusterAttestationSpec struct {
	// AuthorizedAttestors are the providers whose evidence the Cluster
	// accepts (tpm, aws, azure, gcp, insecure). A request of any other
	// provider is denied.
	//
	// +required
	// +listType=set
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=32
	// +kubebuilder:validation:items:MinLength=1
	// +kubebuilder:validation:items:MaxLength=63
	// +kubebuilder:validation:items:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	AuthorizedAttestors []string `json:"authorizedAttestors"`

	// Policies are policy documents by provider, each handed to that
	// provider's verifier: tpm takes the boot-state policy
	// (docs/attestors/tpm.md).
	//
	// +optional
	// +kubebuilder:validation:MaxProperties=8
	// +kubebuilder:validation:XValidation:rule="self.all(p, p.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$') && size(p) <= 63)",message="each key of spec.policies is an attestor name, such as tpm"
	Policies map[string]PolicyDocument `json:"policies,omitempty"`

	// Lockdown, when true, disarms the workload cluster's bootstrap
	// auto-approve bindings and keeps them disarmed, so that no node
	// registers without attestation; false restores what lockdown
	// disarmed, once the Cluster is not paused and its policy authorizes
	// an attestor.
	//
	// +optional
	Lockdown bool `json:"lockdown,omitempty"`

	// ApproveKubeletServing, when true, makes the controller approve (or
	// deny) kubelet's own kubernetes.io/kubelet-serving CSRs in the
	// workload cluster; kube-controller-manager signs them.
	//
	// +optional
	ApproveKubeletServing bool `json:"approveKubeletServing,omitempty"`

	// RequireClusterBinding, when true, accepts only evidence that commits
	// to the workload cluster's CA (binding v2: TPM evidence v3 and v4, cloud
	// evidence v2); a node that files older evidence is told the versions
	// to use and files anew. False accepts older evidence too, for nodes
	// not yet upgraded.
	//
	// +optional
	RequireClusterBinding bool `json:"requireClusterBinding,omitempty"`

	// PodCertificates, when set, makes the controller sign the workload
	// cluster's PodCertificateRequests of the pod signer
	// (cluster.x-k8s.io/pod-identity) for pods on attested nodes
	// (docs/pod-certificates.md). Absent, none are signed.
	//
	// +optional
	PodCertificates *PodCertificatePolicy `json:"podCertificates,omitempty"`
}

// Bounds of spec.podCertificates.
const (
	// MaxPodCertificateServiceAccounts bounds spec.podCertificates.allowed.
	MaxPodCertificateServiceAccounts = 256
	// MinPodCertificateLifetimeSeconds and MaxPodCertificateLifetimeSeconds
	// are the bounds kube-apiserver puts on a pod certificate's lifetime.
	MinPodCertificateLifetimeSeconds = 3600
	MaxPodCertificateLifetimeSeconds = 91 * 24 * 3600
)

// PodCertificatePolicy is who gets pod certificates and what they say.
type PodCertificatePolicy struct {
	// TrustDomain is the SPIFFE trust domain of the certificates' URI SAN,
	// spiffe://<trustDomain>/ns/<namespace>/sa/<serviceAccount>.
	//
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=255
	// +kubebuilder:validation:Pattern=`^[a-z0-9._-]+$`
	TrustDomain string `json:"trustDomain"`

	// Allowed are the ServiceAccounts whose pods may have certificates;
	// a request of any other is denied.
	//
	// +required
	// +listType=atomic
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=256
	Allowed []PodCertificateServiceAccounts `json:"allowed"`

	// MaxLifetimeSeconds caps a certificate's lifetime (a pod asks for
	// less with maxExpirationSeconds); default 86400 (a day).
	//
	// +optional
	// +kubebuilder:validation:Minimum=3600
	// +kubebuilder:validation:Maximum=7862400
	MaxLifetimeSeconds *int32 `json:"maxLifetimeSeconds,omitempty"`
}

// PodCertificateServiceAccounts are ServiceAccounts of one namespace.
//
// +kubebuilder:validation:XValidation:rule="!has(self.serviceAccounts) || !('*' in self.serviceAccounts) || size(self.serviceAccounts) == 1",message="'*' allows every ServiceAccount of the namespace and stands alone"
type PodCertificateServiceAccounts struct {
	// Namespace is the namespace.
	//
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	Namespace string `json:"namespace"`

	// ServiceAccounts are ServiceAccount names of the namespace, or "*"
	// for all of them.
	//
	// +required
	// +listType=set
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=256
	// +kubebuilder:validation:items:MinLength=1
	// +kubebuilder:validation:items:MaxLength=253
	// +kubebuilder:validation:items:Pattern=`^(\*|[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)$`
	ServiceAccounts []string `json:"serviceAccounts"`
}

// PolicyDocument is one provider's policy, as its verifier reads it.
//
// +kubebuilder:validation:MinLength=1
// +kubebuilder:validation:MaxLength=65536
type PolicyDocument string

// PolicySource says where the controller read a Cluster's policy.
//
// +kubebuilder:validation:Enum=Spec;Annotations
type PolicySource string

const (
	// PolicySourceSpec means the ClusterAttestation's spec.
	PolicySourceSpec PolicySource = "Spec"
	// PolicySourceAnnotations means the Cluster's annotations (deprecated; used
	// only while the ClusterAttestation has no spec).
	PolicySourceAnnotations PolicySource = "Annotations"
)

// ClusterAttestationStatus is what node-attestation-controller makes of a
// Cluster's policy and how serving the Cluster goes (docs/status.md).
type ClusterAttestationStatus struct {
	// ClusterName is the Cluster served (the object's own name).
	//
	// +optional
	// +kubebuilder:validation:MaxLength=253
	ClusterName string `json:"clusterName,omitempty"`

	// ServedBy is the replica of node-attestation-controller that serves
	// the Cluster, when replicas share the Clusters (--sharding): it holds
	// the Cluster's claim. Empty with a single active replica.
	//
	// +optional
	// +kubebuilder:validation:MaxLength=253
	ServedBy string `json:"servedBy,omitempty"`

	// ObservedGeneration is the Cluster's metadata.generation the status
	// was computed from.
	//
	// +optional
	// +kubebuilder:validation:Minimum=0
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// PolicySource says where the policy in use was read: Spec, or the
	// Cluster's deprecated Annotations.
	//
	// +optional
	PolicySource PolicySource `json:"policySource,omitempty"`

	// Conditions: Ready, OptedIn, PolicyValid, WorkloadReachable,
	// SignersServed, LockdownApplied, ServingCAPublished, ScopedIdentity,
	// Paused.
	//
	// +optional
	// +listType=map
	// +listMapKey=type
	// +kubebuilder:validation:MaxItems=16
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// AuthorizedAttestors are the attestors the Cluster's policy
	// authorizes.
	//
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=32
	// +kubebuilder:validation:items:MaxLength=253
	AuthorizedAttestors []string `json:"authorizedAttestors,omitempty"`

	// SignerNames are the signer names whose CSRs the controller decides
	// in the workload cluster.
	//
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=64
	// +kubebuilder:validation:items:MaxLength=571
	SignerNames []string `json:"signerNames,omitempty"`

	// ServingCAExpiry is when the serving CA that signs kubelet serving
	// certificates expires.
	//
	// +optional
	ServingCAExpiry *metav1.Time `json:"servingCAExpiry,omitempty"`

	// LastDecision is the last CSR the controller approved, denied or
	// failed in the workload cluster.
	//
	// +optional
	LastDecision *LastDecision `json:"lastDecision,omitempty"`

	// RevokedNodes is how many node names of deleted Machines are refused
	// in the workload cluster.
	//
	// +optional
	// +kubebuilder:validation:Minimum=0
	RevokedNodes *int32 `json:"revokedNodes,omitempty"`
}

// LastDecision is a ClusterAttestation's last CSR decision.
type LastDecision struct {
	// Time is when it was decided.
	//
	// +required
	Time metav1.Time `json:"time"`
	// CSR is the request's name in the workload cluster.
	//
	// +required
	// +kubebuilder:validation:MaxLength=253
	CSR string `json:"csr"`
	// Machine is the Machine it matched; empty when none.
	//
	// +optional
	// +kubebuilder:validation:MaxLength=253
	Machine string `json:"machine,omitempty"`
	// Outcome is approved, denied or failed.
	//
	// +required
	// +kubebuilder:validation:Enum=approved;denied;failed
	Outcome string `json:"outcome"`
	// Reason is the CSR condition's reason.
	//
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	Reason string `json:"reason,omitempty"`
	// Message is the CSR condition's message: a denial says what to fix.
	//
	// +optional
	// +kubebuilder:validation:MaxLength=2048
	Message string `json:"message,omitempty"`
}

// ClusterAttestation is one Cluster's attestation policy (spec, written by
// its operator) and what node-attestation-controller reports of serving it
// (status). It has the Cluster's name and namespace and is owned by the
// Cluster.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Namespaced,categories=cluster-api
// +kubebuilder:printcolumn:name="Cluster",type=string,JSONPath=`.status.clusterName`
// +kubebuilder:printcolumn:name="Attestors",type=string,JSONPath=`.status.authorizedAttestors`
// +kubebuilder:printcolumn:name="Signers",type=string,JSONPath=`.status.conditions[?(@.type=="SignersServed")].status`
// +kubebuilder:printcolumn:name="Lockdown",type=string,JSONPath=`.status.conditions[?(@.type=="LockdownApplied")].status`
// +kubebuilder:printcolumn:name="Reachable",type=string,JSONPath=`.status.conditions[?(@.type=="WorkloadReachable")].status`
// +kubebuilder:printcolumn:name="ServingCAExpiry",type=string,JSONPath=`.status.servingCAExpiry`
// +kubebuilder:printcolumn:name="LastDecision",type=string,JSONPath=`.status.lastDecision.outcome`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:printcolumn:name="ServedBy",type=string,priority=1,JSONPath=`.status.servedBy`
// +kubebuilder:printcolumn:name="Policy",type=string,priority=1,JSONPath=`.status.policySource`
// +kubebuilder:printcolumn:name="SignerNames",type=string,priority=1,JSONPath=`.status.signerNames`
// +kubebuilder:printcolumn:name="LastCSR",type=string,priority=1,JSONPath=`.status.lastDecision.csr`
// +kubebuilder:printcolumn:name="LastReason",type=string,priority=1,JSONPath=`.status.lastDecision.reason`
type ClusterAttestation struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// Spec is the Cluster's policy. Without a spec, the controller reads
	// the policy from the Cluster's deprecated annotations.
	//
	// +optional
	Spec *ClusterAttestationSpec `json:"spec,omitempty"`

	// Status is written by the controller.
	//
	// +optional
	Status ClusterAttestationStatus `json:"status,omitempty"`
}

// ClusterAttestationList is a list of ClusterAttestations.
//
// +kubebuilder:object:root=true
type ClusterAttestationList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ClusterAttestation `json:"items"`
}
