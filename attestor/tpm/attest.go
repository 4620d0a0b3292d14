package tpm

import (
	"context"
	"crypto"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math/bits"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Opener opens the TPM for one attestation; the Attestor closes it when
// done. See the device package (and tpmsim in tests).
type Opener func() (transport.TPMCloser, error)

// Defaults of AttestorConfig.
const (
	// DefaultPCRBank is the PCR bank quoted.
	DefaultPCRBank = "sha256"
	// DefaultEventLogPath is where Linux exposes the measured-boot event
	// log (securityfs).
	DefaultEventLogPath = "/sys/kernel/security/tpm0/binary_bios_measurements"
)

// DefaultPCRs are the PCRs quoted: 0-7 (firmware, its configuration,
// option ROMs, boot loader, Secure Boot policy) and 8-9 (boot loader
// measurements of the kernel command line and the files it loads).
var DefaultPCRs = []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}

// AttestorConfig configures the node half. The zero value is the default.
// Its JSON form is meant for the node's configuration file.
type AttestorConfig struct {
	// EndorsementKeys lists EK kinds to try first; by default the first
	// with a certificate in the order RSA 2048, ECC P-256, ECC P-384 (and
	// the RSA EK where none has one).
	EndorsementKeys []EKKind `json:"endorsementKeys,omitempty"`
	// PCRBank is the PCR bank the quote covers: sha1, sha256, sha384 or
	// sha512. Default DefaultPCRBank.
	PCRBank string `json:"pcrBank,omitempty"`
	// PCRs are the PCR numbers (0-23) the quote covers. Default
	// DefaultPCRs.
	PCRs []int `json:"pcrs,omitempty"`
	// EventLogPath is the measured-boot event log attached to the evidence.
	// Default DefaultEventLogPath; a missing file means the host has no log
	// and none is attached.
	EventLogPath string `json:"eventLogPath,omitempty"`
	// NoEventLog attaches no event log even where the host has one.
	NoEventLog bool `json:"noEventLog,omitempty"`
}

// Attestor is the node half of the TPM attestor. The EK and the AK are
// primary keys re-created from fixed templates (the same keys every boot),
// and every transient handle it creates is flushed before it returns. The
// one state it keeps is the saved contexts of the last attestation's EK and
// AK (TPM2_ContextSave: blobs the TPM encrypts and integrity-protects), so
// that answering the challenge loads them back instead of re-creating both
// primaries (an RSA EK's is the costliest command of an issuance).
type Attestor struct {
	open     Opener
	eks      []ekSpec
	pcrs     tpm2.TPMLPCRSelection
	eventLog string // "" for none

	mu   sync.Mutex
	held *heldKeys // the last Attest's EK and AK; taken by Respond
}

// heldKeys are an attestation's EK and AK as saved contexts. A persistent
// EK (a TPM provisioned with a non-default template) is not saved: its
// handle stays valid, so ekContext is nil and ek.handle is used as is.
type heldKeys struct {
	ek, ak               key
	ekContext, akContext *tpm2.TPMSContext
}

var (
	_ attestor.Attestor  = (*Attestor)(nil)
	_ attestor.Responder = (*Attestor)(nil)
)

// EKKind names an endorsement key type.
type EKKind string

// EK kinds, in the default order of preference.
const (
	EKRSA2048 EKKind = "rsa2048"
	EKECCP256 EKKind = "ecc-p256"
	EKECCP384 EKKind = "ecc-p384"
)

// NewAttestor returns a node attestor that opens its TPM with open, with
// the default configuration except that prefer lists EK kinds to try
// first.
func NewAttestor(open Opener, prefer ...EKKind) (*Attestor, error) {
	return New(open, AttestorConfig{EndorsementKeys: prefer})
}

