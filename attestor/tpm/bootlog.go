package tpm

import (
	"bytes"
	"crypto"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"unicode/utf16"

	"github.com/google/go-eventlog/tcg"
)

// What the verifier reads of a replayed log, it reads from what the quoted
// digests cover: event labels (GRUB's file names), event types and the
// order of events across PCRs are the node's to write, and the replay
// protects only the order of each PCR's own events. The functions here
// derive boot applications and the kernel from digests and from positions
// within one PCR, and check what the node wrote before go-eventlog parses
// it.

// Bounds of a Secure Boot variable event (EFI_VARIABLE_DATA).
const (
	// efiVariableHeader is VariableName (a GUID), UnicodeNameLength and
	// VariableDataLength (each a UINT64).
	efiVariableHeader = 16 + 8 + 8
	// maxVariableName is the longest variable name read, in UTF-16 units.
	maxVariableName = 64
	// efiSignatureListHeader is SignatureType (a GUID), SignatureListSize,
	// SignatureHeaderSize and SignatureSize (each a UINT32).
	efiSignatureListHeader = 16 + 4 + 4 + 4
	// efiGUIDSize is the size of an EFI_GUID, the SignatureOwner that
	// starts every EFI_SIGNATURE_DATA.
	efiGUIDSize = 16
)

// efiCertSHA256 and efiCertX509 are the signature types of db and dbx
// entries go-eventlog reads (EFI_CERT_SHA256_GUID, EFI_CERT_X509_GUID), as
// they are laid out in memory.
var (
	efiCertSHA256 = []byte{0x26, 0x16, 0xc4, 0xc1, 0x4c, 0x50, 0x92, 0x40, 0xac, 0xa9, 0x41, 0xf9, 0x36, 0x93, 0x43, 0x28}
	efiCertX509   = []byte{0xa1, 0x59, 0xc0, 0xa5, 0xe4, 0x94, 0xa7, 0x4a, 0x87, 0xb5, 0xab, 0x15, 0x5c, 0x2b, 0xf0, 0x72}
)

// checkSignatureLists parses, strictly and within the event's own data,
// the EFI_SIGNATURE_LIST headers of every PCR 7 Secure Boot database event
// (PK, KEK, db, dbx) that go-eventlog would parse, before it does: its
// parser trusts SignatureSize (a SignatureSize below 16 wraps a uint32 and
// allocates gigabytes), ignores SignatureHeaderSize and reads past a list's
// end when its size is not a whole number of signatures.
func checkSignatureLists(events []tcg.Event) error {
	for _, e := range events {
		if e.Index != 7 || e.Type != tcg.EFIVariableDriverConfig {
			continue
		}
		name, data, err := efiVariable(e.Data)
		if err != nil {
			return fmt.Errorf("PCR 7 event %d: %w", e.Num(), err)
		}
		switch name {
		case "PK", "KEK", "db", "dbx":
		default:
			continue
		}
		if err := signatureLists(data); err != nil {
			return fmt.Errorf("PCR 7 event %d, variable %s: %w", e.Num(), name, err)
		}
	}
	return nil
}

// efiVariable parses an EFI_VARIABLE_DATA whose sizes must add up to
// exactly the event's data.
func efiVariable(b []byte) (name string, data []byte, err error) {
	if len(b) < efiVariableHeader {
		return "", nil, fmt.Errorf("the variable is %d bytes, shorter than its %d-byte header", len(b), efiVariableHeader)
	}
	nameLen := binary.LittleEndian.Uint64(b[16:])
	dataLen := binary.LittleEndian.Uint64(b[24:])
	rest := uint64(len(b) - efiVariableHeader)
	if nameLen > maxVariableName || 2*nameLen > rest || dataLen != rest-2*nameLen {
		return "", nil, fmt.Errorf("the variable declares a %d-character name and %d data bytes, which do not add up to its %d bytes", nameLen, dataLen, len(b))
	}
	u := make([]uint16, nameLen)
	for i := range u {
		u[i] = binary.LittleEndian.Uint16(b[efiVariableHeader+2*i:])
	}
	return string(utf16.Decode(u)), b[efiVariableHeader+2*nameLen:], nil
}

