package capi

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
)

// policyVerifier accepts a policy document only when it is "good".
type policyVerifier struct{ insecure.Verifier }

func (policyVerifier) ValidatePolicy(doc []byte) error {
	if string(doc) != "good" {
		return errors.New("kind is missing")
	}
	return nil
}

const tpmPolicyAnnotation = "kubelet-authenticator.x-k8s.io/tpm-policy"

// TestParseClusterPolicy: every setting read from the spec and from the
// deprecated annotations, and every problem reported at the path of the
// setting to change.
func TestParseClusterPolicy(t *testing.T) {
	verifiers := map[string]attestor.Verifier{"insecure": insecure.Verifier{}, "tpm": policyVerifier{}}
	spec := func(mutate func(*v1alpha1.ClusterAttestationSpec)) *v1alpha1.ClusterAttestation {
		s := &v1alpha1.ClusterAttestationSpec{AuthorizedAttestors: []string{"tpm"}}
		mutate(s)
		return &v1alpha1.ClusterAttestation{Spec: s}
	}
	many := func(n int, f func(i int) string) []string {
		var out []string
		for i := range n {
			out = append(out, f(i))
		}
		return out
	}
	for _, tc := range []struct {
		name        string
		annotations map[string]string
		att         *v1alpha1.ClusterAttestation
		want        *v1alpha1.ClusterAttestationSpec // nil: not checked
		source      v1alpha1.PolicySource
		ignored     []string
		errs        []string // "type field" of each error, in order
	}{
		// The deprecated annotations.
		{name: "annotations: every setting", annotations: map[string]string{AnnotationAuthorizedAttestors: " tpm, insecure,,tpm ", tpmPolicyAnnotation: "good",
			AnnotationLockdown: "true", AnnotationApproveKubeletServing: "true"},
			want: &v1alpha1.ClusterAttestationSpec{AuthorizedAttestors: []string{"tpm", "insecure"}, Policies: map[string]v1alpha1.PolicyDocument{"tpm": "good"},
				Lockdown: true, ApproveKubeletServing: true}, source: v1alpha1.PolicySourceAnnotations},
		{name: "annotations: switches off", annotations: map[string]string{AnnotationAuthorizedAttestors: "tpm", AnnotationLockdown: "false"},
			want: &v1alpha1.ClusterAttestationSpec{AuthorizedAttestors: []string{"tpm"}}, source: v1alpha1.PolicySourceAnnotations},
		{name: "annotations: unknown attestor", annotations: map[string]string{AnnotationAuthorizedAttestors: "tpm,tmp"}, source: v1alpha1.PolicySourceAnnotations,
			errs: []string{"FieldValueNotSupported metadata.annotations[kubelet-authenticator.x-k8s.io/authorized-attestors]"}},
		{name: "annotations: no attestor", annotations: map[string]string{AnnotationAuthorizedAttestors: " , "}, source: v1alpha1.PolicySourceAnnotations,
			errs: []string{"FieldValueRequired metadata.annotations[kubelet-authenticator.x-k8s.io/authorized-attestors]"}},
		{name: "annotations: none at all", source: v1alpha1.PolicySourceAnnotations, want: &v1alpha1.ClusterAttestationSpec{},
			errs: []string{"FieldValueRequired metadata.annotations[kubelet-authenticator.x-k8s.io/authorized-attestors]"}},
		{name: "annotations: malformed policy", annotations: map[string]string{AnnotationAuthorizedAttestors: "tpm", tpmPolicyAnnotation: "bad"},
			source: v1alpha1.PolicySourceAnnotations,
			errs:   []string{"FieldValueInvalid metadata.annotations[kubelet-authenticator.x-k8s.io/tpm-policy]"}},
		{name: "annotations: oversize policy", annotations: map[string]string{AnnotationAuthorizedAttestors: "tpm", tpmPolicyAnnotation: strings.Repeat("x", v1alpha1.MaxPolicySize+1)},
			source: v1alpha1.PolicySourceAnnotations,
			errs:   []string{"FieldValueTooLong metadata.annotations[kubelet-authenticator.x-k8s.io/tpm-policy]"}},
		{name: "annotations: policy of an unknown provider", annotations: map[string]string{AnnotationAuthorizedAttestors: "tpm", "kubelet-authenticator.x-k8s.io/aws-policy": "{}"},
			source: v1alpha1.PolicySourceAnnotations,
			errs:   []string{"FieldValueNotSupported metadata.annotations[kubelet-authenticator.x-k8s.io/aws-policy]"}},
		{name: "annotations: switches", annotations: map[string]string{AnnotationAuthorizedAttestors: "tpm", AnnotationLockdown: "True", AnnotationApproveKubeletServing: "yes"},
			want: &v1alpha1.ClusterAttestationSpec{AuthorizedAttestors: []string{"tpm"}}, source: v1alpha1.PolicySourceAnnotations,
			errs: []string{"FieldValueNotSupported metadata.annotations[kubelet-authenticator.x-k8s.io/lockdown]",
				"FieldValueNotSupported metadata.annotations[kubelet-authenticator.x-k8s.io/approve-kubelet-serving]"}},
		{name: "annotations: a ClusterAttestation without spec", att: &v1alpha1.ClusterAttestation{}, annotations: map[string]string{AnnotationAuthorizedAttestors: "tpm"},
			want: &v1alpha1.ClusterAttestationSpec{AuthorizedAttestors: []string{"tpm"}}, source: v1alpha1.PolicySourceAnnotations},

		// The spec.
		{name: "spec: every setting", att: spec(func(s *v1alpha1.ClusterAttestationSpec) {
			s.AuthorizedAttestors = []string{"tpm", "insecure"}
			s.Policies = map[string]v1alpha1.PolicyDocument{"tpm": "good"}
			s.Lockdown, s.ApproveKubeletServing = true, true
		}), want: &v1alpha1.ClusterAttestationSpec{AuthorizedAttestors: []string{"tpm", "insecure"}, Policies: map[string]v1alpha1.PolicyDocument{"tpm": "good"},
			Lockdown: true, ApproveKubeletServing: true}, source: v1alpha1.PolicySourceSpec},
		{name: "spec: wins over the annotations, which are ignored", att: spec(func(*v1alpha1.ClusterAttestationSpec) {}),
			annotations: map[string]string{AnnotationEnabled: "true", AnnotationAuthorizedAttestors: "insecure", AnnotationLockdown: "True", tpmPolicyAnnotation: "bad", "kubelet-authenticator.x-k8s.io/other": "x"},
			want:        &v1alpha1.ClusterAttestationSpec{AuthorizedAttestors: []string{"tpm"}}, source: v1alpha1.PolicySourceSpec,
			ignored: []string{AnnotationAuthorizedAttestors, AnnotationLockdown, tpmPolicyAnnotation}},
		{name: "spec: unknown attestor", att: spec(func(s *v1alpha1.ClusterAttestationSpec) { s.AuthorizedAttestors = []string{"tpm", "tmp"} }),
			source: v1alpha1.PolicySourceSpec, errs: []string{"FieldValueNotSupported spec.authorizedAttestors[1]"}},
		{name: "spec: no attestor", att: spec(func(s *v1alpha1.ClusterAttestationSpec) { s.AuthorizedAttestors = nil }),
			source: v1alpha1.PolicySourceSpec, errs: []string{"FieldValueRequired spec.authorizedAttestors"}},
		{name: "spec: repeated attestor", att: spec(func(s *v1alpha1.ClusterAttestationSpec) { s.AuthorizedAttestors = []string{"tpm", "tpm"} }),
			want: &v1alpha1.ClusterAttestationSpec{AuthorizedAttestors: []string{"tpm"}}, source: v1alpha1.PolicySourceSpec},
		{name: "spec: too many attestors", att: spec(func(s *v1alpha1.ClusterAttestationSpec) {
			s.AuthorizedAttestors = append([]string{"tpm"}, many(v1alpha1.MaxAuthorizedAttestors, func(int) string { return "insecure" })...)
			s.AuthorizedAttestors = append(s.AuthorizedAttestors, many(v1alpha1.MaxAuthorizedAttestors, func(i int) string { return fmt.Sprint("x", i) })...)
		}), source: v1alpha1.PolicySourceSpec, errs: append([]string{"FieldValueTooMany spec.authorizedAttestors"},
			many(v1alpha1.MaxAuthorizedAttestors-2, func(i int) string { return fmt.Sprintf("FieldValueNotSupported spec.authorizedAttestors[%d]", i+2) })...)},
		{name: "annotations: a flood of attestors", annotations: map[string]string{AnnotationAuthorizedAttestors: "insecure," + strings.Join(many(40000, func(i int) string { return fmt.Sprint("x", i) }), ",")},
			source: v1alpha1.PolicySourceAnnotations, errs: append([]string{"FieldValueTooMany metadata.annotations[kubelet-authenticator.x-k8s.io/authorized-attestors]"},
				many(v1alpha1.MaxAuthorizedAttestors-1, func(int) string {
					return "FieldValueNotSupported metadata.annotations[kubelet-authenticator.x-k8s.io/authorized-attestors]"
				})...)},
		{name: "spec: malformed policy", att: spec(func(s *v1alpha1.ClusterAttestationSpec) {
			s.Policies = map[string]v1alpha1.PolicyDocument{"tpm": "bad"}
		}),
			source: v1alpha1.PolicySourceSpec, errs: []string{"FieldValueInvalid spec.policies[tpm]"}},
		{name: "spec: oversize policy", att: spec(func(s *v1alpha1.ClusterAttestationSpec) {
			s.Policies = map[string]v1alpha1.PolicyDocument{"tpm": v1alpha1.PolicyDocument(strings.Repeat("x", v1alpha1.MaxPolicySize+1))}
		}), source: v1alpha1.PolicySourceSpec, errs: []string{"FieldValueTooLong spec.policies[tpm]"}},
		{name: "spec: policy of an unknown provider", att: spec(func(s *v1alpha1.ClusterAttestationSpec) { s.Policies = map[string]v1alpha1.PolicyDocument{"aws": "{}"} }),
			source: v1alpha1.PolicySourceSpec, errs: []string{"FieldValueNotSupported spec.policies[aws]"}},
		{name: "spec: too many policies", att: spec(func(s *v1alpha1.ClusterAttestationSpec) {
			s.Policies = map[string]v1alpha1.PolicyDocument{"tpm": "good"}
			for i := range v1alpha1.MaxPolicies {
				s.Policies[fmt.Sprint("p", i)] = "{}"
			}
		}), source: v1alpha1.PolicySourceSpec, errs: append([]string{"FieldValueTooMany spec.policies"},
			many(v1alpha1.MaxPolicies, func(i int) string { return fmt.Sprintf("FieldValueNotSupported spec.policies[p%d]", i) })...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Annotations: tc.annotations}}
			var before *v1alpha1.ClusterAttestation
			if tc.att != nil {
				before = tc.att.DeepCopy()
			}
			p, errs := ParseClusterPolicy(c, tc.att, verifiers)
			var got []string
			for _, e := range errs {
				got = append(got, string(e.Type)+" "+e.Field)
			}
			if strings.Join(got, "\n") != strings.Join(tc.errs, "\n") {
				t.Errorf("errors:\n%v\nwant:\n%v", strings.Join(got, "\n"), strings.Join(tc.errs, "\n"))
			}
			for _, e := range errs {
				msg := e.Error()
				if !strings.HasPrefix(msg, e.Field+": ") {
					t.Errorf("the error does not start with the setting to change: %s", msg)
				}
				if e.Type == field.ErrorTypeInvalid && (strings.Contains(msg, "bad") || !strings.Contains(msg, "kind is missing")) {
					t.Errorf("the error repeats the policy document or not the verifier's reason: %v", msg)
				}
				if e.Type == field.ErrorTypeNotSupported && !strings.Contains(msg, "supported values") {
					t.Errorf("the error does not say what is supported: %v", msg)
				}
			}
			if p.Source != tc.source {
				t.Errorf("source %q, want %q", p.Source, tc.source)
			}
			if strings.Join(p.IgnoredAnnotations, ",") != strings.Join(tc.ignored, ",") {
				t.Errorf("ignored annotations %q, want %q", p.IgnoredAnnotations, tc.ignored)
			}
			if tc.want != nil && !equality.Semantic.DeepEqual(p.ClusterAttestationSpec, *tc.want) {
				t.Errorf("policy %+v, want %+v", p.ClusterAttestationSpec, *tc.want)
			}
			if before != nil && !equality.Semantic.DeepEqual(before, tc.att) {
				t.Error("ParseClusterPolicy changed the ClusterAttestation it read")
			}
		})
	}
}

