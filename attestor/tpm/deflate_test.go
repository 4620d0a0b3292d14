package tpm

import (
	"bytes"
	"compress/flate"
	"encoding/json"
	"strings"
	"testing"
)

// deflated compresses b as raw DEFLATE, as a v4 node does.
func deflated(t *testing.T, b []byte) []byte {
	t.Helper()
	d, err := deflateEventLog(b)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// v4Attestation is first-round evidence of version with a log field set;
// DecodeEvidence checks its shape only.
func v4Attestation(t *testing.T, version string, a Attestation) []byte {
	t.Helper()
	a.EKPublic, a.AKPublic, a.Quote, a.QuoteSignature = []byte{0}, []byte{0}, []byte{0}, []byte{0}
	b, err := json.Marshal(Evidence{Version: version, Attestation: &a})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestDeflatedEventLog: a v4 node's log arrives deflated and the verifier
// reads the very bytes the node read; a log in the other version's field,
// one that is not DEFLATE, that inflates past the bound, that has data
// after its final block or that is empty is refused with a reason.
func TestDeflatedEventLog(t *testing.T) {
	log := realEventLog(t, "rhel8-uefi.bin")
	d := deflated(t, log)
	if len(d) >= len(log)*3/4 {
		t.Errorf("the RHEL 8 log deflates from %d to %d bytes, want under three quarters", len(log), len(d))
	}
	ev, err := DecodeEvidence(v4Attestation(t, VersionV4, Attestation{EventLogDeflated: d}))
	if err != nil {
		t.Fatalf("DecodeEvidence: %v", err)
	}
	if !bytes.Equal(ev.Attestation.EventLog, log) {
		t.Fatalf("inflated %d bytes, want the node's %d", len(ev.Attestation.EventLog), len(log))
	}

	var bomb bytes.Buffer
	w, _ := flate.NewWriter(&bomb, flate.BestCompression)
	_, _ = w.Write(make([]byte, maxEventLog+1))
	_ = w.Close()
	notDeflate := bytes.Repeat([]byte{0xff}, 64)
	for name, c := range map[string]struct {
		version string
		a       Attestation
		want    string
	}{
		"v4 with the log as is":         {VersionV4, Attestation{EventLog: log}, "eventLogDeflated, not eventLog"},
		"v3 with the log deflated":      {VersionV3, Attestation{EventLogDeflated: d}, "v4 field eventLogDeflated"},
		"v2 with the log deflated":      {VersionV2, Attestation{EventLogDeflated: d}, "v4 field eventLogDeflated"},
		"not DEFLATE":                   {VersionV4, Attestation{EventLogDeflated: notDeflate}, "not raw DEFLATE"},
		"zlib framing":                  {VersionV4, Attestation{EventLogDeflated: append([]byte{0x78, 0x9c}, d...)}, "not raw DEFLATE"},
		"cut short":                     {VersionV4, Attestation{EventLogDeflated: d[:len(d)/2]}, "not raw DEFLATE"},
		"inflates past the bound":       {VersionV4, Attestation{EventLogDeflated: bomb.Bytes()}, "inflates to more than"},
		"data after the final block":    {VersionV4, Attestation{EventLogDeflated: append(bytes.Clone(d), 0)}, "after its final block"},
		"an empty log":                  {VersionV4, Attestation{EventLogDeflated: deflated(t, nil)}, "empty log"},
		"deflated field past its bound": {VersionV4, Attestation{EventLogDeflated: make([]byte, maxEventLog+1)}, "eventLogDeflated is 98305 bytes, more than"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeEvidence(v4Attestation(t, c.version, c.a))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("DecodeEvidence: %v; want an error saying %q", err, c.want)
			}
		})
	}
}
