package podcert

import (
	"context"
	"fmt"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	admissionregistrationv1client "k8s.io/client-go/kubernetes/typed/admissionregistration/v1"
	"k8s.io/utils/ptr"

	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
)

// The creator's credential on a request. kube-apiserver sets the user
// extra revoke.CredentialIDExtra to CredentialIDPrefix and the hex SHA-256
// of the client certificate a request was authenticated with; the
// MutatingAdmissionPolicy AdmissionPolicy returns copies it into the
// annotation AnnotationCreatorCredential of every PodCertificateRequest
// created, overwriting whatever the creator wrote there (the empty string
// when the creator did not authenticate with a client certificate).
const (
	AnnotationCreatorCredential = "kubelet-authenticator.x-k8s.io/creator-credential-id"
	CredentialIDPrefix          = "X509SHA256="
	// AdmissionPolicyName names the MutatingAdmissionPolicy and its
	// binding.
	AdmissionPolicyName = "kubelet-authenticator-pod-certificate-creator"
)

// ReasonIssued is the reason of the Issued condition.
const ReasonIssued = "AttestedNode"

// creatorExpression is the credential ID of the creator's client
// certificate, or "" when it has none.
const creatorExpression = `has(request.userInfo.extra) && '` + revoke.CredentialIDExtra + `' in request.userInfo.extra && ` +
	`request.userInfo.extra['` + revoke.CredentialIDExtra + `'].exists(c, c.startsWith('` + CredentialIDPrefix + `')) ? ` +
	`request.userInfo.extra['` + revoke.CredentialIDExtra + `'].filter(c, c.startsWith('` + CredentialIDPrefix + `'))[0] : ''`

var managedLabels = map[string]string{"app.kubernetes.io/managed-by": "node-attestation-controller", "app.kubernetes.io/part-of": "kubelet-authenticator"}

// AdmissionPolicy returns the MutatingAdmissionPolicy the controller keeps
// in a workload cluster serving pod certificates: on every create of a
// PodCertificateRequest it sets AnnotationCreatorCredential to the
// creator's client certificate credential ID. A MutatingAdmissionPolicy
// (admissionregistration.k8s.io/v1, on by default since Kubernetes 1.36)
// rather than a ValidatingAdmissionPolicy: kubelet creates the requests
// and writes no annotation a validation could compare. failurePolicy is
// Fail: a request the policy did not stamp must not be created, and its
// blast radius is PodCertificateRequests only. The PodCertificateRequest
// API allows no update of metadata by the node (its spec is immutable and
// nodes may only create), so the stamp stays what admission wrote.
func AdmissionPolicy() *admissionregistrationv1.MutatingAdmissionPolicy {
	return &admissionregistrationv1.MutatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: AdmissionPolicyName, Labels: managedLabels},
		Spec: admissionregistrationv1.MutatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionregistrationv1.Fail),
			MatchConstraints: &admissionregistrationv1.MatchResources{
				NamespaceSelector: &metav1.LabelSelector{},
				ObjectSelector:    &metav1.LabelSelector{},
				MatchPolicy:       ptr.To(admissionregistrationv1.Equivalent),
				ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
					RuleWithOperations: admissionregistrationv1.RuleWithOperations{
						Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
						Rule: admissionregistrationv1.Rule{
							APIGroups:   []string{"certificates.k8s.io"},
							APIVersions: []string{"*"},
							Resources:   []string{"podcertificaterequests"},
							Scope:       ptr.To(admissionregistrationv1.NamespacedScope),
						},
					},
				}},
			},
			Variables: []admissionregistrationv1.Variable{{Name: "creator", Expression: creatorExpression}},
			Mutations: []admissionregistrationv1.Mutation{{
				PatchType: admissionregistrationv1.PatchTypeApplyConfiguration,
				ApplyConfiguration: &admissionregistrationv1.ApplyConfiguration{
					Expression: `Object{metadata: Object.metadata{annotations: {'` + AnnotationCreatorCredential + `': variables.creator}}}`,
				},
			}},
			ReinvocationPolicy: admissionregistrationv1.IfNeededReinvocationPolicy,
		},
	}
}

// AdmissionPolicyBinding returns the policy's binding: cluster-wide, no
// parameter.
func AdmissionPolicyBinding() *admissionregistrationv1.MutatingAdmissionPolicyBinding {
	return &admissionregistrationv1.MutatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: AdmissionPolicyName, Labels: managedLabels},
		Spec:       admissionregistrationv1.MutatingAdmissionPolicyBindingSpec{PolicyName: AdmissionPolicyName},
	}
}

// AdmissionSettle is how long after its binding is created the admission
// policy is taken to be in force: kube-apiserver loads a new policy within
// a second or so. Requests created before are not trusted (Stamped).
const AdmissionSettle = 10 * time.Second

// ReasonCreatedUnstamped denies a request created before the admission
// policy was in force: its creator stamp may be the creator's own.
const ReasonCreatedUnstamped = "CreatedBeforeAdmissionPolicy"

// AdmissionClient is what EnsureAdmissionPolicy uses of a workload
// cluster's API.
type AdmissionClient interface {
	AdmissionregistrationV1() admissionregistrationv1client.AdmissionregistrationV1Interface
}

// EnsureAdmissionPolicy creates, restores or corrects the policy, then its
// binding, in the workload cluster of cs. It returns when requests are
// stamped from: AdmissionSettle after the binding was created.
func EnsureAdmissionPolicy(ctx context.Context, cs AdmissionClient) (time.Time, error) {
	api := cs.AdmissionregistrationV1()
	// since is the latest time the policy or its binding changed.
	var since time.Time
	changed := func(t time.Time) {
		if t.After(since) {
			since = t
		}
	}
	want := AdmissionPolicy()
	got, err := api.MutatingAdmissionPolicies().Get(ctx, want.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		got, err = api.MutatingAdmissionPolicies().Create(ctx, want, metav1.CreateOptions{FieldManager: revoke.FieldManager})
	case err == nil && !equality.Semantic.DeepEqual(got.Spec, want.Spec):
		got = got.DeepCopy()
		got.Spec = want.Spec
		_, err = api.MutatingAdmissionPolicies().Update(ctx, got, metav1.UpdateOptions{FieldManager: revoke.FieldManager})
		changed(time.Now())
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("unable to write MutatingAdmissionPolicy %s: %w", want.Name, err)
	}
	changed(got.CreationTimestamp.Time)
	wantB := AdmissionPolicyBinding()
	gotB, err := api.MutatingAdmissionPolicyBindings().Get(ctx, wantB.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		gotB, err = api.MutatingAdmissionPolicyBindings().Create(ctx, wantB, metav1.CreateOptions{FieldManager: revoke.FieldManager})
	case err == nil && !equality.Semantic.DeepEqual(gotB.Spec, wantB.Spec):
		gotB = gotB.DeepCopy()
		gotB.Spec = wantB.Spec
		_, err = api.MutatingAdmissionPolicyBindings().Update(ctx, gotB, metav1.UpdateOptions{FieldManager: revoke.FieldManager})
		changed(time.Now())
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("unable to write MutatingAdmissionPolicyBinding %s: %w", wantB.Name, err)
	}
	changed(gotB.CreationTimestamp.Time)
	return since.Add(AdmissionSettle), nil
}
