package engine

import (
	"errors"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// TestUndecidable: a request retried too often is denied Undecidable with
// the last error, or failed when this signer had approved it.
func TestUndecidable(t *testing.T) {
	for _, approved := range []bool{false, true} {
		d := Undecidable(&Decision{Outcome: Retry, Err: errors.New("upstream down"), Approved: approved}, 7)
		want, reason := Deny, attestor.ReasonUndecidable
		if approved {
			want, reason = Fail, attestor.ReasonSigningFailed
		}
		if d.Outcome != want || d.Reason != reason || !strings.Contains(d.Message, "upstream down") || !strings.Contains(d.Message, "7 tries") {
			t.Errorf("approved %t: %s %q %q, want %s %s naming the tries and the last error", approved, d.Outcome, d.Reason, d.Message, want, reason)
		}
	}
}
