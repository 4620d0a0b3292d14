package controller

import (
	"testing"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
)

// TestBudget: the CSRs a store caches are counted in and out, whichever
// way they come and go (watch events, a list replacing the store, a
// deletion whose last state was missed), and reaching either bound is
// said once.
func TestBudget(t *testing.T) {
	csr := func(name string, pad int) *certificatesv1.CertificateSigningRequest {
		return &certificatesv1.CertificateSigningRequest{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: certificatesv1.CertificateSigningRequestSpec{Request: make([]byte, pad)}}
	}
	for _, tc := range []struct {
		name             string
		objects          int
		bytes            int64
		adds, pad, calls int
	}{
		{name: "within", objects: 10, bytes: 1 << 20, adds: 5, pad: 1000},
		{name: "objects", objects: 3, bytes: 1 << 20, adds: 5, pad: 10, calls: 1},
		{name: "bytes", objects: 100, bytes: 10 << 10, adds: 5, pad: 4 << 10, calls: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			calls := 0
			b := &budget{maxObjects: tc.objects, maxBytes: tc.bytes, over: func(int, int64) { calls++ }}
			s := newCSRStore(b.changed)
			for i := range tc.adds {
				if err := s.Add(csr(string(rune('a'+i)), tc.pad)); err != nil {
					t.Fatal(err)
				}
			}
			if calls != tc.calls {
				t.Errorf("over budget said %d times, want %d", calls, tc.calls)
			}
			if err := s.Update(csr("a", 2*tc.pad)); err != nil {
				t.Fatal(err)
			}
			if err := s.Delete(cache.DeletedFinalStateUnknown{Key: "a", Obj: csr("a", tc.pad)}); err != nil {
				t.Fatal(err)
			}
			// A list replaces the rest with one new request.
			if err := s.Replace([]any{csr("z", tc.pad)}, "1"); err != nil {
				t.Fatal(err)
			}
			if objs, n := b.objects, b.bytes; objs != 1 || n != int64(csr("z", tc.pad).Size()) {
				t.Errorf("after the list: %d objects, %d bytes cached, want 1, %d", objs, n, csr("z", tc.pad).Size())
			}
			if err := s.Delete(csr("z", 0)); err != nil {
				t.Fatal(err)
			}
			if b.objects != 0 || b.bytes != 0 {
				t.Errorf("after every delete: %d objects, %d bytes cached", b.objects, b.bytes)
			}
		})
	}
}
