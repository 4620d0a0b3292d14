package capi

import (
	"maps"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation/field"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
)

// The deprecated annotations that held a Cluster's policy before its
// ClusterAttestation had a spec. They are read only while that spec is
// absent (ParseClusterPolicy); each maps to one field of the spec.
const (
	// AnnotationAuthorizedAttestors lists the providers whose evidence the
	// Cluster accepts, comma-separated ("tpm,aws"): spec.authorizedAttestors.
	AnnotationAuthorizedAttestors = "kubelet-authenticator.x-k8s.io/authorized-attestors"
	// AnnotationPolicyPrefix and AnnotationPolicySuffix frame the
	// annotation holding the Cluster's policy document for one provider,
	// kubelet-authenticator.x-k8s.io/<provider>-policy: spec.policies[<provider>].
	AnnotationPolicyPrefix = "kubelet-authenticator.x-k8s.io/"
	AnnotationPolicySuffix = "-policy"
	// AnnotationLockdown, "true": spec.lockdown.
	AnnotationLockdown = "kubelet-authenticator.x-k8s.io/lockdown"
	// AnnotationApproveKubeletServing, "true": spec.approveKubeletServing.
	AnnotationApproveKubeletServing = "kubelet-authenticator.x-k8s.io/approve-kubelet-serving"
)

// policySwitches are the policy's on/off settings: a bool of the spec and
// the deprecated annotation that set it. A new switch is one line here and
// one field of v1alpha1.ClusterAttestationSpec.
var policySwitches = []policySwitch{
	{"lockdown", AnnotationLockdown, func(s *v1alpha1.ClusterAttestationSpec) *bool { return &s.Lockdown }},
	{"approveKubeletServing", AnnotationApproveKubeletServing, func(s *v1alpha1.ClusterAttestationSpec) *bool { return &s.ApproveKubeletServing }},
	{"requireClusterBinding", AnnotationRequireClusterBinding, func(s *v1alpha1.ClusterAttestationSpec) *bool { return &s.RequireClusterBinding }},
}

type policySwitch struct {
	field      string
	annotation string
	value      func(*v1alpha1.ClusterAttestationSpec) *bool
}

// ClusterPolicy is a served Cluster's policy, read once per reconcile by
// ParseClusterPolicy; everything the controller does for the Cluster
// follows this value.
type ClusterPolicy struct {
	v1alpha1.ClusterAttestationSpec
	// Source says where it was read.
	Source v1alpha1.PolicySource
	// IgnoredAnnotations are the deprecated policy annotations the Cluster
	// still carries while its ClusterAttestation's spec is the policy.
	IgnoredAnnotations []string
	// Pods is the pod-certificate policy (spec.podCertificates), nil when
	// pod certificates are off or their policy has problems. The
	// deprecated annotations never turn them on.
	Pods *podcert.Policy
}

// Documents returns the policy documents by provider, as the engine takes
// them.
func (p *ClusterPolicy) Documents() map[string][]byte {
	if len(p.Policies) == 0 {
		return nil
	}
	out := make(map[string][]byte, len(p.Policies))
	for k, v := range p.Policies {
		out[k] = []byte(v)
	}
	return out
}

// Setting names a setting of the policy as its operator writes it: the
// field of the spec, or the deprecated annotation the policy was read from.
func (p *ClusterPolicy) Setting(field, annotation string) string {
	if p.Source == v1alpha1.PolicySourceAnnotations {
		return "annotation " + annotation
	}
	return "spec." + field + " of ClusterAttestation"
}

// PolicyValidator is implemented by verifiers whose providers take a
// policy document (the TPM boot policy): it reports every problem of doc.
type PolicyValidator interface {
	ValidatePolicy(doc []byte) error
}