// New returns a node attestor that opens its TPM with open. It reports
// every problem of cfg at once.
func New(open Opener, cfg AttestorConfig) (*Attestor, error) {
	a := &Attestor{open: open}
	var errs []error
	for _, k := range cfg.EndorsementKeys {
		i := slices.IndexFunc(ekSpecs, func(s ekSpec) bool { return s.kind == k })
		if i < 0 {
			errs = append(errs, fmt.Errorf("unknown EK kind %q (want %s, %s or %s)", k, EKRSA2048, EKECCP256, EKECCP384))
			continue
		}
		if !slices.ContainsFunc(a.eks, func(s ekSpec) bool { return s.kind == k }) {
			a.eks = append(a.eks, ekSpecs[i])
		}
	}
	for _, s := range ekSpecs {
		if !slices.ContainsFunc(a.eks, func(x ekSpec) bool { return x.kind == s.kind }) {
			a.eks = append(a.eks, s)
		}
	}
	bank := cfg.PCRBank
	if bank == "" {
		bank = DefaultPCRBank
	}
	alg, ok := pcrBanks[bank]
	if !ok {
		errs = append(errs, fmt.Errorf("unknown PCR bank %q (want sha1, sha256, sha384 or sha512)", bank))
	}
	pcrs := cfg.PCRs
	if pcrs == nil {
		pcrs = DefaultPCRs
	}
	if len(pcrs) == 0 {
		errs = append(errs, errors.New("the PCR selection is empty"))
	}
	bitmap := make([]byte, 3)
	for _, i := range pcrs {
		if i < 0 || i > 23 {
			errs = append(errs, fmt.Errorf("PCR %d is out of range 0-23", i))
			continue
		}
		bitmap[i/8] |= 1 << (i % 8)
	}
	a.pcrs = tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{Hash: alg, PCRSelect: bitmap}}}
	if !cfg.NoEventLog {
		a.eventLog = cfg.EventLogPath
		if a.eventLog == "" {
			a.eventLog = DefaultEventLogPath
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return a, nil
}

// Versions implements attestor.Attestor: the node produces v4, and v3 or
// v2 for older signers.
func (*Attestor) Versions() []string { return []string{VersionV4, VersionV3, VersionV2} }

// EK certificate NV indices (TCG EK Credential Profile 2.x, 2.2.1.4) with
// the template the certified key is made from and the handle where
// provisioning tools conventionally persist it.
type ekSpec struct {
	kind       EKKind
	what       string
	certIndex  tpm2.TPMHandle
	persistent tpm2.TPMHandle
	template   tpm2.TPMTPublic
}

// eccP384EKTemplate is the TCG EK Credential Profile template H-3 (ECC NIST
// P-384, high range), which swtpm provisions alongside the RSA EK. Being a
// high-range template, it allows password (empty) authorization for use.
var eccP384EKTemplate = tpm2.TPMTPublic{
	Type:    tpm2.TPMAlgECC,
	NameAlg: tpm2.TPMAlgSHA384,
	ObjectAttributes: tpm2.TPMAObject{
		FixedTPM:            true,
		FixedParent:         true,
		SensitiveDataOrigin: true,
		UserWithAuth:        true,
		AdminWithPolicy:     true,
		Restricted:          true,
		Decrypt:             true,
	},
	AuthPolicy: tpm2.TPM2BDigest{Buffer: []byte{
		// PolicyB, SHA-384.
		0xB2, 0x6E, 0x7D, 0x28, 0xD1, 0x1A, 0x50, 0xBC, 0x53, 0xD8, 0x82, 0xBC,
		0xF5, 0xFD, 0x3A, 0x1A, 0x07, 0x41, 0x48, 0xBB, 0x35, 0xD3, 0xB4, 0xE4,
		0xCB, 0x1C, 0x0A, 0xD9, 0xBD, 0xE4, 0x19, 0xCA, 0xCB, 0x47, 0xBA, 0x09,
		0x69, 0x96, 0x46, 0x15, 0x0F, 0x9F, 0xC0, 0x00, 0xF3, 0xF8, 0x0E, 0x12,
	}},
	Parameters: tpm2.NewTPMUPublicParms(tpm2.TPMAlgECC, &tpm2.TPMSECCParms{
		Symmetric: tpm2.TPMTSymDefObject{
			Algorithm: tpm2.TPMAlgAES,
			KeyBits:   tpm2.NewTPMUSymKeyBits(tpm2.TPMAlgAES, tpm2.TPMKeyBits(256)),
			Mode:      tpm2.NewTPMUSymMode(tpm2.TPMAlgAES, tpm2.TPMAlgCFB),
		},
		Scheme:  tpm2.TPMTECCScheme{Scheme: tpm2.TPMAlgNull},
		CurveID: tpm2.TPMECCNistP384,
		KDF:     tpm2.TPMTKDFScheme{Scheme: tpm2.TPMAlgNull},
	}),
	Unique: tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{}),
}

// ekSpecs in order of preference: the RSA EK has the widest certificate
// coverage; a TPM with no EK certificate at all uses the RSA EK too.
var ekSpecs = []ekSpec{
	{EKRSA2048, "RSA 2048", 0x01c00002, 0x81010001, tpm2.RSAEKTemplate},
	{EKECCP256, "ECC NIST P-256", 0x01c0000a, 0x81010002, tpm2.ECCEKTemplate},
	{EKECCP384, "ECC NIST P-384", 0x01c00016, 0x81010016, eccP384EKTemplate},
}

