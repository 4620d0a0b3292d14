package podcert

import (
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