// ParseClusterPolicy reads an opted-in Cluster's policy: the spec of its
// ClusterAttestation (att, nil when there is none) when it has one,
// otherwise the Cluster's deprecated annotations. It returns the policy
// and every problem, each at the path of the setting to change: an
// authorized attestor or a policy for a provider this signer does not
// serve (verifiers), no authorized attestor, a policy document too large
// or one its verifier refuses, a switch annotation that is neither "true"
// nor "false". The policy is usable with problems: requests of an
// attestor not served are denied, and those under a policy that does not
// parse are retried until it is fixed; the problems make that visible
// (the ClusterAttestation's PolicyValid condition, an Event on the
// Cluster).
func ParseClusterPolicy(cluster *clusterv1.Cluster, att *v1alpha1.ClusterAttestation, verifiers map[string]attestor.Verifier) (ClusterPolicy, field.ErrorList) {
	var p ClusterPolicy
	var errs field.ErrorList
	var attestors func(i int) *field.Path // i < 0: the list
	var policies func(provider string) *field.Path
	var policiesPath *field.Path // the whole of them, when they are one field
	if att != nil && att.Spec != nil {
		p.ClusterAttestationSpec = *att.Spec.DeepCopy()
		p.Source = v1alpha1.PolicySourceSpec
		p.IgnoredAnnotations = policyAnnotations(cluster)
		spec := field.NewPath("spec")
		attestors = func(i int) *field.Path {
			if i < 0 {
				return spec.Child("authorizedAttestors")
			}
			return spec.Child("authorizedAttestors").Index(i)
		}
		policiesPath = spec.Child("policies")
		policies = func(k string) *field.Path { return policiesPath.Key(k) }
		var podErrs field.ErrorList
		p.Pods, podErrs = podcert.NewPolicy(p.PodCertificates, spec.Child("podCertificates"))
		errs = append(errs, podErrs...)
	} else {
		p.Source = v1alpha1.PolicySourceAnnotations
		annotations := field.NewPath("metadata", "annotations")
		errs = append(errs, specFromAnnotations(&p.ClusterAttestationSpec, cluster.Annotations, annotations)...)
		attestors = func(int) *field.Path { return annotations.Key(AnnotationAuthorizedAttestors) }
		policies = func(k string) *field.Path {
			return annotations.Key(AnnotationPolicyPrefix + k + AnnotationPolicySuffix)
		}
	}
	p.AuthorizedAttestors = dedupe(p.AuthorizedAttestors)
	switch n := len(p.AuthorizedAttestors); {
	case n == 0:
		errs = append(errs, field.Required(attestors(-1), "no attestor is authorized: every request is denied"))
	case n > v1alpha1.MaxAuthorizedAttestors:
		// Those past the limit are not authorized (nor each reported).
		errs = append(errs, field.TooMany(attestors(-1), n, v1alpha1.MaxAuthorizedAttestors))
		p.AuthorizedAttestors = p.AuthorizedAttestors[:v1alpha1.MaxAuthorizedAttestors]
	}
	known := slices.Sorted(maps.Keys(verifiers))
	for i, a := range p.AuthorizedAttestors {
		if _, ok := verifiers[a]; !ok {
			errs = append(errs, field.NotSupported(attestors(i), a, known))
		}
	}
	if policiesPath != nil && len(p.Policies) > v1alpha1.MaxPolicies {
		errs = append(errs, field.TooMany(policiesPath, len(p.Policies), v1alpha1.MaxPolicies))
	}
	for _, k := range slices.Sorted(maps.Keys(p.Policies)) {
		path, doc := policies(k), p.Policies[k]
		v, ok := verifiers[k]
		switch {
		case !ok:
			errs = append(errs, field.NotSupported(path, k, known))
		case len(doc) > v1alpha1.MaxPolicySize:
			errs = append(errs, field.TooLong(path, "", v1alpha1.MaxPolicySize))
		default:
			if pv, ok := v.(PolicyValidator); ok {
				if err := pv.ValidatePolicy([]byte(doc)); err != nil {
					errs = append(errs, field.Invalid(path, field.OmitValueType{}, err.Error()))
				}
			}
		}
	}
	return p, errs
}

// specFromAnnotations fills spec from the deprecated policy annotations.
func specFromAnnotations(spec *v1alpha1.ClusterAttestationSpec, annotations map[string]string, path *field.Path) field.ErrorList {
	var errs field.ErrorList
	for a := range strings.SplitSeq(annotations[AnnotationAuthorizedAttestors], ",") {
		if a = strings.TrimSpace(a); a != "" {
			spec.AuthorizedAttestors = append(spec.AuthorizedAttestors, a)
		}
	}
	for k, v := range annotations {
		rest, ok := strings.CutPrefix(k, AnnotationPolicyPrefix)
		if !ok {
			continue
		}
		if provider, ok := strings.CutSuffix(rest, AnnotationPolicySuffix); ok && provider != "" {
			if spec.Policies == nil {
				spec.Policies = map[string]v1alpha1.PolicyDocument{}
			}
			spec.Policies[provider] = v1alpha1.PolicyDocument(v)
		}
	}
	for _, s := range policySwitches {
		switch v, ok := annotations[s.annotation]; {
		case !ok:
		case v == "true":
			*s.value(spec) = true
		case v != "false":
			errs = append(errs, field.NotSupported(path.Key(s.annotation), v, []string{"true", "false"}))
		}
	}
	return errs
}

// policyAnnotations returns the deprecated policy annotations cluster
// carries, sorted.
func policyAnnotations(cluster *clusterv1.Cluster) []string {
	var out []string
	for k := range cluster.Annotations {
		rest, ok := strings.CutPrefix(k, AnnotationPolicyPrefix)
		switch {
		case !ok:
		case k == AnnotationAuthorizedAttestors,
			slices.ContainsFunc(policySwitches, func(s policySwitch) bool { return s.annotation == k }),
			strings.HasSuffix(rest, AnnotationPolicySuffix) && rest != AnnotationPolicySuffix:
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

// dedupe drops repeated entries, keeping the first of each, in time
// linear in the (tenant-written) input.
func dedupe(in []string) []string {
	var out []string
	seen := make(map[string]bool, len(in))
	for _, s := range in {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}
