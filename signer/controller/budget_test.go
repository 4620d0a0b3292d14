package controller

import (
	"testing"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
)

// TestBudget: the CSRs cached are counted in and out, and reaching either
// bound is said once.
func TestBudget(t *testing.T) {
	csr := func(name string, pad int) *certificatesv1.CertificateSigningRequest {
		return &certificatesv1.CertificateSigningRequest{ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{"pad": string(make([]byte, pad))}}}
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
			h := b.handler()
			for i := range tc.adds {
				h.OnAdd(csr(string(rune('a'+i)), tc.pad), false)
			}
			if calls != tc.calls {
				t.Errorf("over budget said %d times, want %d", calls, tc.calls)
			}
			h.OnUpdate(csr("a", tc.pad), csr("a", 2*tc.pad))
			h.OnDelete(cache.DeletedFinalStateUnknown{Key: "a", Obj: csr("a", 2*tc.pad)})
			for i := 1; i < tc.adds; i++ {
				h.OnDelete(csr(string(rune('a'+i)), tc.pad))
			}
			if b.objects != 0 || b.bytes != 0 {
				t.Errorf("after every delete: %d objects, %d bytes cached", b.objects, b.bytes)
			}
		})
	}
}
