package tpm

import (
	"bytes"
	"crypto"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/google/go-eventlog/extract"
	pb "github.com/google/go-eventlog/proto/state"
	"github.com/google/go-eventlog/register"
	"github.com/google/go-eventlog/tcg"
	"github.com/google/go-eventlog/wellknown"
)

// BootState is what a measured-boot event log, replayed against PCR values
// a TPM quoted, proves about how the machine booted: only events whose
// digests reproduce the quoted PCRs count. Digests are lower-case hex in
// the replayed bank. A field the log does not let the verifier derive is
// empty and a Problems entry says why.
type BootState struct {
	// Bank is the PCR bank the log was replayed against.
	Bank string `json:"bank"`
	// SecureBoot is whether the firmware measured the SecureBoot variable
	// as enabled (PCR 7).
	SecureBoot bool `json:"secureBoot"`
	// SecureBootKnown is false when PCR 7 could not be read from the log.
	SecureBootKnown bool `json:"secureBootKnown"`
	// PK, KEK, DB and DBX are the Secure Boot databases the firmware
	// measured (PCR 7).
	PK  SignatureDB `json:"pk"`
	KEK SignatureDB `json:"kek"`
	DB  SignatureDB `json:"db"`
	DBX SignatureDB `json:"dbx"`
	// Authorities are the db certificates that verified the images the
	// firmware loaded after the separator (shim, GRUB, the kernel), and
	// shim's own MOK authorities, as the firmware measured them (PCR 7).
	Authorities []Certificate `json:"authorities,omitempty"`
	// BootApplications are the digests of every image measured in PCR 4,
	// in PCR 4's order, whatever type its event claims (every event whose
	// digest is not the digest of its own data): shim, GRUB, and the
	// kernel where the boot loader starts it through the firmware.
	BootApplications []string `json:"bootApplications,omitempty"`
	// KernelPath is the kernel the boot loader loaded, as its one covered
	// linux command named it (PCR 8), and KernelDigest the digest of that
	// file as GRUB measured it, found by its position in PCR 9 (the file
	// followed by as many as the initrd commands name), never by a file
	// name: the digest sha256sum prints for the kernel image.
	KernelPath   string `json:"kernelPath,omitempty"`
	KernelDigest string `json:"kernelDigest,omitempty"`
	// KernelCommandLine is the command line the boot loader gave the
	// kernel (PCR 8), without the kernel path.
	KernelCommandLine string `json:"kernelCommandLine,omitempty"`
	// Firmware is the firmware version the firmware measured first (PCR
	// 0), where it measured one: "gce-<n>" on Google Compute Engine, else
	// the S-CRTM version string (hex when not printable).
	Firmware string `json:"firmware,omitempty"`
	// Problems lists what could not be derived, and why.
	Problems []string `json:"problems,omitempty"`
}

// SignatureDB is a Secure Boot signature database (db, dbx, KEK, PK).
type SignatureDB struct {
	// Present is whether the firmware measured the variable.
	Present bool `json:"present"`
	// Digest is the digest of the variable as measured (its event digest
	// in the replayed bank): equal databases have equal digests.
	Digest string `json:"digest,omitempty"`
	// Certificates are its X.509 entries.
	Certificates []Certificate `json:"certificates,omitempty"`
	// Hashes are its hash entries (lower-case hex): for dbx, the revoked
	// images.
	Hashes []string `json:"hashes,omitempty"`
}

// Entries is the number of entries of the database.
func (d SignatureDB) Entries() int { return len(d.Certificates) + len(d.Hashes) }

// Certificate names a certificate of a Secure Boot database.
type Certificate struct {
	// Subject is the certificate's subject (or its well-known name).
	Subject string `json:"subject"`
	// SHA256 is the lower-case hex SHA-256 of its DER.
	SHA256 string `json:"sha256"`
}

// replayBanks are the banks an event log is replayed against, strongest
// first (go-eventlog does not replay SHA-512 logs).
var replayBanks = []struct {
	name string
	alg  register.HashAlg
	tcg  pb.HashAlgo
	hash crypto.Hash
}{
	{"sha384", register.HashSHA384, pb.HashAlgo_SHA384, crypto.SHA384},
	{"sha256", register.HashSHA256, pb.HashAlgo_SHA256, crypto.SHA256},
	{"sha1", register.HashSHA1, pb.HashAlgo_SHA1, crypto.SHA1},
}

// firmwarePCRs is the number of PCRs, from 0, that only the firmware and the
// boot loader extend, each extension logged in the firmware's event log.
const firmwarePCRs = 10