// akTemplate is the attestation key: an ECC P-256 restricted signing key
// (ECDSA/SHA-256) created as a primary key of the endorsement hierarchy, so
// the TPM derives the same key from its endorsement seed every time and
// nothing needs to be persisted.
var akTemplate = tpm2.TPMTPublic{
	Type:    tpm2.TPMAlgECC,
	NameAlg: tpm2.TPMAlgSHA256,
	ObjectAttributes: tpm2.TPMAObject{
		FixedTPM:            true,
		FixedParent:         true,
		SensitiveDataOrigin: true,
		UserWithAuth:        true,
		NoDA:                true,
		Restricted:          true,
		SignEncrypt:         true,
	},
	Parameters: tpm2.NewTPMUPublicParms(tpm2.TPMAlgECC, &tpm2.TPMSECCParms{
		Symmetric: tpm2.TPMTSymDefObject{Algorithm: tpm2.TPMAlgNull},
		Scheme: tpm2.TPMTECCScheme{
			Scheme:  tpm2.TPMAlgECDSA,
			Details: tpm2.NewTPMUAsymScheme(tpm2.TPMAlgECDSA, &tpm2.TPMSSigSchemeECDSA{HashAlg: tpm2.TPMAlgSHA256}),
		},
		CurveID: tpm2.TPMECCNistP256,
		KDF:     tpm2.TPMTKDFScheme{Scheme: tpm2.TPMAlgNull},
	}),
	Unique: tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{}),
}

// session tracks the transient handles of one TPM conversation.
type session struct {
	t       transport.TPM
	flushes []tpm2.TPMHandle
}

func (s *session) track(h tpm2.TPMHandle) { s.flushes = append(s.flushes, h) }

// close flushes every tracked handle, newest first.
func (s *session) close() error {
	var errs []error
	for i := len(s.flushes) - 1; i >= 0; i-- {
		if _, err := (tpm2.FlushContext{FlushHandle: s.flushes[i]}).Execute(s.t); err != nil {
			errs = append(errs, fmt.Errorf("unable to flush handle 0x%08x: %w", uint32(s.flushes[i]), err))
		}
	}
	s.flushes = nil
	return errors.Join(errs...)
}

// key is a loaded object.
type key struct {
	handle tpm2.TPMHandle
	name   tpm2.TPM2BName
	pub    *tpm2.TPMTPublic
	raw    []byte // TPMT_PUBLIC as the TPM returned it
}

func (k *key) auth(s tpm2.Session) tpm2.AuthHandle {
	return tpm2.AuthHandle{Handle: k.handle, Name: k.name, Auth: s}
}

// Attest implements attestor.Attestor: a quote by the AK of the configured
// PCRs, qualified by the binding of the version (v4 and v3: the CSR key and the
// cluster CA; v2: the CSR key), with the EK annotation for the CSR.
func (a *Attestor) Attest(ctx context.Context, req *attestor.Request) (_ *attestor.Attestation, err error) {
	version, err := producedVersion(req)
	if err != nil {
		return nil, err
	}
	if err := checkRequest(req); err != nil {
		return nil, err
	}
	binding, err := req.BindingFor(clusterBound(version))
	if err != nil {
		return nil, fmt.Errorf("tpm attestor cannot produce evidence version %s: %w", version, err)
	}
	eventLog, err := a.readEventLog()
	if err != nil {
		return nil, err
	}
	// The log is compressed while the TPM works: the TPM is another chip
	// (or process), and the node would otherwise wait on it idle. The
	// channel is buffered, so that an early return leaves nothing blocked.
	var deflated chan deflateResult
	if deflatesLog(version) && eventLog != nil {
		deflated = make(chan deflateResult, 1)
		go func() {
			b, err := deflateEventLog(eventLog)
			deflated <- deflateResult{b, err}
		}()
	}
	s, err := a.start()
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, s.finish()) }()

	ek, cert, err := s.endorsementKey(a.eks)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ak, err := s.createPrimary(akTemplate)
	if err != nil {
		return nil, fmt.Errorf("unable to create the attestation key: %w", err)
	}
	q, err := s.quote(ak, binding, a.pcrs)
	if err != nil {
		return nil, err
	}
	a.hold(s.save(ek, ak))
	ekAnnotation, err := endorsementKeyAnnotation(ek.pub)
	if err != nil {
		return nil, err
	}
	at := &Attestation{
		EKCertificate:  cert,
		EKPublic:       ek.raw,
		AKPublic:       ak.raw,
		Quote:          q.quoted,
		QuoteSignature: q.signature,
		PCRs:           q.values,
		EventLog:       eventLog,
	}
	if deflated != nil {
		r := <-deflated
		if r.err != nil {
			return nil, fmt.Errorf("unable to compress the measured-boot event log: %w", r.err)
		}
		at.EventLog, at.EventLogDeflated = nil, r.deflated
	}
	ev, err := json.Marshal(Evidence{Version: version, Attestation: at})
	if err != nil {
		return nil, fmt.Errorf("unable to encode the evidence: %w", err)
	}
	return &attestor.Attestation{
		Evidence:    ev,
		Version:     version,
		Annotations: map[string]string{attestor.AnnotationEndorsementKey: ekAnnotation},
	}, nil
}