// TestPolicySwitches: every switch of the spec is read from its deprecated
// annotation, "true" and "false" only, and named by its field.
func TestPolicySwitches(t *testing.T) {
	bools := 0
	for i := range reflect.TypeFor[v1alpha1.ClusterAttestationSpec]().NumField() {
		if reflect.TypeFor[v1alpha1.ClusterAttestationSpec]().Field(i).Type.Kind() == reflect.Bool {
			bools++
		}
	}
	if bools != len(policySwitches) {
		t.Errorf("the spec has %d switches, policySwitches %d: each has its deprecated annotation", bools, len(policySwitches))
	}
	for _, s := range policySwitches {
		t.Run(s.field, func(t *testing.T) {
			if f, ok := reflect.TypeFor[v1alpha1.ClusterAttestationSpec]().FieldByNameFunc(func(n string) bool { return strings.EqualFold(n, s.field) }); !ok ||
				!strings.HasPrefix(f.Tag.Get("json"), s.field+",") {
				t.Errorf("no spec field %s", s.field)
			}
			for v, want := range map[string]bool{"true": true, "false": false} {
				p, errs := ParseClusterPolicy(&clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
					AnnotationAuthorizedAttestors: "insecure", s.annotation: v}}}, nil, map[string]attestor.Verifier{"insecure": insecure.Verifier{}})
				if got := *s.value(&p.ClusterAttestationSpec); got != want || len(errs) != 0 {
					t.Errorf("%s=%q: %t (%v), want %t", s.annotation, v, got, errs, want)
				}
			}
			p, errs := ParseClusterPolicy(&clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
				AnnotationAuthorizedAttestors: "insecure", s.annotation: "True"}}}, nil, map[string]attestor.Verifier{"insecure": insecure.Verifier{}})
			if *s.value(&p.ClusterAttestationSpec) || len(errs) != 1 || !strings.Contains(errs[0].Error(), s.annotation) {
				t.Errorf(`%s="True" read as %t with errors %v; want off and one error naming the annotation`, s.annotation, *s.value(&p.ClusterAttestationSpec), errs)
			}
		})
	}
}