// errEventLogMismatch marks a log that does not reproduce the quoted PCRs.
var errEventLogMismatch = errors.New("the event log does not replay")

// errNoCommonBank marks a log that has no digests of a bank the quote
// covers (a SHA-1-only log and a SHA-256 quote, or a SHA-512 quote): it
// cannot be replayed, which is not a contradiction of the quote.
var errNoCommonBank = errors.New("the event log cannot be replayed against the quoted banks")

// ReplayEventLog parses a TCG PC Client event log (binary_bios_measurements),
// replays it against pcrs, which must be values a TPM quoted, and derives
// the boot state from the events that replay. It replays the strongest bank
// both the log and pcrs have. Every quoted PCR of that bank must be
// reproduced by its events, and a quoted PCR 0-9 (the firmware's and the
// boot loader's, all of which the log records) with no event in the log
// must hold its reset value (zero): a log that drops all of such a PCR's
// events does not replay. PCRs the running system extends without a
// firmware log entry (IMA's 10, systemd's 11-15) are not judged. An error wrapping errEventLogMismatch means the log does
// not belong to these PCRs, one wrapping errNoCommonBank that it has no
// digests of the quoted banks; the state's Problems list what the replayed
// events do not let the verifier derive.
func ReplayEventLog(rawLog []byte, pcrs []PCRValue) (st *BootState, err error) {
	defer func() {
		// go-eventlog panics on some malformed input (an unknown event
		// type); the log comes from the node.
		if r := recover(); r != nil {
			st, err = nil, fmt.Errorf("%w: malformed event log: %v", errEventLogMismatch, r)
		}
	}()
	// Firmware log areas are sometimes 0xFF-filled after the last event;
	// whatever follows the filler is not read, and an extension it hid
	// would not replay.
	el, err := tcg.ParseEventLog(rawLog, tcg.ParseOpts{AllowPadding: true})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errEventLogMismatch, err)
	}
	var bank *register.PCRBank
	var bankName string
	var hash crypto.Hash
	for _, b := range replayBanks {
		if !slices.Contains(el.Algs, b.alg) {
			continue
		}
		pb := register.PCRBank{TCGHashAlgo: b.tcg}
		for _, p := range pcrs {
			if p.Bank == b.name {
				pb.PCRs = append(pb.PCRs, register.PCR{Index: p.Index, Digest: p.Digest, DigestAlg: b.hash})
			}
		}
		if len(pb.PCRs) > 0 {
			bank, bankName, hash = &pb, b.name, b.hash
			break
		}
	}
	if bank == nil {
		return nil, fmt.Errorf("%w: the log has %v digests and the quote covers none of those banks (set the node's pcrBank to one of them)", errNoCommonBank,
			el.Algs)
	}
	events, err := el.Verify(bank.MRs())
	if err != nil {
		return nil, fmt.Errorf("%w against the quoted %s PCRs: %w", errEventLogMismatch, bankName, err)
	}
	measured := map[int]bool{}
	for _, e := range events {
		measured[e.Index] = true
	}
	for _, p := range bank.PCRs {
		if p.Index < firmwarePCRs && !measured[p.Index] && !bytes.Equal(p.Digest, make([]byte, hash.Size())) {
			return nil, fmt.Errorf("%w: %s PCR %d is extended but the log has no event for it", errEventLogMismatch, bankName, p.Index)
		}
	}
	return bootState(events, hash, bankName), nil
}