// deflateResult is the compressed event log, or why it could not be.
type deflateResult struct {
	deflated []byte
	err      error
}

// readEventLog reads the measured-boot event log, if the host has one.
func (a *Attestor) readEventLog() ([]byte, error) {
	if a.eventLog == "" {
		return nil, nil
	}
	b, err := os.ReadFile(a.eventLog)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("unable to read the measured-boot event log: %w", err)
	}
	if len(b) > maxEventLog {
		return nil, fmt.Errorf("the measured-boot event log %s is %d bytes, more than the %d a CSR can carry; set the TPM attestor's noEventLog to file without it",
			a.eventLog, len(b), maxEventLog)
	}
	if len(b) == 0 {
		return nil, nil
	}
	return b, nil
}

// quoted is a quote and the PCR values it covers.
type quoted struct {
	quoted, signature []byte
	values            []PCRValue
}

// quoteAttempts bounds how often a quote is taken again because a PCR
// changed between the quote and the PCR read.
const quoteAttempts = 3

// quote has the AK quote sel with qualifying data binding and reads the
// quoted PCRs. PCRs can be extended between the quote and the read, so the
// values are checked against the quoted digest and the quote is taken again
// when they differ.
func (s *session) quote(ak *key, binding []byte, sel tpm2.TPMLPCRSelection) (*quoted, error) {
	for range quoteAttempts {
		rsp, err := tpm2.Quote{
			SignHandle:     ak.auth(tpm2.PasswordAuth(nil)),
			QualifyingData: tpm2.TPM2BData{Buffer: binding},
			InScheme:       tpm2.TPMTSigScheme{Scheme: tpm2.TPMAlgNull},
			PCRSelect:      sel,
		}.Execute(s.t)
		if err != nil {
			return nil, fmt.Errorf("unable to quote the PCRs with the attestation key: %w", err)
		}
		info, err := rsp.Quoted.Contents()
		if err != nil {
			return nil, fmt.Errorf("unable to decode the quote: %w", err)
		}
		q, err := info.Attested.Quote()
		if err != nil {
			return nil, fmt.Errorf("unable to decode the quote: %w", err)
		}
		values, err := s.readPCRs(q.PCRSelect)
		if err != nil {
			return nil, err
		}
		if want := countPCRs(sel); len(values) != want {
			// A TPM quotes an unallocated bank as an empty selection.
			return nil, fmt.Errorf("the TPM quoted %d of the %d selected PCRs (is the PCR bank allocated?)", len(values), want)
		}
		digest, err := pcrDigest(q.PCRSelect, values, crypto.SHA256)
		if err != nil {
			return nil, fmt.Errorf("the TPM's PCR values do not match its quote: %w", err)
		}
		if bytesEqual(digest, q.PCRDigest.Buffer) {
			return &quoted{quoted: rsp.Quoted.Bytes(), signature: tpm2.Marshal(&rsp.Signature), values: values}, nil
		}
	}
	return nil, fmt.Errorf("the quoted PCRs changed between the quote and reading them, %d times", quoteAttempts)
}

// countPCRs counts the PCRs sel selects.
func countPCRs(sel tpm2.TPMLPCRSelection) int {
	n := 0
	for _, s := range sel.PCRSelections {
		for _, b := range s.PCRSelect {
			n += bits.OnesCount8(b)
		}
	}
	return n
}

