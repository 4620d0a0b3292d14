package tpm

import (
	"crypto"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-tpm/tpm2"
	"google.golang.org/protobuf/encoding/protowire"
)

// gceAttestation is the part of go-tpm-tools' attest.Attestation message
// this test reads, decoded with protowire so that the test does not link
// go-tpm-tools' protos (and their confidential-computing dependencies).
type gceAttestation struct {
	akPub    []byte
	quotes   []gceQuote
	eventLog []byte
}

type gceQuote struct {
	quote, rawSig []byte
	hash          uint64
	pcrs          map[uint64][]byte
}

// protoFields calls f for each field of a protobuf message.
func protoFields(t *testing.T, b []byte, f func(num protowire.Number, typ protowire.Type, v []byte, n uint64)) {
	t.Helper()
	for len(b) > 0 {
		num, typ, l := protowire.ConsumeTag(b)
		if l < 0 {
			t.Fatal(protowire.ParseError(l))
		}
		b = b[l:]
		switch typ {
		case protowire.BytesType:
			v, l := protowire.ConsumeBytes(b)
			if l < 0 {
				t.Fatal(protowire.ParseError(l))
			}
			f(num, typ, v, 0)
			b = b[l:]
		case protowire.VarintType:
			v, l := protowire.ConsumeVarint(b)
			if l < 0 {
				t.Fatal(protowire.ParseError(l))
			}
			f(num, typ, nil, v)
			b = b[l:]
		default:
			l := protowire.ConsumeFieldValue(num, typ, b)
			if l < 0 {
				t.Fatal(protowire.ParseError(l))
			}
			b = b[l:]
		}
	}
}

// parseGCEAttestation decodes attest.Attestation: ak_pub = 1, quotes = 2
// (tpm.Quote: quote = 1, raw_sig = 2, pcrs = 3 (tpm.PCRs: hash = 1,
// pcrs = 2, a map<uint32, bytes>)), event_log = 3.
func parseGCEAttestation(t *testing.T, raw []byte) *gceAttestation {
	t.Helper()
	att := &gceAttestation{}
	protoFields(t, raw, func(num protowire.Number, _ protowire.Type, v []byte, _ uint64) {
		switch num {
		case 1:
			att.akPub = v
		case 3:
			att.eventLog = v
		case 2:
			q := gceQuote{pcrs: map[uint64][]byte{}}
			protoFields(t, v, func(num protowire.Number, _ protowire.Type, v []byte, _ uint64) {
				switch num {
				case 1:
					q.quote = v
				case 2:
					q.rawSig = v
				case 3:
					protoFields(t, v, func(num protowire.Number, _ protowire.Type, v []byte, n uint64) {
						switch num {
						case 1:
							q.hash = n
						case 2:
							var k uint64
							var d []byte
							protoFields(t, v, func(num protowire.Number, _ protowire.Type, v []byte, n uint64) {
								switch num {
								case 1:
									k = n
								case 2:
									d = v
								}
							})
							q.pcrs[k] = d
						}
					})
				}
			})
			att.quotes = append(att.quotes, q)
		}
	})
	return att
}

// TestRealGCEAttestations checks what the verifier checks of a quote, and
// the event log replay, on real Google Compute Engine vTPM attestations
// that go-tpm-tools ships (read from the module cache): the AK is a
// restricted signing key fixed to its TPM, each quote is signed by it and
// covers exactly the PCR values that come with it, and the real event log
// replays against those quoted PCRs. (The qualifying data is go-tpm-tools'
// nonce, not a binding: that check is not run here.)
func TestRealGCEAttestations(t *testing.T) {
	for _, c := range []struct {
		file       string
		secureBoot bool
		kernel     string
	}{
		{"gce-cos-85-no-nonce.pb", true, "/syslinux/vmlinuz.A"},
		{"gce-cos-85-nonce9009.pb", true, "/syslinux/vmlinuz.A"},
	} {
		t.Run(c.file, func(t *testing.T) {
			raw, err := os.ReadFile(filepath.Join(goTPMToolsDir(t), "internal", "test", "attestations", c.file))
			if err != nil {
				t.Fatalf("real attestation missing: %v", err)
			}
			att := parseGCEAttestation(t, raw)
			akPub, err := decodePublic(att.akPub)
			if err != nil {
				t.Fatal(err)
			}
			if err := checkAKAttributes(akPub); err != nil {
				t.Fatal(err)
			}
			akKey, err := publicKey(akPub)
			if err != nil {
				t.Fatal(err)
			}
			if len(att.quotes) == 0 || len(att.eventLog) == 0 {
				t.Fatal("the attestation has no quote or no event log")
			}
			for _, q := range att.quotes {
				info, err := decodeAttest(q.quote, tpm2.TPMSTAttestQuote)
				if err != nil {
					t.Fatal(err)
				}
				sigHash, err := verifySignature(akKey, q.quote, q.rawSig)
				if err != nil {
					t.Fatalf("the real quote does not verify with the AK: %v", err)
				}
				bank, ok := bankName(tpm2.TPMAlgID(q.hash))
				if !ok {
					t.Fatalf("quote of unknown bank %v", q.hash)
				}
				var pcrs []PCRValue
				for i, d := range q.pcrs {
					pcrs = append(pcrs, PCRValue{Bank: bank, Index: int(i), Digest: d})
				}
				quote, err := info.Attested.Quote()
				if err != nil {
					t.Fatal(err)
				}
				h, _ := hashFor(sigHash)
				digest, err := pcrDigest(quote.PCRSelect, pcrs, h)
				if err != nil {
					t.Fatal(err)
				}
				if hex.EncodeToString(digest) != hex.EncodeToString(quote.PCRDigest.Buffer) {
					t.Fatalf("%s: the PCR values are not the quoted ones", bank)
				}
				if h != crypto.SHA256 && h != crypto.SHA384 && h != crypto.SHA512 {
					t.Fatalf("quote signed with %v", h)
				}
				if bank == "sha1" {
					continue // replay uses the strongest bank
				}
				st, err := ReplayEventLog(att.eventLog, pcrs)
				if err != nil {
					t.Fatalf("the real log does not replay against the real %s quote: %v", bank, err)
				}
				if st.SecureBoot != c.secureBoot || st.KernelPath != c.kernel || st.Firmware == "" {
					t.Errorf("%s: boot state %+v", bank, st)
				}
				// An altered PCR 4 is no longer this log's.
				for i := range pcrs {
					if pcrs[i].Index == 4 {
						pcrs[i].Digest = append([]byte{pcrs[i].Digest[0] ^ 1}, pcrs[i].Digest[1:]...)
					}
				}
				if _, err := ReplayEventLog(att.eventLog, pcrs); !errors.Is(err, errEventLogMismatch) {
					t.Errorf("%s: the log against an altered PCR 4: %v", bank, err)
				}
			}
		})
	}
}
