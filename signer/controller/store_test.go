package controller

import (
	"slices"
	"testing"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

// TestIndexes: the pending bounds find a request waiting on a challenge
// under its requester and the node name it asks for through each change
// of its life (filed, challenged, answered, deleted, listed again), and
// under the node its current version asks for even when a server sends
// another request under the same name; a requester's requests are found,
// decided ones too; and the store keeps nothing of a request once it is
// gone.
func TestIndexes(t *testing.T) {
	s := newCSRStore(func(_, _ *certificatesv1.CertificateSigningRequest) {})
	const user = "system:bootstrap:abcdef"
	csr := func(name, node string, challenged bool) *certificatesv1.CertificateSigningRequest {
		var req []byte
		if node != "" {
			req, _ = signertest.Request{NodeName: node, ProviderID: "test:///" + node}.Build(t)
		}
		c := signertest.CSR(name, req)
		if challenged {
			c.Annotations = map[string]string{attestor.AnnotationChallengeSeal: "seal"}
		}
		return c
	}
	names := func(index, key string) []string {
		t.Helper()
		objs, err := s.ByIndex(index, key)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, o := range objs {
			out = append(out, o.(*certificatesv1.CertificateSigningRequest).Name)
		}
		slices.Sort(out)
		return out
	}
	check := func(step string, node1, node2, waitingAll, requester []string, remembered int) {
		t.Helper()
		for _, c := range []struct {
			what       string
			index, key string
			want       []string
		}{
			{"waiting for node-1", waiting, waitingKey(user, "node-1"), node1},
			{"waiting for node-2", waiting, waitingKey(user, "node-2"), node2},
			{"waiting of the requester", waiting, waitingKey(user, ""), waitingAll},
			{"waiting in all", waiting, waitingKey("", ""), waitingAll},
			{"of the requester", byRequester, user, requester},
		} {
			if got := names(c.index, c.key); !slices.Equal(got, c.want) {
				t.Errorf("%s: requests %s %q, want %q", step, c.what, got, c.want)
			}
		}
		s.mu.Lock()
		n := len(s.nodes)
		s.mu.Unlock()
		if n != remembered {
			t.Errorf("%s: %d requests remembered, want %d", step, n, remembered)
		}
	}

	must(t, s.Add(csr("a", "node-1", false)))
	check("filed", nil, nil, nil, []string{"a"}, 0)

	a := csr("a", "node-1", true)
	must(t, s.Update(a))
	must(t, s.Add(csr("b", "node-2", true)))
	check("challenged", []string{"a"}, []string{"b"}, []string{"a", "b"}, []string{"a", "b"}, 2)

	// Another request under b's name: it is indexed as it is now.
	must(t, s.Update(csr("b", "node-1", true)))
	check("b replaced", []string{"a", "b"}, nil, []string{"a", "b"}, []string{"a", "b"}, 2)

	answered := a.DeepCopy()
	answered.Status.Conditions = []certificatesv1.CertificateSigningRequestCondition{{Type: certificatesv1.CertificateDenied, Status: corev1.ConditionTrue}}
	must(t, s.Update(answered))
	check("a answered", []string{"b"}, nil, []string{"b"}, []string{"a", "b"}, 1)

	must(t, s.Delete(cache.DeletedFinalStateUnknown{Key: "b", Obj: csr("b", "", false)}))
	check("b deleted", nil, nil, nil, []string{"a"}, 0)

	must(t, s.Replace([]any{csr("c", "node-2", true), answered}, "2"))
	check("listed", nil, []string{"c"}, []string{"c"}, []string{"a", "c"}, 1)

	must(t, s.Delete(csr("c", "", false)))
	must(t, s.Delete(answered))
	check("all deleted", nil, nil, nil, nil, 0)
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// BenchmarkRequestLife measures what the store costs a request through
// its life, each change a new version from the watch: a one-round join
// (filed, approved, issued, deleted) and a challenged first round (filed,
// challenged, answered, deleted).
func BenchmarkRequestLife(b *testing.B) {
	req, _ := signertest.Request{NodeName: "node-1", ProviderID: "test:///node-1"}.Build(b)
	approved := []certificatesv1.CertificateSigningRequestCondition{{Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue}}
	denied := []certificatesv1.CertificateSigningRequestCondition{{Type: certificatesv1.CertificateDenied, Status: corev1.ConditionTrue}}
	challenge := map[string]string{attestor.AnnotationChallengeSeal: "seal"}
	for _, bc := range []struct {
		name  string
		steps []func(*certificatesv1.CertificateSigningRequest)
	}{
		{"one-round", []func(*certificatesv1.CertificateSigningRequest){
			func(*certificatesv1.CertificateSigningRequest) {},
			func(c *certificatesv1.CertificateSigningRequest) { c.Status.Conditions = approved },
			func(c *certificatesv1.CertificateSigningRequest) {
				c.Status.Conditions, c.Status.Certificate = approved, []byte("issued")
			},
		}},
		{"challenged", []func(*certificatesv1.CertificateSigningRequest){
			func(*certificatesv1.CertificateSigningRequest) {},
			func(c *certificatesv1.CertificateSigningRequest) { c.Annotations = challenge },
			func(c *certificatesv1.CertificateSigningRequest) {
				c.Annotations, c.Status.Conditions = challenge, denied
			},
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			s := newCSRStore(func(_, _ *certificatesv1.CertificateSigningRequest) {})
			for b.Loop() {
				var last *certificatesv1.CertificateSigningRequest
				for _, step := range bc.steps {
					last = signertest.CSR("a", req)
					step(last)
					if err := s.Update(last); err != nil {
						b.Fatal(err)
					}
				}
				if err := s.Delete(last); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
