package controller

import (
	"bytes"
	"fmt"
	"strings"
	"testing"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

// hugeMetadata gives csr as much metadata as the API server accepts of a
// requester: 250 KiB of annotations, 4,000 labels, 2,000 finalizers.
func hugeMetadata(csr *certificatesv1.CertificateSigningRequest) {
	if csr.Annotations == nil {
		csr.Annotations = map[string]string{}
	}
	for i := range 250 {
		csr.Annotations[fmt.Sprintf("example.com/padding-%03d", i)] = strings.Repeat("a", 1000)
	}
	csr.Labels = map[string]string{}
	for i := range 4000 {
		csr.Labels[fmt.Sprintf("example.com/label-%04d", i)] = fmt.Sprintf("value-%04d", i)
	}
	for i := range 2000 {
		csr.Finalizers = append(csr.Finalizers, fmt.Sprintf("example.com/finalizer-%04d", i))
	}
}

// TestForgetUnread: what a requester writes on its request beyond what the
// signer reads is not cached, and what the signer reads is cached as
// written (or cut just past the size it reads, so that the request is
// denied for its size).
func TestForgetUnread(t *testing.T) {
	req, _ := signertest.Request{NodeName: "node-1", ProviderID: pid}.Build(t)
	created := metav1.Now()
	deleting := metav1.Now()
	base := func() *certificatesv1.CertificateSigningRequest {
		csr := &certificatesv1.CertificateSigningRequest{
			ObjectMeta: metav1.ObjectMeta{
				Name: "csr-1", GenerateName: strings.Repeat("g", 200), UID: "uid-1", ResourceVersion: "42", Generation: 3,
				CreationTimestamp: created, DeletionTimestamp: &deleting,
				Annotations: map[string]string{
					attestor.AnnotationChallenge:         "challenge",
					attestor.AnnotationChallengeSeal:     "v1.1.mac",
					attestor.AnnotationSupportedVersions: "v1,v2",
					attestor.AnnotationEndorsementKey:    strings.Repeat("e", attestor.MaxAnnotationSize+100),
				},
				OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "ConfigMap", Name: "x", UID: "u"}},
				ManagedFields:   []metav1.ManagedFieldsEntry{{Manager: "kubectl", FieldsV1: metav1.NewFieldsV1(strings.Repeat("{}", 1000))}},
			},
			Spec: certificatesv1.CertificateSigningRequestSpec{
				SignerName: attestor.ClientSignerName("fake"), Username: "system:bootstrap:abcdef", UID: "user-uid",
				Groups: []string{attestor.BootstrappersGroup}, Usages: signertest.ClientUsages, Request: req,
			},
		}
		hugeMetadata(csr)
		return csr
	}
	const bound = 24 << 10 // the kept annotations, the request and the rest

	t.Run("pending", func(t *testing.T) {
		in := base()
		before := in.Size()
		out, err := forgetUnread(in)
		if err != nil {
			t.Fatal(err)
		}
		csr := out.(*certificatesv1.CertificateSigningRequest)
		if len(csr.Labels) != 0 || len(csr.Finalizers) != 0 || len(csr.OwnerReferences) != 0 || len(csr.ManagedFields) != 0 || csr.GenerateName != "" {
			t.Errorf("cached %d labels, %d finalizers, %d owner references, %d managed fields, generateName %q; want none",
				len(csr.Labels), len(csr.Finalizers), len(csr.OwnerReferences), len(csr.ManagedFields), csr.GenerateName)
		}
		want := map[string]int{
			attestor.AnnotationChallenge:         len("challenge"),
			attestor.AnnotationChallengeSeal:     len("v1.1.mac"),
			attestor.AnnotationSupportedVersions: len("v1,v2"),
			attestor.AnnotationEndorsementKey:    attestor.MaxAnnotationSize + 1,
		}
		if len(csr.Annotations) != len(want) {
			t.Errorf("cached %d annotations, want the %d the signer reads", len(csr.Annotations), len(want))
		}
		for k, n := range want {
			if len(csr.Annotations[k]) != n {
				t.Errorf("annotation %s cached with %d bytes, want %d", k, len(csr.Annotations[k]), n)
			}
		}
		if csr.Annotations[attestor.AnnotationChallengeSeal] != "v1.1.mac" {
			t.Errorf("the seal was cached as %q", csr.Annotations[attestor.AnnotationChallengeSeal])
		}
		if csr.Name != "csr-1" || csr.UID != types.UID("uid-1") || csr.ResourceVersion != "42" || !csr.CreationTimestamp.Equal(&created) || csr.DeletionTimestamp == nil {
			t.Errorf("identity and version not kept: %+v", csr.ObjectMeta)
		}
		if !bytes.Equal(csr.Spec.Request, req) || csr.Spec.Username != "system:bootstrap:abcdef" || csr.Spec.SignerName != attestor.ClientSignerName("fake") {
			t.Errorf("the spec was changed: %+v", csr.Spec)
		}
		if after := csr.Size(); after > bound {
			t.Errorf("a pending request with huge metadata is cached with %d bytes (%d as filed), want at most %d", after, before, bound)
		} else {
			t.Logf("a pending request with huge metadata: %d bytes as filed, %d cached", before, after)
		}
	})

	t.Run("decided", func(t *testing.T) {
		in := base()
		in.Status.Conditions = []certificatesv1.CertificateSigningRequestCondition{{Type: certificatesv1.CertificateDenied, Status: corev1.ConditionTrue, Reason: "X"}}
		out, _ := forgetUnread(in)
		csr := out.(*certificatesv1.CertificateSigningRequest)
		if csr.Spec.Request != nil || len(csr.Labels) != 0 || len(csr.Finalizers) != 0 {
			t.Errorf("a decided request cached with %d request bytes, %d labels, %d finalizers; want none", len(csr.Spec.Request), len(csr.Labels), len(csr.Finalizers))
		}
		if len(csr.Status.Conditions) != 1 {
			t.Errorf("conditions not kept: %+v", csr.Status)
		}
	})

	t.Run("oversized request", func(t *testing.T) {
		in := base()
		in.Spec.Request = bytes.Repeat([]byte("x"), 3<<20)
		decoded := in.Spec.Request
		out, _ := forgetUnread(in)
		csr := out.(*certificatesv1.CertificateSigningRequest)
		if n := len(csr.Spec.Request); n != attestor.MaxRequestSize+1 {
			t.Errorf("an oversized request is cached with %d bytes, want %d", n, attestor.MaxRequestSize+1)
		}
		// A cut that shares the decoded array keeps all 3 MiB of it alive.
		if &csr.Spec.Request[0] == &decoded[0] {
			t.Error("the cached request shares the decoded request's array")
		}
	})

	t.Run("no annotations of the signer's", func(t *testing.T) {
		in := base()
		for _, k := range attestor.RequestAnnotations() {
			delete(in.Annotations, k)
		}
		out, _ := forgetUnread(in)
		if a := out.(*certificatesv1.CertificateSigningRequest).Annotations; a != nil {
			t.Errorf("cached annotations %d, want none", len(a))
		}
	})
}
