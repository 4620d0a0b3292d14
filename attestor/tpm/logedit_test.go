package tpm

import (
	"bytes"
	"encoding/binary"
	"testing"
)

// logEvent is where one event sits in a raw crypto-agile event log.
type logEvent struct {
	start, end int
	pcr        uint32
}

// logEvents splits a crypto-agile (TCG2) event log into its events, after
// the SHA-1-format Spec ID event, so that tests can drop or alter one.
func logEvents(tb testing.TB, raw []byte) []logEvent {
	tb.Helper()
	u32 := func(off int) int { return int(binary.LittleEndian.Uint32(raw[off:])) }
	// The Spec ID event: index, type, SHA-1 digest, size, data.
	off := 4 + 4 + 20
	specSize := u32(off)
	spec := raw[off+4 : off+4+specSize]
	off += 4 + specSize
	// Spec ID data: signature(16) platformClass(4) versions(3) uintnSize(1)
	// numberOfAlgorithms(4), then {algId u16, size u16}.
	sizes := map[uint16]int{}
	n := int(binary.LittleEndian.Uint32(spec[24:]))
	for i := range n {
		e := spec[28+4*i:]
		sizes[binary.LittleEndian.Uint16(e)] = int(binary.LittleEndian.Uint16(e[2:]))
	}
	var out []logEvent
	for off < len(raw) {
		start := off
		pcr := uint32(u32(off))
		off += 8
		count := u32(off)
		off += 4
		for range count {
			alg := binary.LittleEndian.Uint16(raw[off:])
			off += 2 + sizes[alg]
		}
		off += 4 + u32(off)
		out = append(out, logEvent{start, off, pcr})
	}
	return out
}

// dropEvent returns raw without the last event of pcr.
func dropEvent(tb testing.TB, raw []byte, pcr uint32) []byte {
	tb.Helper()
	evs := logEvents(tb, raw)
	for i := len(evs) - 1; i >= 0; i-- {
		if evs[i].pcr == pcr {
			return append(bytes.Clone(raw[:evs[i].start]), raw[evs[i].end:]...)
		}
	}
	tb.Fatalf("the log has no event of PCR %d", pcr)
	return nil
}

// alterBytes returns raw with the first occurrence of old (an event's
// digest) replaced by new.
func alterBytes(tb testing.TB, raw, old, new []byte) []byte {
	tb.Helper()
	i := bytes.Index(raw, old)
	if i < 0 {
		tb.Fatal("the log does not hold the bytes to alter")
	}
	out := bytes.Clone(raw)
	copy(out[i:], new)
	return out
}

func TestLogEventsSplitsRealLogs(t *testing.T) {
	for _, name := range []string{softLog, "ubuntu-2104-no-secure-boot.bin", "cos-101-amd-sev.bin"} {
		raw := realEventLog(t, name)
		evs := logEvents(t, raw)
		if len(evs) < 40 || evs[len(evs)-1].end != len(raw) {
			t.Errorf("%s: split into %d events ending at %d of %d bytes", name, len(evs), evs[len(evs)-1].end, len(raw))
		}
	}
}