// signatureLists checks a Secure Boot database: a sequence of
// EFI_SIGNATURE_LISTs, each within the data, each holding a whole number
// of signatures of at least an owner GUID each, in the layout go-eventlog
// reads (no signature header; SHA-256 entries of 32 bytes).
func signatureLists(b []byte) error {
	for off, n := 0, 1; off < len(b); n++ {
		if len(b)-off < efiSignatureListHeader {
			return fmt.Errorf("signature list %d: %d bytes left, shorter than a list header (%d)", n, len(b)-off, efiSignatureListHeader)
		}
		h := b[off:]
		typ := h[:16]
		listSize := uint64(binary.LittleEndian.Uint32(h[16:]))
		headerSize := uint64(binary.LittleEndian.Uint32(h[20:]))
		sigSize := uint64(binary.LittleEndian.Uint32(h[24:]))
		switch {
		case sigSize < efiGUIDSize:
			return fmt.Errorf("signature list %d: SignatureSize %d is below %d (the owner GUID every signature starts with)", n, sigSize, efiGUIDSize)
		case listSize < efiSignatureListHeader+headerSize:
			return fmt.Errorf("signature list %d: SignatureListSize %d is below its header (%d + SignatureHeaderSize %d)", n, listSize, efiSignatureListHeader,
				headerSize)
		case listSize > uint64(len(b)-off):
			return fmt.Errorf("signature list %d: SignatureListSize %d runs past the variable's %d remaining bytes", n, listSize, len(b)-off)
		case (listSize-efiSignatureListHeader-headerSize)%sigSize != 0:
			return fmt.Errorf("signature list %d: %d bytes of signatures are not a whole number of %d-byte signatures", n, listSize-efiSignatureListHeader-headerSize,
				sigSize)
		case headerSize != 0:
			return fmt.Errorf("signature list %d: SignatureHeaderSize is %d; the lists of X.509 certificates and SHA-256 hashes have none", n, headerSize)
		case bytes.Equal(typ, efiCertSHA256) && sigSize != efiGUIDSize+32:
			return fmt.Errorf("signature list %d: SHA-256 entries of %d bytes, not %d", n, sigSize, efiGUIDSize+32)
		case bytes.Equal(typ, efiCertX509) && sigSize == efiGUIDSize:
			return fmt.Errorf("signature list %d: X.509 entries hold no certificate", n)
		}
		off += int(listSize)
	}
	return nil
}

// PCR 4 events. An event whose digest is the digest of its own data (a
// separator, an EFI action string) measures that data; any other PCR 4
// event measures an image, whatever type it claims, and is a boot
// application.
var pcr4Types = map[tcg.EventType]bool{
	tcg.Separator:                  true,
	tcg.Action:                     true,
	tcg.EFIAction:                  true,
	tcg.EventTag:                   true,
	tcg.Ipl:                        true,
	tcg.EFIBootServicesApplication: true,
	tcg.EFIBootServicesDriver:      true,
	tcg.EFIRuntimeServicesDriver:   true,
}

// bootApplications lists the digests (hex) of every image measured in PCR
// 4, in PCR 4's order: every event whose digest does not cover its own
// data. An event type that has no place in PCR 4 is refused.
func bootApplications(events []tcg.Event, hash crypto.Hash) ([]string, error) {
	var apps []string
	seen := false
	for _, e := range events {
		if e.Index != 4 {
			continue
		}
		seen = true
		if !pcr4Types[e.Type] {
			return nil, fmt.Errorf("PCR 4 event %d has type %s, which has no place in PCR 4", e.Num(), eventTypeName(e.Type))
		}
		if !coversData(e, hash) {
			apps = append(apps, hex.EncodeToString(e.Digest))
		}
	}
	if !seen {
		return nil, errors.New("the log has no PCR 4 event")
	}
	return apps, nil
}

// coversData reports whether e's digest is the digest of its data.
func coversData(e tcg.Event, hash crypto.Hash) bool {
	h := hash.New()
	h.Write(e.Data)
	return bytes.Equal(h.Sum(nil), e.Digest)
}

func eventTypeName(t tcg.EventType) string {
	if n, ok := tcg.EventTypeNames[t]; ok {
		return fmt.Sprintf("%s (0x%08x)", n, uint32(t))
	}
	return fmt.Sprintf("0x%08x", uint32(t))
}

// grubPrefixes are the labels GRUB writes before a PCR 8 string (current
// and Fedora's older spelling). The digest covers only what follows, so
// the label says nothing: a command and a kernel command line are told
// apart by their covered text alone.
var grubPrefixes = []string{"grub_cmd: ", "kernel_cmdline: ", "module_cmdline: ", "grub_kernel_cmdline ", "grub_cmd "}

