package controller

import (
	"slices"
	"testing"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"

	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

// TestRequesterIndex: the requester index finds a pending request under
// the node name it asks for through each change of its life (filed,
// approved, issued, deleted, listed again), finds it under the node its
// current version asks for even when a server sends another request under
// the same name, and the store keeps nothing of a request once it is gone.
func TestRequesterIndex(t *testing.T) {
	s := newCSRStore(func(_, _ *certificatesv1.CertificateSigningRequest) {})
	const user = "system:bootstrap:abcdef"
	request := func(node string) []byte {
		b, _ := signertest.Request{NodeName: node, ProviderID: "test:///" + node}.Build(t)
		return b
	}
	index := func(node string) []string {
		t.Helper()
		objs, err := s.ByIndex(byRequester, requesterKey(user, node))
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, o := range objs {
			names = append(names, o.(*certificatesv1.CertificateSigningRequest).Name)
		}
		slices.Sort(names)
		return names
	}
	check := func(step string, node1, node2, all []string, remembered int) {
		t.Helper()
		if got := index("node-1"); !slices.Equal(got, node1) {
			t.Errorf("%s: requests for node-1 %q, want %q", step, got, node1)
		}
		if got := index("node-2"); !slices.Equal(got, node2) {
			t.Errorf("%s: requests for node-2 %q, want %q", step, got, node2)
		}
		if got := index(""); !slices.Equal(got, all) {
			t.Errorf("%s: requests of the requester %q, want %q", step, got, all)
		}
		s.mu.Lock()
		n := len(s.nodes)
		s.mu.Unlock()
		if n != remembered {
			t.Errorf("%s: %d requests remembered, want %d", step, n, remembered)
		}
	}
	a1 := request("node-1")

	must(t, s.Add(signertest.CSR("a", a1)))
	must(t, s.Add(signertest.CSR("b", request("node-2"))))
	check("filed", []string{"a"}, []string{"b"}, []string{"a", "b"}, 2)

	approved := signertest.CSR("a", a1)
	approved.Status.Conditions = []certificatesv1.CertificateSigningRequestCondition{{Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue}}
	must(t, s.Update(approved))
	check("approved", []string{"a"}, []string{"b"}, []string{"a", "b"}, 2)

	// Another request under b's name: it is indexed as it is now.
	must(t, s.Update(signertest.CSR("b", request("node-1"))))
	check("b replaced", []string{"a", "b"}, nil, []string{"a", "b"}, 2)

	issued := signertest.CSR("a", a1)
	issued.Status.Conditions = approved.Status.Conditions
	issued.Status.Certificate = []byte("issued")
	must(t, s.Update(issued))
	check("issued", []string{"b"}, nil, []string{"a", "b"}, 1)

	must(t, s.Delete(cache.DeletedFinalStateUnknown{Key: "b", Obj: signertest.CSR("b", nil)}))
	check("b deleted", nil, nil, []string{"a"}, 0)

	must(t, s.Replace([]any{signertest.CSR("c", request("node-2")), issued}, "2"))
	check("listed", nil, []string{"c"}, []string{"a", "c"}, 1)

	must(t, s.Delete(signertest.CSR("c", nil)))
	must(t, s.Delete(issued))
	check("all deleted", nil, nil, nil, 0)
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// BenchmarkRequestLife measures what the store costs a request through
// its life in a fleet's join: filed, approved, issued and deleted, each a
// new version from the watch.
func BenchmarkRequestLife(b *testing.B) {
	s := newCSRStore(func(_, _ *certificatesv1.CertificateSigningRequest) {})
	req, _ := signertest.Request{NodeName: "node-1", ProviderID: "test:///node-1"}.Build(b)
	approval := []certificatesv1.CertificateSigningRequestCondition{{Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue}}
	for b.Loop() {
		if err := s.Add(signertest.CSR("a", req)); err != nil {
			b.Fatal(err)
		}
		approved := signertest.CSR("a", req)
		approved.Status.Conditions = approval
		if err := s.Update(approved); err != nil {
			b.Fatal(err)
		}
		issued := signertest.CSR("a", req)
		issued.Status.Conditions = approval
		issued.Status.Certificate = []byte("issued")
		if err := s.Update(issued); err != nil {
			b.Fatal(err)
		}
		if err := s.Delete(issued); err != nil {
			b.Fatal(err)
		}
	}
}
