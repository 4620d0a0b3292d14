package checks

import (
	"testing"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

// FuzzCheck feeds arbitrary spec.request bytes, usernames and usages through
// the parse and check path: it must never panic, and whatever passes must be
// self-consistent.
func FuzzCheck(f *testing.F) {
	good, _ := signertest.Request{NodeName: node, ProviderID: pid}.Build(f)
	f.Add(good, "system:bootstrap:abcdef", "client auth")
	f.Add(append(good, "x"...), "system:node:worker-0", "server auth")
	f.Add([]byte("-----BEGIN CERTIFICATE REQUEST-----\n-----END CERTIFICATE REQUEST-----\n"), "", "")
	f.Fuzz(func(t *testing.T, request []byte, username, usage string) {
		csr := signertest.CSR("fuzz", request)
		csr.Spec.Username = username
		csr.Spec.Groups = []string{attestor.BootstrappersGroup, attestor.NodesGroup}
		csr.Spec.Usages = append(csr.Spec.Usages, certificatesv1.KeyUsage(usage))
		got, err := Check(csr, Rules{Kind: Client, Attested: true, Provider: "insecure"})
		if err != nil {
			if got != nil {
				t.Fatal("result with an error")
			}
			if _, _, ok := attestor.Denial(err); !ok {
				t.Fatalf("error without a failure: %v", err)
			}
			return
		}
		if got.NodeName == "" || got.ProviderID == "" || got.Request == nil {
			t.Fatalf("passed with an incomplete result %+v", got)
		}
		if len(got.Request.CSR.DNSNames)+len(got.Request.CSR.IPAddresses)+len(got.Request.CSR.URIs)+len(got.Request.CSR.EmailAddresses) > 0 {
			t.Fatal("passed with SANs")
		}
	})
}
