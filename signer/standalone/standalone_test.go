package standalone

import (
	"context"
	"net"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

func TestParseAllowlistReportsEverything(t *testing.T) {
	_, err := ParseAllowlist([]byte(`nodes:
- nodeName: Bad_Name
  providerID: a
- nodeName: n1
- nodeName: n2
  providerID: a
- nodeName: n2
  providerID: b
- nodeName: n3
  providerID: c
  dnsNames: ["n3.example", "*.example"]
  ips: ["10.0.0.3", "10.0.0"]
`))
	if err == nil {
		t.Fatal("invalid allowlist accepted")
	}
	for _, want := range []string{"nodes[0].nodeName", "providerID is required", "both have provider ID", "both name node", `dnsNames "*.example"`, `ips "10.0.0": not an IP address`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if _, err := ParseAllowlist([]byte("nodes:\n- nodeName: n\n  providerID: p\n  unknown: x\n")); err == nil {
		t.Error("unknown field accepted")
	}
}

func TestMatcher(t *testing.T) {
	nn := types.NamespacedName{Namespace: "kube-system", Name: "allow"}
	client := fake.NewClientset()
	m := &Matcher{Client: client, ConfigMap: nn}
	ctx := context.Background()
	if _, err := m.MatchMachine(ctx, "node-a", "p"); err == nil || len(attestor.Denials(err)) > 0 {
		t.Fatalf("missing allowlist: %v, want a retried error", err)
	}
	if _, err := client.CoreV1().ConfigMaps(nn.Namespace).Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: nn.Name, Namespace: nn.Namespace},
		Data:       map[string]string{AllowlistKey: "nodes:\n- {nodeName: node-a, providerID: p, identity: 'tpm:ek-sha256:ab', dnsNames: [node-a.internal], ips: ['10.0.0.5']}\n"},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := m.MatchMachine(ctx, "node-a", "p")
	if err != nil || got.ProviderID != "p" || got.Identity != "tpm:ek-sha256:ab" {
		t.Fatalf("match = %+v, %v", got, err)
	}
	// Denials name the entry the operator edits, not a Machine.
	if d := got.Describe(); d != "allowlist entry node-a of ConfigMap kube-system/allow" {
		t.Errorf("the entry is described as %q", d)
	}
	// The entry's addresses are the only SANs a serving certificate may
	// have (engine: checks.CheckMachineAddresses).
	if got, err := m.ForNode(ctx, "node-a"); err != nil || !slices.Equal(got.DNSNames, []string{"node-a.internal"}) ||
		len(got.IPs) != 1 || !got.IPs[0].Equal(net.ParseIP("10.0.0.5")) {
		t.Fatalf("ForNode = %+v, %v", got, err)
	}
	for _, c := range []struct{ node, pid, reason string }{
		{"other", "p", attestor.ReasonNodeNotAllowed},
		{"node-a", "q", attestor.ReasonAllowlistProviderIDMismatch},
	} {
		_, err := m.MatchMachine(ctx, c.node, c.pid)
		if reason, _, _ := attestor.Denial(err); reason != c.reason {
			t.Errorf("%s/%s: %v, want %s", c.node, c.pid, err, c.reason)
		}
	}
}
