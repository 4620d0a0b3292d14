package harness

import (
	"context"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// WaitForCSRDecision waits up to timeout until the CSR name is denied,
// failed or has its certificate, and returns it.
func WaitForCSRDecision(tb testing.TB, c kubernetes.Interface, name string, timeout time.Duration) *certificatesv1.CertificateSigningRequest {
	tb.Helper()
	var got *certificatesv1.CertificateSigningRequest
	WaitFor(tb, timeout, func() (bool, error) {
		var err error
		got, err = c.CertificatesV1().CertificateSigningRequests().Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if CSRCondition(got, certificatesv1.CertificateDenied) != nil || CSRCondition(got, certificatesv1.CertificateFailed) != nil {
			return true, nil
		}
		return len(got.Status.Certificate) > 0, nil
	})
	return got
}

// CSRCondition returns the CSR's condition of type t, or nil.
func CSRCondition(csr *certificatesv1.CertificateSigningRequest, t certificatesv1.RequestConditionType) *certificatesv1.CertificateSigningRequestCondition {
	for i := range csr.Status.Conditions {
		if csr.Status.Conditions[i].Type == t {
			return &csr.Status.Conditions[i]
		}
	}
	return nil
}