// TestWorkloadInputsHash: every field of the policy restarts the
// workload's controller when it changes, and nothing else does.
func TestWorkloadInputsHash(t *testing.T) {
	base := workloadInputs{Kubeconfig: []byte("k"), CA: []byte("ca"), ServingCAs: "s",
		Policy: v1alpha1.ClusterAttestationSpec{AuthorizedAttestors: []string{"tpm"}, Policies: map[string]v1alpha1.PolicyDocument{"tpm": "a", "aws": "b"}}}
	h0, err := base.hash()
	if err != nil {
		t.Fatal(err)
	}
	for range 20 { // map order
		if h, _ := base.hash(); h != h0 {
			t.Fatal("the hash depends on map order")
		}
	}
	typ := reflect.TypeFor[v1alpha1.ClusterAttestationSpec]()
	for i := range typ.NumField() {
		t.Run(typ.Field(i).Name, func(t *testing.T) {
			w := base
			w.Policy = *base.Policy.DeepCopy()
			f := reflect.ValueOf(&w.Policy).Elem().Field(i)
			switch f.Kind() {
			case reflect.Bool:
				f.SetBool(!f.Bool())
			case reflect.Slice:
				f.Set(reflect.Append(f, reflect.ValueOf("insecure").Convert(f.Type().Elem())))
			case reflect.Map:
				f.SetMapIndex(reflect.ValueOf("tpm").Convert(f.Type().Key()), reflect.ValueOf("c").Convert(f.Type().Elem()))
			case reflect.Pointer:
				f.Set(reflect.New(f.Type().Elem()))
			default:
				t.Fatalf("field %s of kind %s: teach this test to change it", typ.Field(i).Name, f.Kind())
			}
			if h, _ := w.hash(); h == h0 {
				t.Errorf("changing %s leaves the hash as it was: the controller would not restart", typ.Field(i).Name)
			}
		})
	}
}