// readPCRs reads every PCR of sel. TPM2_PCR_Read returns at most eight
// values a call, so it reads until the TPM has returned them all.
func (s *session) readPCRs(sel tpm2.TPMLPCRSelection) ([]PCRValue, error) {
	var out []PCRValue
	left := make([]tpm2.TPMSPCRSelection, len(sel.PCRSelections))
	for i, p := range sel.PCRSelections {
		left[i] = tpm2.TPMSPCRSelection{Hash: p.Hash, PCRSelect: slices.Clone(p.PCRSelect)}
	}
	for range 64 {
		if !slices.ContainsFunc(left, func(p tpm2.TPMSPCRSelection) bool {
			return slices.ContainsFunc(p.PCRSelect, func(b byte) bool { return b != 0 })
		}) {
			return out, nil
		}
		rsp, err := tpm2.PCRRead{PCRSelectionIn: tpm2.TPMLPCRSelection{PCRSelections: left}}.Execute(s.t)
		if err != nil {
			return nil, fmt.Errorf("unable to read the PCRs: %w", err)
		}
		n := 0
		for _, got := range rsp.PCRSelectionOut.PCRSelections {
			bank, ok := bankName(got.Hash)
			if !ok {
				return nil, fmt.Errorf("the TPM returned PCRs of unknown bank 0x%04x", uint16(got.Hash))
			}
			i := slices.IndexFunc(left, func(p tpm2.TPMSPCRSelection) bool { return p.Hash == got.Hash })
			if i < 0 {
				return nil, fmt.Errorf("the TPM returned PCRs of bank %s, which were not asked for", bank)
			}
			for pcr := range len(got.PCRSelect) * 8 {
				if got.PCRSelect[pcr/8]&(1<<(pcr%8)) == 0 {
					continue
				}
				if n >= len(rsp.PCRValues.Digests) {
					return nil, errors.New("the TPM returned fewer PCR values than its selection says")
				}
				if pcr/8 >= len(left[i].PCRSelect) || left[i].PCRSelect[pcr/8]&(1<<(pcr%8)) == 0 {
					return nil, fmt.Errorf("the TPM returned PCR %s:%d, which was not asked for", bank, pcr)
				}
				left[i].PCRSelect[pcr/8] &^= 1 << (pcr % 8)
				out = append(out, PCRValue{Bank: bank, Index: pcr, Digest: rsp.PCRValues.Digests[n].Buffer})
				n++
			}
		}
		if n == 0 {
			// A bank the TPM does not have (unallocated): it returns nothing.
			return nil, errors.New("the TPM returned no values for the selected PCRs (is the PCR bank allocated?)")
		}
	}
	return nil, errors.New("the TPM kept returning PCR values")
}

