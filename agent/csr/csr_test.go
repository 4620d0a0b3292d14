package csr

import (
	"net"
	"slices"
	"testing"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
)

// TestServingRequestPassesTheSignersRules: a serving request built here,
// filed as the node to the attested serving signer, passes the signer's
// structural rules for serving certificates, and carries the SANs, key
// binding and provider ID it was built with; the client request has no SANs.
func TestServingRequestPassesTheSignersRules(t *testing.T) {
	key, err := GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	ips := []net.IP{net.ParseIP("10.0.0.5")}
	der, err := ServingPKCS10(key, "n1", "test:///n1", []string{"n1", "n1.internal"}, ips)
	if err != nil {
		t.Fatal(err)
	}
	request, err := attestor.EncodeRequest(der, "tpm", []byte(`{"version":"v1"}`))
	if err != nil {
		t.Fatal(err)
	}
	signer := attestor.ServingSignerName("tpm")
	obj := ObjectWithUsages("x", signer, ServingUsages, request, nil, nil)
	obj.Spec.Username, obj.Spec.Groups = "system:node:n1", []string{attestor.NodesGroup, "system:authenticated"}
	got, err := checks.Check(obj, checks.Rules{Kind: checks.Serving, Attested: true, Provider: "tpm"})
	if err != nil {
		t.Fatalf("the signer's serving rules refuse the agent's request: %v", err)
	}
	binding, _ := Binding(key)
	if got.NodeName != "n1" || got.ProviderID != "test:///n1" || !slices.Equal(got.Binding, binding) ||
		!slices.Equal(got.CSR.DNSNames, []string{"n1", "n1.internal"}) || len(got.CSR.IPAddresses) != 1 || !got.CSR.IPAddresses[0].Equal(ips[0]) {
		t.Fatalf("checked request %+v", got)
	}
	if !slices.Equal(obj.Spec.Usages, []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth}) {
		t.Errorf("usages %v", obj.Spec.Usages)
	}
	if _, err := ServingPKCS10(key, "n1", "test:///n1", nil, nil); err == nil {
		t.Error("a serving request without addresses was built")
	}
	client, err := PKCS10(key, "n1", "test:///n1")
	if err != nil {
		t.Fatal(err)
	}
	creq, err := attestor.EncodeRequest(client, "tpm", []byte(`{"version":"v1"}`))
	if err != nil {
		t.Fatal(err)
	}
	cobj := Object("y", attestor.ClientSignerName("tpm"), creq, nil, nil)
	cobj.Spec.Username, cobj.Spec.Groups = "system:node:n1", []string{attestor.NodesGroup}
	if _, err := checks.Check(cobj, checks.Rules{Kind: checks.Client, Attested: true, Provider: "tpm"}); err != nil {
		t.Fatalf("the signer's client rules refuse the agent's client request: %v", err)
	}
}
