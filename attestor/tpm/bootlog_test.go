package tpm

import (
	"encoding/binary"
	"strings"
	"testing"
	"unicode/utf16"

	"github.com/google/go-eventlog/tcg"
)

// Event types as the log encodes them.
const (
	evIPL          = uint32(tcg.Ipl)
	evEventTag     = uint32(tcg.EventTag)
	evBootApp      = uint32(tcg.EFIBootServicesApplication)
	evBootDriver   = uint32(tcg.EFIBootServicesDriver)
	evPostCode     = uint32(tcg.PostCode)
	evVariableConf = uint32(tcg.EFIVariableDriverConfig)
)

// goldenUnder returns a function that files first-round v2 evidence of the
// boot rawLog records, quoted by the soft TPM (which quotes the PCRs the
// log's own events produce: a genuine TPM of a machine that made exactly
// these extensions), under the golden policy of softLog, and returns the
// verifier's decision.
func goldenUnder(t *testing.T) func(t *testing.T, rawLog []byte) error {
	t.Helper()
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
	p, st, err := GoldenPolicy(realEventLog(t, softLog), GoldenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	doc := p.YAML(st)
	return func(t *testing.T, rawLog []byte) error {
		t.Helper()
		e := newEngine(v, nil)
		e.policy = doc
		key := newKey(t)
		csrDER, _ := csrFor(t, key, testNode, testProviderID)
		_, err := e.verify(t, e.file(t, "csr-1", csrDER, evidenceOf(t, VersionV2, soft.quoteBoot(t, key, rawLog, "sha256", softIndices), nil), nil))
		return err
	}
}

// TestNodeLogEditsDoNotPassGoldenPolicy: a node that booted what its
// Cluster's golden policy refuses, quoted by a genuine TPM, is denied,
// and stays denied whatever it writes in the log where no digest covers
// it: labels, event types, events appended after boot.
func TestNodeLogEditsDoNotPassGoldenPolicy(t *testing.T) {
	verify := goldenUnder(t)
	golden := splitLog(t, realEventLog(t, softLog))
	if err := verify(t, golden.bytes()); err != nil {
		t.Fatalf("the golden boot is denied: %v", err)
	}
	kernelFile := []byte("a kernel the policy does not allow")
	pcr9 := golden.of(9, 0)
	allowedKernel := golden.events[pcr9[0]]

	for _, c := range []struct {
		name   string
		reason string
		// boot is the refused boot, as its TPM measured it.
		boot func(l *agileLog)
		// edit is what the node changes in the log before sending it,
		// and extends where the edit needs it to replay.
		edit func(t *testing.T, l *agileLog)
	}{{
		// The node booted another kernel, then extended PCR 9 with the
		// allowed kernel's digest and logged it under a name that matches
		// any path ("grub_linuxefi Kernel").
		name:   "allowed kernel extended into PCR 9 after boot",
		reason: ReasonKernelNotAllowed,
		boot:   func(l *agileLog) { l.events[l.of(9, 0)[0]].measure(kernelFile) },
		edit: func(t *testing.T, l *agileLog) {
			e := allowedKernel
			e.data = []byte("grub_linuxefi Kernel\x00")
			l.events = append(l.events, e)
		},
	}, {
		// GRUB loaded the refused kernel with linux and the allowed
		// kernel's file with initrd; the node swaps the two file labels.
		name:   "refused kernel with the allowed one as initrd, labels swapped",
		reason: ReasonKernelNotAllowed,
		boot: func(l *agileLog) {
			k, i := l.of(9, 0)[0], l.of(9, 0)[1]
			l.events[i].digests = allowedKernel.digests
			l.events[k].measure(kernelFile)
		},
		edit: func(t *testing.T, l *agileLog) {
			k, i := l.of(9, 0)[0], l.of(9, 0)[1]
			l.events[k].data, l.events[i].data = l.events[i].data, l.events[k].data
		},
	}, {
		// The firmware started a boot loader the policy refuses; the
		// node types its PCR 4 event a driver rather than an application.
		name:   "refused boot loader retyped as a driver",
		reason: ReasonBootLoaderNotAllowed,
		boot: func(l *agileLog) {
			l.events[l.of(4, evBootApp)[1]].measure([]byte("a boot loader the policy does not allow"))
		},
		edit: func(t *testing.T, l *agileLog) {
			l.events[l.of(4, evBootApp)[1]].typ = evBootDriver
		},
	}, {
		// The node hides GRUB's kernel command line as an event tag
		// (go-eventlog skips those) and appends one of its own after a
		// runtime extension of PCR 8 and 9.
		name:   "kernel command line retyped as an event tag",
		reason: ReasonKernelNotAllowed,
		boot:   func(l *agileLog) { l.events[l.of(9, 0)[0]].measure(kernelFile) },
		edit: func(t *testing.T, l *agileLog) {
			for _, i := range l.of(8, 0) {
				if strings.HasPrefix(string(l.events[i].data), "grub_kernel_cmdline ") {
					l.events[i].typ = evEventTag
				}
			}
			line := "grub_kernel_cmdline (hd0,gpt2)/boot/vmlinuz ro\x00"
			cmd := agileEvent{pcr: 8, typ: evIPL, algs: allowedKernel.algs, digests: make([][]byte, len(allowedKernel.algs)), data: []byte(line)}
			cmd.measure([]byte(strings.TrimSuffix(strings.TrimPrefix(line, "grub_kernel_cmdline "), "\x00")))
			k := allowedKernel
			k.data = []byte("(hd0,gpt2)/boot/vmlinuz\x00")
			l.events = append(l.events, cmd, k)
		},
	}, {
		// An event type with no place in PCR 4 is refused, not skipped.
		name:   "refused boot loader retyped as a POST code",
		reason: ReasonBootLoaderNotAllowed,
		boot: func(l *agileLog) {
			l.events[l.of(4, evBootApp)[1]].measure([]byte("a boot loader the policy does not allow"))
		},
		edit: func(t *testing.T, l *agileLog) {
			l.events[l.of(4, evBootApp)[1]].typ = evPostCode
		},
	}} {
		t.Run(c.name, func(t *testing.T) {
			l := splitLog(t, realEventLog(t, softLog))
			c.boot(l)
			if err := verify(t, l.bytes()); err == nil {
				t.Fatal("the refused boot, sent unedited, is not denied")
			} else if !hasReason(err, c.reason) {
				t.Fatalf("the refused boot, sent unedited: %v; want %s", err, c.reason)
			}
			c.edit(t, l)
			err := verify(t, l.bytes())
			if err == nil {
				t.Fatalf("the refused boot, its log edited, passes the golden policy")
			}
			if !hasReason(err, c.reason) {
				t.Errorf("the edited log: %v; want %s", err, c.reason)
			}
			t.Logf("%v", err)
		})
	}
}

// TestKernelFromCoveredData: the kernel, its command line and its digest
// come from GRUB's covered strings (PCR 8) and from positions in PCR 9,
// never from file names; a second kernel load makes it ambiguous.
func TestKernelFromCoveredData(t *testing.T) {
	raw := realEventLog(t, softLog)
	want := bootOf(t, softLog)
	l := splitLog(t, raw)
	for _, i := range l.of(9, 0) {
		l.events[i].data = []byte("(hd0,gpt2)/boot/vmlinuz-4.18.0-240.22.1.el8_3.x86_64\x00")
	}
	edited := l.bytes()
	st, err := ReplayEventLog(edited, bootPCRs(t, edited, "sha256", softIndices))
	if err != nil {
		t.Fatal(err)
	}
	if st.KernelDigest != want.KernelDigest || st.KernelPath != want.KernelPath || st.KernelCommandLine != want.KernelCommandLine {
		t.Errorf("with every file named as the kernel: kernel %s %q %q, want %s %q %q", st.KernelDigest, st.KernelPath, st.KernelCommandLine, want.KernelDigest, want.KernelPath, want.KernelCommandLine)
	}

	// A kernel load appended to PCR 8 after boot.
	l = splitLog(t, raw)
	var cmds []agileEvent
	for _, i := range l.of(8, 0) {
		d := string(l.events[i].data)
		if strings.HasPrefix(d, "grub_cmd linux ") || strings.HasPrefix(d, "grub_kernel_cmdline ") {
			cmds = append(cmds, l.events[i])
		}
	}
	if len(cmds) != 2 {
		t.Fatalf("found %d of GRUB's kernel load strings, want 2", len(cmds))
	}
	l.events = append(l.events, cmds...)
	edited = l.bytes()
	st, err = ReplayEventLog(edited, bootPCRs(t, edited, "sha256", softIndices))
	if err != nil {
		t.Fatal(err)
	}
	if st.KernelDigest != "" || !strings.Contains(strings.Join(st.Problems, "\n"), "two kernel loads") {
		t.Errorf("with a second kernel load: kernel %q, problems %q; want none, and the two loads named", st.KernelDigest, st.Problems)
	}
}

// hasReason reports whether err is, or joins, a denial with reason.
func hasReason(err error, reason string) bool {
	for _, r := range denials(err) {
		if r == reason {
			return true
		}
	}
	return false
}

// badSignatureListLog is a log of one PCR 7 event: a db of one list of
// X.509 entries whose SignatureSize (below 16) makes go-eventlog's parser
// allocate SignatureSize-16 bytes, a uint32 wrapped to 4 GiB, twice.
func badSignatureListLog(t testing.TB) []byte {
	t.Helper()
	genuine := splitLog(t, realEventLog(t, softLog))
	list := append([]byte(nil), efiCertX509...)
	list = binary.LittleEndian.AppendUint32(list, 28+16) // SignatureListSize: one entry
	list = binary.LittleEndian.AppendUint32(list, 0)     // SignatureHeaderSize
	list = binary.LittleEndian.AppendUint32(list, 0)     // SignatureSize
	list = append(list, make([]byte, 16)...)
	name := utf16.Encode([]rune("db"))
	data := make([]byte, 16) // EFI_IMAGE_SECURITY_DATABASE_GUID, not read
	data = binary.LittleEndian.AppendUint64(data, uint64(len(name)))
	data = binary.LittleEndian.AppendUint64(data, uint64(len(list)))
	for _, c := range name {
		data = binary.LittleEndian.AppendUint16(data, c)
	}
	data = append(data, list...)
	e := agileEvent{pcr: 7, typ: evVariableConf, algs: genuine.events[0].algs, digests: make([][]byte, len(genuine.events[0].algs)), data: data}
	e.measure(data)
	l := &agileLog{head: genuine.head, sizes: genuine.sizes, events: []agileEvent{e}}
	return l.bytes()
}