// grubKernel derives the kernel GRUB loaded from what the digests cover.
//
// PCR 8 holds GRUB's strings, each covered by its digest: every command it
// ran, and after a kernel loads, that kernel's command line. A kernel load
// is a covered "linux PATH ARGS" (linuxefi, linux16) immediately followed,
// in PCR 8's order, by the covered "PATH ARGS" (GRUB quotes arguments
// that hold spaces in the second). Exactly one is required:
// an honest boot loads one kernel, and a pair appended after boot would be
// the second. The initrd commands after it name the initrd files.
//
// PCR 9 holds the digests of the files GRUB read, in the order it read
// them; their names are labels. The linux command reads the kernel and the
// initrd commands then read the initrds, so the kernel is the file
// followed, in PCR 9's order, by exactly as many files as the initrd
// commands name. The Linux EFI stub may measure after GRUB (its load
// options and the initrd again); trailing events are taken for those only
// where their digests are those.
func grubKernel(events []tcg.Event, hash crypto.Hash) (path, args, digest string, err error) {
	var cmds []string
	var files []tcg.Event
	for _, e := range events {
		switch e.Index {
		case 8:
			if e.Type != tcg.Ipl {
				return "", "", "", fmt.Errorf("PCR 8 event %d has type %s; GRUB measures its strings as EV_IPL", e.Num(), eventTypeName(e.Type))
			}
			s, ok := grubString(e, hash)
			if !ok {
				return "", "", "", fmt.Errorf("PCR 8 event %d is not a GRUB string its digest covers", e.Num())
			}
			cmds = append(cmds, s)
		case 9:
			if e.Type != tcg.Ipl && e.Type != tcg.EventTag {
				return "", "", "", fmt.Errorf("PCR 9 event %d has type %s, which has no place in PCR 9", e.Num(), eventTypeName(e.Type))
			}
			files = append(files, e)
		}
	}
	if len(cmds) == 0 {
		return "", "", "", errors.New("GRUB measured no command (PCR 8)")
	}
	load := -1
	for i := 0; i+1 < len(cmds); i++ {
		name, rest, _ := strings.Cut(cmds[i], " ")
		if (name == "linux" || name == "linuxefi" || name == "linux16") && rest != "" && unquoted(cmds[i+1]) == unquoted(rest) {
			if load >= 0 {
				return "", "", "", fmt.Errorf("GRUB measured two kernel loads (%q and %q); a boot loads one kernel", cmds[load+1], rest)
			}
			load = i
		}
	}
	if load < 0 {
		return "", "", "", errors.New("GRUB measured no kernel load (a linux command followed by its kernel command line, PCR 8)")
	}
	line := cmds[load+1]
	path, args, _ = strings.Cut(line, " ")
	initrds := 0
	for _, c := range cmds[load+2:] {
		name, rest, _ := strings.Cut(c, " ")
		if name == "initrd" || name == "initrdefi" || name == "initrd16" {
			for _, f := range strings.Fields(rest) {
				if !strings.HasPrefix(f, "--") {
					initrds++
				}
			}
		}
	}
	files = withoutStubTail(files, initrds, loadOptionsDigest(hash, line))
	k := len(files) - 1 - initrds
	if k < 0 {
		return "", "", "", fmt.Errorf("GRUB measured %d files (PCR 9); a kernel and %d initrds need %d", len(files), initrds, initrds+1)
	}
	return path, strings.TrimSpace(args), hex.EncodeToString(files[k].Digest), nil
}

// withoutStubTail drops the measurements the Linux EFI stub makes after
// GRUB, where the last events of PCR 9 are that: the digest of its load
// options (loadOptions) and the initrd again (the digest of one of the
// initrds files before them). Only digests identify them.
func withoutStubTail(files []tcg.Event, initrds int, loadOptions []byte) []tcg.Event {
	for s := 2; s > 0; s-- {
		n := len(files) - s
		if n-initrds < 1 {
			continue
		}
		stub := true
		for _, e := range files[n:] {
			if !bytes.Equal(e.Digest, loadOptions) && !slices.ContainsFunc(files[n-initrds:n], func(i tcg.Event) bool { return bytes.Equal(i.Digest, e.Digest) }) {
				stub = false
			}
		}
		if stub {
			return files[:n]
		}
	}
	return files
}

// loadOptionsDigest is the digest the Linux EFI stub measures of the load
// options GRUB hands the kernel: "BOOT_IMAGE=" and the kernel command
// line, in UTF-16LE.
func loadOptionsDigest(hash crypto.Hash, line string) []byte {
	h := hash.New()
	for _, c := range utf16.Encode([]rune("BOOT_IMAGE=" + line)) {
		_ = binary.Write(h, binary.LittleEndian, c)
	}
	return h.Sum(nil)
}

// unquoted is a GRUB string without double quotes: GRUB quotes, in the
// kernel command line it measures, the arguments of the linux command
// that hold spaces.
func unquoted(s string) string { return strings.ReplaceAll(s, `"`, "") }

// grubString returns the text of a GRUB PCR 8 event that its digest
// covers: the data after a GRUB label, without a trailing NUL, or with it.
func grubString(e tcg.Event, hash crypto.Hash) (string, bool) {
	for _, p := range grubPrefixes {
		if !bytes.HasPrefix(e.Data, []byte(p)) {
			continue
		}
		s := e.Data[len(p):]
		for _, c := range [][]byte{bytes.TrimSuffix(s, []byte{0}), s} {
			h := hash.New()
			h.Write(c)
			if bytes.Equal(h.Sum(nil), e.Digest) {
				return string(bytes.TrimSuffix(s, []byte{0})), true
			}
		}
		return "", false
	}
	return "", false
}