// bootState derives the boot state from replayed events, from what their
// digests cover (bootlog.go).
func bootState(events []tcg.Event, hash crypto.Hash, bank string) *BootState {
	st := &BootState{Bank: bank}
	problem := func(what string, err error) {
		st.Problems = append(st.Problems, fmt.Sprintf("%s: %v", what, err))
	}
	guard := func(what string, f func() error) {
		defer func() {
			if r := recover(); r != nil {
				problem(what, fmt.Errorf("malformed events: %v", r))
			}
		}()
		if err := f(); err != nil {
			problem(what, err)
		}
	}
	opts := extract.Opts{Loader: extract.GRUB, AllowEmptySBVar: true, AllowEFIAppBeforeCallingEvent: true}

	guard("secure boot (PCR 7)", func() error {
		// go-eventlog's signature list parser trusts the sizes the node
		// wrote: they are checked first.
		if err := checkSignatureLists(events); err != nil {
			return err
		}
		sb, err := extract.ParseSecurebootState(events, extract.TPMRegisterConfig, opts)
		if err != nil {
			return err
		}
		st.SecureBoot, st.SecureBootKnown = sb.Enabled, true
		st.PK = signatureDB(sb.PlatformKeys, sb.PlatformKeyHashes)
		st.KEK = signatureDB(sb.ExchangeKeys, sb.ExchangeKeyHashes)
		st.DB = signatureDB(sb.PermittedKeys, sb.PermittedHashes)
		st.DBX = signatureDB(sb.ForbiddenKeys, sb.ForbiddenHashes)
		for _, c := range sb.PostSeparatorAuthority {
			st.Authorities = append(st.Authorities, certificate(&c))
		}
		variableDigests(events, st)
		return nil
	})
	guard("boot applications (PCR 4)", func() error {
		apps, err := bootApplications(events, hash)
		st.BootApplications = apps
		return err
	})
	guard("firmware version (PCR 0)", func() error {
		p, err := extract.PlatformState(hash, events)
		if err != nil {
			return err
		}
		switch fw := p.GetFirmware().(type) {
		case *pb.PlatformState_GceVersion:
			st.Firmware = fmt.Sprintf("gce-%d", fw.GceVersion)
		case *pb.PlatformState_ScrtmVersionId:
			st.Firmware = printable(fw.ScrtmVersionId)
		}
		return nil
	})
	guard("kernel (PCRs 8 and 9)", func() error {
		path, args, digest, err := grubKernel(events, hash)
		if err != nil {
			return err
		}
		st.KernelPath, st.KernelCommandLine, st.KernelDigest = path, args, digest
		return nil
	})
	return st
}

// variableDigests records the measured digests of the Secure Boot
// variables (the digest of their EFI_VARIABLE_DATA in the replayed bank).
func variableDigests(events []tcg.Event, st *BootState) {
	for _, e := range events {
		if e.Index != 7 || e.Type != tcg.EFIVariableDriverConfig {
			continue
		}
		name, _, err := efiVariable(e.Data)
		if err != nil {
			continue
		}
		var db *SignatureDB
		switch name {
		case "PK":
			db = &st.PK
		case "KEK":
			db = &st.KEK
		case "db":
			db = &st.DB
		case "dbx":
			db = &st.DBX
		default:
			continue
		}
		db.Present = true
		db.Digest = hex.EncodeToString(e.Digest)
	}
}

func signatureDB(certs []x509.Certificate, hashes [][]byte) SignatureDB {
	db := SignatureDB{}
	for i := range certs {
		db.Certificates = append(db.Certificates, certificate(&certs[i]))
	}
	for _, h := range hashes {
		db.Hashes = append(db.Hashes, hex.EncodeToString(h))
	}
	return db
}

func certificate(c *x509.Certificate) Certificate {
	sum := sha256.Sum256(c.Raw)
	subject := c.Subject.String()
	for _, wk := range []struct {
		der  []byte
		name string
	}{
		{wellknown.MicrosoftUEFICA2011Cert, "Microsoft Corporation UEFI CA 2011"},
		{wellknown.WindowsProductionPCA2011Cert, "Microsoft Windows Production PCA 2011"},
		{wellknown.MicrosoftKEKCA2011Cert, "Microsoft Corporation KEK CA 2011"},
		{wellknown.GceDefaultPKCert, "GCE Default PK"},
	} {
		if bytes.Equal(c.Raw, wk.der) {
			subject = wk.name
		}
	}
	return Certificate{Subject: subject, SHA256: hex.EncodeToString(sum[:])}
}

// printable returns s if it is printable UTF-8 (UTF-16 firmware strings
// are decoded), else its hex.
func printable(b []byte) string {
	if len(b) >= 2 && len(b)%2 == 0 && b[1] == 0 {
		var r []rune
		for i := 0; i+1 < len(b); i += 2 {
			c := rune(b[i]) | rune(b[i+1])<<8
			if c == 0 {
				break
			}
			r = append(r, c)
		}
		if s := string(r); isPrintable(s) {
			return s
		}
	}
	s := strings.TrimRight(string(b), "\x00")
	if utf8.ValidString(s) && isPrintable(s) {
		return s
	}
	return hex.EncodeToString(b)
}

func isPrintable(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if r < 0x20 || r == 0x7f || r == utf8.RuneError {
			return false
		}
	}
	return true
}

// pcrBankHashSize is the digest size of a PCR bank by its wire name.
func pcrBankHashSize(bank string) int {
	alg, ok := pcrBanks[bank]
	if !ok {
		return 0
	}
	h, _ := bankHash(alg)
	return h.Size()
}
