package tpm

import (
	"bytes"
	"errors"
	"testing"
)

// TestReplayCache: a log replayed against the same PCR values again is not
// parsed again and yields the same state; other values, a failed replay or
// another log are replayed, never answered from what was remembered.
func TestReplayCache(t *testing.T) {
	raw := realEventLog(t, "rhel8-uefi.bin")
	pcrs := logPCRs(t, raw, logBank(t, raw))
	var c replayCache
	first, err := c.replay(raw, pcrs)
	if err != nil {
		t.Fatal(err)
	}
	again, err := c.replay(raw, pcrs)
	if err != nil || again != first {
		t.Fatalf("the same log and values replayed again: %p, %v; want the remembered %p", again, err, first)
	}

	// One PCR changed: not the remembered state, and the log does not
	// replay against it.
	changed := clonePCRs(pcrs)
	changed[0].Digest = bytes.Repeat([]byte{0xa5}, len(changed[0].Digest))
	if _, err := c.replay(raw, changed); !errors.Is(err, errEventLogMismatch) {
		t.Fatalf("replay against a changed PCR: %v, want %v", err, errEventLogMismatch)
	}
	// Failures are not remembered.
	if _, err := c.replay(raw, changed); !errors.Is(err, errEventLogMismatch) {
		t.Fatalf("replay against a changed PCR, again: %v, want %v", err, errEventLogMismatch)
	}
	// A log edited by one byte is replayed, not answered from the cache.
	edited := bytes.Clone(raw)
	edited[len(edited)-1] ^= 1
	if st, err := c.replay(edited, pcrs); err == nil && st == first {
		t.Fatal("an edited log was answered with the original log's state")
	}

	// The cache stays bounded.
	for i := range replayCacheSize + 8 {
		p := clonePCRs(pcrs)
		p = append(p, PCRValue{Bank: p[0].Bank, Index: 16, Digest: []byte{byte(i), byte(i >> 8)}})
		c.replay(raw, p) //nolint:errcheck // only the bound is checked
	}
	if len(c.states) > replayCacheSize || len(c.order) != len(c.states) {
		t.Fatalf("the cache holds %d states (%d in order), more than %d", len(c.states), len(c.order), replayCacheSize)
	}
}

func clonePCRs(in []PCRValue) []PCRValue {
	out := make([]PCRValue, len(in))
	for i, p := range in {
		out[i] = PCRValue{Bank: p.Bank, Index: p.Index, Digest: bytes.Clone(p.Digest)}
	}
	return out
}