// Respond implements attestor.Responder: it recovers the challenge secret
// with TPM2_ActivateCredential and proves possession of it for req's key.
func (a *Attestor) Respond(ctx context.Context, req *attestor.Request, ch *attestor.Challenge) (_ *attestor.Attestation, err error) {
	version, err := producedVersion(req)
	if err != nil {
		return nil, err
	}
	if err := checkRequest(req); err != nil {
		return nil, err
	}
	if ch == nil || ch.CSRName == "" || ch.CSRUID == "" {
		return nil, errors.New("tpm challenge must name the challenged CSR and its UID")
	}
	c, err := DecodeChallenge(ch.Data)
	if err != nil {
		return nil, err
	}
	s, err := a.start()
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, s.finish()) }()

	ek, ak, err := s.restore(a.take())
	if err != nil {
		return nil, err
	}
	if ek == nil {
		if ek, _, err = s.endorsementKey(a.eks); err != nil {
			return nil, err
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if ak, err = s.createPrimary(akTemplate); err != nil {
			return nil, fmt.Errorf("unable to create the attestation key: %w", err)
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ekAuth := tpm2.PasswordAuth(nil)
	if !ek.pub.ObjectAttributes.UserWithAuth {
		// The low-range EK templates are usable only through their policy,
		// PolicySecret(TPM_RH_ENDORSEMENT), in a session of the EK's name
		// algorithm. The session is created just in time and flushed by
		// the TPM when the command completes (or by go-tpm if it fails).
		ekAuth = tpm2.Policy(ek.pub.NameAlg, 16, func(t transport.TPM, h tpm2.TPMISHPolicy, nonce tpm2.TPM2BNonce) error {
			_, err := tpm2.PolicySecret{
				AuthHandle:    tpm2.AuthHandle{Handle: tpm2.TPMRHEndorsement, Auth: tpm2.PasswordAuth(nil)},
				PolicySession: h,
				NonceTPM:      nonce,
			}.Execute(t)
			return err
		})
	}
	rsp, err := tpm2.ActivateCredential{
		ActivateHandle: ak.auth(tpm2.PasswordAuth(nil)),
		KeyHandle:      ek.auth(ekAuth),
		CredentialBlob: tpm2.TPM2BIDObject{Buffer: c.CredentialBlob},
		Secret:         tpm2.TPM2BEncryptedSecret{Buffer: c.EncryptedSecret},
	}.Execute(s.t)
	if err != nil {
		return nil, fmt.Errorf("unable to activate the challenge credential (challenge not made for this TPM's EK and AK?): %w", err)
	}
	resp := &Response{CSRName: ch.CSRName, Proof: proof(rsp.CertInfo.Buffer, req.SPKI, ch.CSRUID)}
	if freshQuotes(version) {
		// The fresh quote: the PCRs of the boot answering this challenge,
		// by the same AK over the same selection as the first round.
		q, err := s.quote(ak, freshQualifier(rsp.CertInfo.Buffer, req.SPKI, ch.CSRUID), a.pcrs)
		if err != nil {
			return nil, fmt.Errorf("unable to quote the PCRs for the answer: %w", err)
		}
		resp.Quote, resp.QuoteSignature, resp.PCRs = q.quoted, q.signature, q.values
	}
	ev, err := json.Marshal(Evidence{
		Version:  version,
		Response: resp,
	})
	if err != nil {
		return nil, fmt.Errorf("unable to encode the evidence: %w", err)
	}
	return &attestor.Attestation{Evidence: ev, Version: version}, nil
}

// hold keeps h (nil: nothing) for the next Respond, replacing what an
// earlier Attest kept.
func (a *Attestor) hold(h *heldKeys) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.held = h
}

// take hands out the kept keys once: a saved context is loaded by one
// Respond, and the next attestation saves new ones.
func (a *Attestor) take() *heldKeys {
	a.mu.Lock()
	defer a.mu.Unlock()
	h := a.held
	a.held = nil
	return h
}

// save saves ek's and ak's contexts. It returns nil when the TPM refuses
// (a resource manager that does not pass TPM2_ContextSave through): the
// challenge is then answered with re-created keys, as without it.
func (s *session) save(ek, ak *key) *heldKeys {
	h := &heldKeys{ek: *ek, ak: *ak}
	if !isPersistent(ek.handle) {
		rsp, err := tpm2.ContextSave{SaveHandle: ek.handle}.Execute(s.t)
		if err != nil {
			return nil
		}
		h.ekContext = &rsp.Context
	}
	rsp, err := tpm2.ContextSave{SaveHandle: ak.handle}.Execute(s.t)
	if err != nil {
		return nil
	}
	h.akContext = &rsp.Context
	return h
}

// restore loads h's keys (tracked, so flushed when the session ends). It
// returns nil keys, and no error, when h is nil or the TPM no longer
// accepts its contexts (it was reset or restarted since, or a resource
// manager refuses them); the caller then re-creates the keys. The TPM
// checks a context's integrity before loading it, so a loaded context is
// the very key that was attested.
func (s *session) restore(h *heldKeys) (ek, ak *key, err error) {
	if h == nil {
		return nil, nil, nil
	}
	load := func(k key, c *tpm2.TPMSContext) (*key, bool) {
		if c == nil {
			return &k, true
		}
		rsp, err := tpm2.ContextLoad{Context: *c}.Execute(s.t)
		if err != nil {
			return nil, false
		}
		s.track(rsp.LoadedHandle)
		k.handle = rsp.LoadedHandle
		return &k, true
	}
	ek, ok := load(h.ek, h.ekContext)
	if !ok {
		return nil, nil, nil
	}
	if ak, ok = load(h.ak, h.akContext); !ok {
		// Flush the loaded EK now: the caller re-creates both.
		if err := s.close(); err != nil {
			return nil, nil, err
		}
		return nil, nil, nil
	}
	return ek, ak, nil
}

// isPersistent reports whether h is a persistent object handle.
func isPersistent(h tpm2.TPMHandle) bool { return uint32(h)>>24 == uint32(tpm2.TPMHTPersistent) }

// producedVersion returns the evidence version req asks for: v4, or v3 or
// v2 for a signer that accepts no v4 ("" means v4, or v2 when the node
// knows no cluster CA).
func producedVersion(req *attestor.Request) (string, error) {
	switch v := req.Newest(VersionV4, VersionV2); v {
	case VersionV4, VersionV3, VersionV2:
		return v, nil
	}
	return "", fmt.Errorf("tpm attestor cannot produce evidence version %q (only %s, %s and %s)", req.Version, VersionV4, VersionV3, VersionV2)
}

// checkRequest requires req to carry the CSR's public key and its binding.
func checkRequest(req *attestor.Request) error {
	if len(req.SPKI) == 0 {
		return errors.New("tpm attestor needs the CSR's public key (Request.SPKI)")
	}
	if !bytesEqual(attestor.Binding(req.SPKI), req.Binding) {
		return errors.New("request binding is not the binding of its SPKI")
	}
	if _, err := x509.ParsePKIXPublicKey(req.SPKI); err != nil {
		return fmt.Errorf("unable to parse the CSR public key: %w", err)
	}
	return nil
}

// openedSession is a session on a TPM the Attestor opened.
type openedSession struct {
	session
	closer transport.TPMCloser
}

func (a *Attestor) start() (*openedSession, error) {
	if a.open == nil {
		return nil, errors.New("tpm attestor has no TPM configured")
	}
	t, err := a.open()
	if err != nil {
		return nil, fmt.Errorf("unable to open the TPM: %w", err)
	}
	return &openedSession{session: session{t: retrying{t}}, closer: t}, nil
}

// retrying resends a command the TPM answered with TPM_RC_RETRY,
// TPM_RC_YIELDED or TPM_RC_TESTING: the command did not start, and the TPM
// asks the caller to send it again (libtpms does so for ECC operations).
type retrying struct{ t transport.TPM }

func (r retrying) Send(cmd []byte) ([]byte, error) {
	for attempt := 0; ; attempt++ {
		rsp, err := r.t.Send(cmd)
		if err != nil || len(rsp) < 10 || attempt == 20 {
			return rsp, err
		}
		switch tpm2.TPMRC(binary.BigEndian.Uint32(rsp[6:10])) {
		case tpm2.TPMRCRetry, tpm2.TPMRCYielded, tpm2.TPMRCTesting:
			time.Sleep(time.Duration(attempt+1) * 10 * time.Millisecond)
		default:
			return rsp, nil
		}
	}
}

func (s *openedSession) finish() error {
	return errors.Join(s.close(), s.closer.Close())
}

// createPrimary creates a primary key in the endorsement hierarchy.
func (s *session) createPrimary(tmpl tpm2.TPMTPublic) (*key, error) {
	rsp, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.AuthHandle{Handle: tpm2.TPMRHEndorsement, Auth: tpm2.PasswordAuth(nil)},
		InPublic:      tpm2.New2B(tmpl),
	}.Execute(s.t)
	if err != nil {
		return nil, err
	}
	s.track(rsp.ObjectHandle)
	pub, err := rsp.OutPublic.Contents()
	if err != nil {
		return nil, fmt.Errorf("unable to decode the created key: %w", err)
	}
	return &key{handle: rsp.ObjectHandle, name: rsp.Name, pub: pub, raw: rsp.OutPublic.Bytes()}, nil
}

