package tpm

import (
	"bytes"
	"crypto"
	"encoding/binary"
	"errors"
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
// digest) replaced by replacement.
func alterBytes(tb testing.TB, raw, old, replacement []byte) []byte {
	tb.Helper()
	i := bytes.Index(raw, old)
	if i < 0 {
		tb.Fatal("the log does not hold the bytes to alter")
	}
	out := bytes.Clone(raw)
	copy(out[i:], replacement)
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

// agileEvent is one event of a crypto-agile log, decoded for editing.
type agileEvent struct {
	pcr, typ uint32
	// digests are the event's digests by TPM algorithm ID, in log order.
	algs    []uint16
	digests [][]byte
	data    []byte
}

// agileLog is a crypto-agile event log split into its Spec ID event (kept
// as bytes) and its events.
type agileLog struct {
	head   []byte
	sizes  map[uint16]int
	events []agileEvent
}

// splitLog decodes raw, a crypto-agile log, for editing.
func splitLog(tb testing.TB, raw []byte) *agileLog {
	tb.Helper()
	l, err := parseAgileLog(raw)
	if err != nil {
		tb.Fatal(err)
	}
	return l
}

// parseAgileLog decodes a crypto-agile log, refusing anything that does
// not fit (it also reads fuzzed input).
func parseAgileLog(raw []byte) (*agileLog, error) {
	r := &reader{b: raw}
	r.skip(8 + 20)
	spec := r.bytes(int(r.u32()))
	if r.err != nil || len(spec) < 28 {
		return nil, errors.New("no Spec ID event")
	}
	l := &agileLog{head: raw[:r.off], sizes: map[uint16]int{}}
	n := int(binary.LittleEndian.Uint32(spec[24:]))
	if n > 8 || len(spec) < 28+4*n {
		return nil, errors.New("bad Spec ID event")
	}
	for i := range n {
		e := spec[28+4*i:]
		l.sizes[binary.LittleEndian.Uint16(e)] = int(binary.LittleEndian.Uint16(e[2:]))
	}
	for r.off < len(raw) && r.err == nil {
		e := agileEvent{pcr: r.u32(), typ: r.u32()}
		count := r.u32()
		if count > 8 {
			return nil, errors.New("too many digests")
		}
		for range count {
			alg := r.u16()
			size, ok := l.sizes[alg]
			if !ok {
				return nil, errors.New("unknown digest algorithm")
			}
			e.algs = append(e.algs, alg)
			e.digests = append(e.digests, bytes.Clone(r.bytes(size)))
		}
		e.data = bytes.Clone(r.bytes(int(r.u32())))
		l.events = append(l.events, e)
	}
	if r.err != nil {
		return nil, r.err
	}
	return l, nil
}

// bytes encodes the log.
func (l *agileLog) bytes() []byte {
	out := bytes.Clone(l.head)
	le := binary.LittleEndian
	for _, e := range l.events {
		out = le.AppendUint32(out, e.pcr)
		out = le.AppendUint32(out, e.typ)
		out = le.AppendUint32(out, uint32(len(e.digests)))
		for i, d := range e.digests {
			out = le.AppendUint16(out, e.algs[i])
			out = append(out, d...)
		}
		out = le.AppendUint32(out, uint32(len(e.data)))
		out = append(out, e.data...)
	}
	return out
}

// algHashes are the hashes of the TPM algorithm IDs event logs carry.
var algHashes = map[uint16]crypto.Hash{0x0004: crypto.SHA1, 0x000b: crypto.SHA256, 0x000c: crypto.SHA384, 0x000d: crypto.SHA512}

// measure sets every digest of e to the digest of content in its bank: a
// firmware or boot loader that measured content.
func (e *agileEvent) measure(content []byte) {
	for i, a := range e.algs {
		h := algHashes[a].New()
		h.Write(content)
		e.digests[i] = h.Sum(nil)
	}
}

// of returns the indices of l's events of pcr (and of type typ, where
// non-zero), in log order.
func (l *agileLog) of(pcr, typ uint32) []int {
	var out []int
	for i, e := range l.events {
		if e.pcr == pcr && (typ == 0 || e.typ == typ) {
			out = append(out, i)
		}
	}
	return out
}

// reader reads little-endian fields, remembering the first overrun.
type reader struct {
	b   []byte
	off int
	err error
}

func (r *reader) bytes(n int) []byte {
	if r.err != nil || n < 0 || n > len(r.b)-r.off {
		r.err = errors.New("truncated")
		return nil
	}
	r.off += n
	return r.b[r.off-n : r.off]
}

func (r *reader) skip(n int) { r.bytes(n) }

func (r *reader) u16() uint16 {
	if b := r.bytes(2); b != nil {
		return binary.LittleEndian.Uint16(b)
	}
	return 0
}

func (r *reader) u32() uint32 {
	if b := r.bytes(4); b != nil {
		return binary.LittleEndian.Uint32(b)
	}
	return 0
}

func TestSplitLogRoundTrips(t *testing.T) {
	for _, name := range []string{softLog, "ubuntu-2104-no-secure-boot.bin", "gdc-host.bin"} {
		raw := realEventLog(t, name)
		if got := splitLog(t, raw).bytes(); !bytes.Equal(got, raw) {
			t.Errorf("%s: split and joined, the log changed (%d bytes, was %d)", name, len(got), len(raw))
		}
	}
}