// FuzzParseClusterPolicy: whatever a tenant writes in the deprecated
// annotations, the parser returns a policy without blank or repeated
// attestors, a switch is on only for "true", and every other value of a
// switch is reported.
func FuzzParseClusterPolicy(f *testing.F) {
	f.Add("tpm,aws", "true", "good")
	f.Add(" , tpm,,tpm ", "True", "")
	f.Fuzz(func(t *testing.T, attestors, lockdown, doc string) {
		c := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
			AnnotationAuthorizedAttestors: attestors, AnnotationLockdown: lockdown, tpmPolicyAnnotation: doc}}}
		p, errs := ParseClusterPolicy(c, nil, map[string]attestor.Verifier{"tpm": policyVerifier{}})
		seen := map[string]bool{}
		for _, a := range p.AuthorizedAttestors {
			if a == "" || a != strings.TrimSpace(a) || strings.Contains(a, ",") || seen[a] {
				t.Fatalf("attestors %q from %q", p.AuthorizedAttestors, attestors)
			}
			seen[a] = true
		}
		if p.Lockdown != (lockdown == "true") {
			t.Fatalf("lockdown %t from %q", p.Lockdown, lockdown)
		}
		reported := false
		for _, e := range errs {
			reported = reported || e.Field == "metadata.annotations["+AnnotationLockdown+"]"
		}
		if reported != (lockdown != "true" && lockdown != "false") {
			t.Fatalf("lockdown %q reported: %t", lockdown, reported)
		}
	})
}