// endorsementKey finds the EK to use and its certificate: the first
// certificate index present (RSA, ECC P-256, ECC P-384) whose key the TPM
// holds at the conventional persistent handle or re-creates from the
// standard template (looked for in that order: reading a persisted key is
// far cheaper than re-creating it, and a TPM provisioned with a non-default
// template has only the persisted one). A
// TPM with no EK certificate uses the RSA EK and no certificate; the signer
// then needs the Machine's endorsement-key annotation.
func (s *session) endorsementKey(specs []ekSpec) (*key, []byte, error) {
	defined, err := s.handles(uint32(tpm2.TPMHTNVIndex) << 24)
	if err != nil {
		return nil, nil, fmt.Errorf("unable to list NV indices: %w", err)
	}
	for _, spec := range specs {
		if !defined[spec.certIndex] {
			continue
		}
		raw, err := s.readNV(spec.certIndex)
		if err != nil {
			return nil, nil, fmt.Errorf("unable to read the %s EK certificate at 0x%08x: %w", spec.what, uint32(spec.certIndex), err)
		}
		der, err := trimDER(raw)
		if err != nil {
			return nil, nil, fmt.Errorf("the %s EK certificate at 0x%08x is not DER: %w", spec.what, uint32(spec.certIndex), err)
		}
		cert, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, nil, fmt.Errorf("unable to parse the %s EK certificate at 0x%08x: %w", spec.what, uint32(spec.certIndex), err)
		}
		// An EK persisted at its conventional handle (as provisioning
		// tools do) is read, not re-created: re-creating an RSA EK is the
		// costliest command of an issuance. Either way it must be the key
		// the certificate certifies.
		if ek, err := s.readPersistent(spec.persistent); err == nil {
			if k, err := publicKey(ek.pub); err == nil && publicKeysEqual(cert.PublicKey, k) {
				return ek, der, nil
			}
		}
		ek, err := s.createPrimary(spec.template)
		if err != nil {
			return nil, nil, fmt.Errorf("unable to create the %s EK: %w", spec.what, err)
		}
		if k, err := publicKey(ek.pub); err == nil && publicKeysEqual(cert.PublicKey, k) {
			return ek, der, nil
		}
		return nil, nil, fmt.Errorf("the %s EK certificate at 0x%08x certifies a key that is neither the standard-template EK nor the one at 0x%08x", spec.what,
			uint32(spec.certIndex), uint32(spec.persistent))
	}
	ek, err := s.createPrimary(specs[0].template)
	if err != nil {
		return nil, nil, fmt.Errorf("unable to create the %s EK: %w", specs[0].what, err)
	}
	return ek, nil, nil
}

