package podcert

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
)

func TestNodeCredential(t *testing.T) {
	now := time.Now()
	mA := revoke.Machine{Namespace: "ns", Name: "a", UID: "uid-a"}
	mB := revoke.Machine{Namespace: "ns", Name: "b", UID: "uid-b"}
	s := &revoke.State{
		Version: "v1",
		Issued: []revoke.Credential{
			{SHA256: "old", Node: "node-a", Machine: mA, NotAfter: now.Add(time.Hour)},
			{SHA256: "new", Node: "node-a", Machine: mA, NotAfter: now.Add(48 * time.Hour)},
			{SHA256: "expired", Node: "node-c", Machine: mA, NotAfter: now.Add(-time.Minute)},
			{SHA256: "gone", Node: "node-d", Machine: mB, NotAfter: now.Add(time.Hour)},
			{SHA256: "after", Node: "node-d", Machine: mA, NotAfter: now.Add(time.Hour)},
		},
		Entries: []revoke.Entry{{Node: "node-d", Machine: mB, Accepted: []revoke.Credential{{SHA256: "after", Machine: mA}}}},
	}
	c, err := NodeCredential(s, "node-a", "new", now)
	if err != nil {
		t.Fatal(err)
	}
	if c.Machine != mA || !c.NotAfter.Equal(now.Add(48*time.Hour)) {
		t.Errorf("got %+v", c)
	}
	if _, err := NodeCredential(s, "node-d", "after", now); err != nil {
		t.Errorf("certificate accepted after the revocation: %v", err)
	}
	for name, tc := range map[string]struct{ node, fp, reason string }{
		"never issued":    {"node-a", "unknown", ReasonNodeNotAttested},
		"another node's":  {"node-b", "new", ReasonNodeNotAttested},
		"expired":         {"node-c", "expired", ReasonNodeNotAttested},
		"superseded":      {"node-a", "old", ReasonNodeSuperseded},
		"Machine deleted": {"node-d", "gone", ReasonNodeRevoked},
	} {
		_, err := NodeCredential(s, tc.node, tc.fp, now)
		t.Run(name, func(t *testing.T) { denial(t, err, tc.reason) })
	}
}

func TestNodeAttestation(t *testing.T) {
	at := time.Date(2026, 11, 27, 4, 0, 0, 0, time.UTC)
	cred := &revoke.Credential{SHA256: "fp", Node: "node-a", Machine: revoke.Machine{Namespace: "ns", Name: "a", UID: "uid-a"},
		Attested: &revoke.Attestation{Provider: "tpm", PolicySHA256: "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff", At: at}}
	a, err := NodeAttestation(cred, "aws:///z/i-1")
	if err != nil {
		t.Fatal(err)
	}
	if a.Attestor != "tpm" || a.ProviderID != "aws:///z/i-1" || a.MachineNamespace != "ns" || a.MachineName != "a" || a.NodeName != "node-a" ||
		!a.AttestedAt.Equal(at) || len(a.BootPolicySHA256) != 32 || !bytes.Equal(a.BootPolicySHA256[:2], []byte{0, 0x11}) {
		t.Errorf("got %+v", a)
	}
	cred.Attested.PolicySHA256 = ""
	if a, err := NodeAttestation(cred, ""); err != nil || a.BootPolicySHA256 != nil {
		t.Errorf("without a policy: %+v, %v", a, err)
	}
	// A record from before attestations were kept: retried, not denied.
	cred.Attested = nil
	if _, err := NodeAttestation(cred, ""); !errors.Is(err, ErrAttestationNotRecorded) {
		t.Errorf("unrecorded attestation: %v", err)
	}
}