// readPersistent reads a persistent key (not tracked: it is not flushed).
func (s *session) readPersistent(h tpm2.TPMHandle) (*key, error) {
	rsp, err := tpm2.ReadPublic{ObjectHandle: h}.Execute(s.t)
	if err != nil {
		return nil, err
	}
	pub, err := rsp.OutPublic.Contents()
	if err != nil {
		return nil, err
	}
	return &key{handle: h, name: rsp.Name, pub: pub, raw: rsp.OutPublic.Bytes()}, nil
}

// handles lists the handles of one type (first of range) the TPM reports.
func (s *session) handles(first uint32) (map[tpm2.TPMHandle]bool, error) {
	out := map[tpm2.TPMHandle]bool{}
	next := first
	for {
		rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapHandles, Property: next, PropertyCount: 64}.Execute(s.t)
		if err != nil {
			return nil, err
		}
		hs, err := rsp.CapabilityData.Data.Handles()
		if err != nil {
			return nil, err
		}
		for _, h := range hs.Handle {
			if uint32(h)>>24 != first>>24 {
				return out, nil
			}
			out[h] = true
			next = uint32(h) + 1
		}
		if !rsp.MoreData || len(hs.Handle) == 0 {
			return out, nil
		}
	}
}

// nvBufferMax is the largest NV read the TPM allows in one command.
func (s *session) nvBufferMax() uint16 {
	rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapTPMProperties, Property: uint32(tpm2.TPMPTNVBufferMax), PropertyCount: 1}.Execute(s.t)
	if err == nil {
		if ps, err := rsp.CapabilityData.Data.TPMProperties(); err == nil && len(ps.TPMProperty) == 1 &&
			ps.TPMProperty[0].Property == tpm2.TPMPTNVBufferMax && ps.TPMProperty[0].Value > 0 {
			return uint16(min(ps.TPMProperty[0].Value, 4096))
		}
	}
	return 512
}

// readNV reads a whole NV index, authorizing with the index itself (EK
// certificate indices are AUTHREAD with an empty auth value) and falling
// back to the owner hierarchy.
func (s *session) readNV(index tpm2.TPMHandle) ([]byte, error) {
	pub, err := tpm2.NVReadPublic{NVIndex: index}.Execute(s.t)
	if err != nil {
		return nil, err
	}
	nv, err := pub.NVPublic.Contents()
	if err != nil {
		return nil, err
	}
	chunk := s.nvBufferMax()
	auths := []tpm2.AuthHandle{
		{Handle: index, Name: pub.NVName, Auth: tpm2.PasswordAuth(nil)},
		{Handle: tpm2.TPMRHOwner, Auth: tpm2.PasswordAuth(nil)},
	}
	var lastErr error
	for _, auth := range auths {
		out := make([]byte, 0, nv.DataSize)
		for off := uint16(0); off < nv.DataSize; {
			n := min(chunk, nv.DataSize-off)
			rsp, err := tpm2.NVRead{
				AuthHandle: auth,
				NVIndex:    tpm2.NamedHandle{Handle: index, Name: pub.NVName},
				Size:       n,
				Offset:     off,
			}.Execute(s.t)
			if err != nil {
				lastErr = err
				out = nil
				break
			}
			out = append(out, rsp.Data.Buffer...)
			off += n
		}
		if out != nil {
			return out, nil
		}
	}
	return nil, lastErr
}
