package attestor

import (
	"bytes"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"unicode/utf8"

	json "github.com/go-json-experiment/json"
)

// Wire contract constants. Other tools and older agents depend on them: do
// not change them.
const (
	// PEMTypeCSR is the PEM type of the PKCS#10 block.
	PEMTypeCSR = "CERTIFICATE REQUEST"
	// PEMTypeProvider is the PEM type of the block naming the provider.
	PEMTypeProvider = "KUBELET AUTHENTICATOR ATTESTATION PROVIDER"
	// PEMTypeData is the PEM type of the block holding the evidence.
	PEMTypeData = "KUBELET AUTHENTICATOR ATTESTATION DATA"

	// SignerPrefix is the domain of this project's signer names.
	SignerPrefix = "cluster.x-k8s.io/"
	// ClientSignerPrefix prefixes kubelet client signer names; the provider
	// name follows.
	ClientSignerPrefix = SignerPrefix + "kube-apiserver-client-kubelet-"
	// ServingSignerPrefix prefixes kubelet serving signer names.
	ServingSignerPrefix = SignerPrefix + "kubelet-serving-"

	// AnnotationChallenge is written by the controller on a CSR: a TPM
	// credential-activation challenge.
	AnnotationChallenge = "kubelet-authenticator.x-k8s.io/challenge"
	// AnnotationChallengeSeal is written by the controller with every
	// challenge: the challenge's expiry and a MAC under the controller key
	// over it, the challenge, the CSR's UID and its signer name. Nodes
	// ignore it; the controller takes no challenge without it.
	AnnotationChallengeSeal = "kubelet-authenticator.x-k8s.io/challenge-seal"
	// AnnotationSupportedVersions is written by the controller on a CSR whose
	// evidence version it does not accept: a comma-separated list.
	AnnotationSupportedVersions = "kubelet-authenticator.x-k8s.io/supported-versions"
	// AnnotationEndorsementKey is written by the node on its CSR (TPM only):
	// base64 DER of the EK public key.
	AnnotationEndorsementKey = "cluster-x-k8s-io/tpm-endorsement-key"

	// MaxRequestSize bounds spec.request; anything larger is rejected
	// before parsing.
	MaxRequestSize = 256 << 10
	// MaxAnnotationSize bounds the value of each annotation the signer
	// reads on a CSR (RequestAnnotations): a challenge and its seal, an
	// endorsement key, a version list, each well under 4 KiB. A request
	// with a larger one is rejected, and no more of it is cached.
	MaxAnnotationSize = 16 << 10
)

// RequestAnnotations are the annotations of a CSR the signer reads: the
// controller's challenge, its seal and the versions it supports, and the
// node's endorsement key. A CSR's other annotations, its labels and its
// finalizers are the requester's own and are never read (nor cached).
func RequestAnnotations() []string {
	return []string{AnnotationChallenge, AnnotationChallengeSeal, AnnotationSupportedVersions, AnnotationEndorsementKey}
}

// OIDProviderID is KubernetesNodeProviderIdentifierOID: the CSR and the
// issued certificate carry the node's provider ID in this extension, as an
// ASN.1 UTF8String, non-critical.
var OIDProviderID = asn1.ObjectIdentifier{1, 3, 6, 1, 4, 1, 11129, 2, 1, 21}

// OIDPodAttestation identifies the extension of a pod certificate that says
// what the controller attested about the pod's node (package
// signer/podcert/podattest; docs/pod-certificates.md). It is the
// coordination-free OID of UUID cc4a0f5f-7db4-49e6-ae3a-0c2484dcac75 under
// 1.2.840.113556.1.8000.2554 (the UUID in arcs of 16, 16, 16, 16, 16, 24
// and 24 bits): its 2.25 form has a 128-bit arc, and Go's crypto/x509
// refuses a certificate with an extension arc of 2^31 or more.
var OIDPodAttestation = asn1.ObjectIdentifier{1, 2, 840, 113556, 1, 8000, 2554, 52298, 3935, 32180, 18918, 44602, 795780, 14462069}

// ClientSignerName returns the kubelet client signer name for a provider.
func ClientSignerName(provider string) string { return ClientSignerPrefix + provider }

// ServingSignerName returns the kubelet serving signer name for a provider.
func ServingSignerName(provider string) string { return ServingSignerPrefix + provider }

// Regular expressions are compiled on first use, not at package init: the
// node binary links every provider, and the exec plugin's cached path pays
// for each initializer on every call (make bench, BenchmarkCachedPath).
var providerNameRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$`) })

// ValidProviderName reports whether name is a well-formed provider name.
func ValidProviderName(name string) bool { return providerNameRE().MatchString(name) }

// ProviderIDExtension returns the CSR/certificate extension carrying
// providerID.
func ProviderIDExtension(providerID string) (pkix.Extension, error) {
	if providerID == "" || !utf8.ValidString(providerID) {
		return pkix.Extension{}, errors.New("provider ID must be a non-empty UTF-8 string")
	}
	v, err := asn1.MarshalWithParams(providerID, "utf8")
	if err != nil {
		return pkix.Extension{}, fmt.Errorf("unable to encode provider ID: %w", err)
	}
	return pkix.Extension{Id: OIDProviderID, Critical: false, Value: v}, nil
}

// ProviderIDFromExtensions returns the provider ID carried in exts. It
// requires exactly one non-critical extension holding a UTF8String and
// nothing after it.
func ProviderIDFromExtensions(exts []pkix.Extension) (string, error) {
	var found *pkix.Extension
	for i := range exts {
		if exts[i].Id.Equal(OIDProviderID) {
			if found != nil {
				return "", errors.New("provider ID extension appears more than once")
			}
			found = &exts[i]
		}
	}
	if found == nil {
		return "", fmt.Errorf("no provider ID extension (%s)", OIDProviderID)
	}
	if found.Critical {
		return "", errors.New("provider ID extension must not be critical")
	}
	var raw asn1.RawValue
	rest, err := asn1.Unmarshal(found.Value, &raw)
	if err != nil {
		return "", fmt.Errorf("provider ID extension is not valid DER: %w", err)
	}
	if len(rest) != 0 {
		return "", errors.New("provider ID extension has trailing data")
	}
	if raw.Class != asn1.ClassUniversal || raw.Tag != asn1.TagUTF8String || raw.IsCompound {
		return "", errors.New("provider ID extension is not a UTF8String")
	}
	s := string(raw.Bytes)
	if s == "" || !utf8.ValidString(s) {
		return "", errors.New("provider ID extension holds an empty or invalid UTF-8 string")
	}
	return s, nil
}

// AttestedRequest is the parsed form of spec.request.
type AttestedRequest struct {
	// CSR is the parsed PKCS#10 request and CSRDER its bytes.
	CSR    *x509.CertificateRequest
	CSRDER []byte
	// Provider is the provider name from the provider block.
	Provider string
	// Evidence is the body of the data block and Version its "version".
	Evidence Evidence
	Version  string
}

// EncodeRequest builds spec.request: the PKCS#10 block followed by the
// provider block and the data block.
func EncodeRequest(csrDER []byte, provider string, evidence Evidence) ([]byte, error) {
	if !ValidProviderName(provider) {
		return nil, fmt.Errorf("invalid provider name %q", provider)
	}
	if _, err := EvidenceVersion(evidence); err != nil {
		return nil, err
	}
	var b bytes.Buffer
	for _, blk := range []*pem.Block{
		{Type: PEMTypeCSR, Bytes: csrDER},
		{Type: PEMTypeProvider, Bytes: []byte(provider)},
		{Type: PEMTypeData, Bytes: evidence},
	} {
		if err := pem.Encode(&b, blk); err != nil {
			return nil, err
		}
	}
	if b.Len() > MaxRequestSize {
		return nil, fmt.Errorf("request is %d bytes, more than the %d allowed", b.Len(), MaxRequestSize)
	}
	return b.Bytes(), nil
}

// RequestError is a spec.request that does not follow the wire contract.
// When the evidence block breaks an evidence rule, Err is the *DenyError
// with that rule's reason (see CheckEvidence), so that AsDenial finds it.
type RequestError struct {
	Msg string
	Err error
}

func (e *RequestError) Error() string { return e.Msg }

// Unwrap returns the evidence denial, if any.
func (e *RequestError) Unwrap() error { return e.Err }

func requestErrorf(format string, args ...any) error {
	return &RequestError{Msg: fmt.Sprintf(format, args...)}
}

// ParseRequest parses spec.request strictly: exactly a PKCS#10 block, a
// provider block and a data block, in that order, separated by nothing but
// whitespace, with no PEM headers and nothing after the last block.
func ParseRequest(data []byte) (*AttestedRequest, error) {
	if len(data) > MaxRequestSize {
		return nil, requestErrorf("request is larger than the %d bytes allowed", MaxRequestSize)
	}
	want := []string{PEMTypeCSR, PEMTypeProvider, PEMTypeData}
	var blocks []*pem.Block
	rest := data
	for {
		rest = bytes.TrimLeft(rest, " \t\r\n")
		if len(rest) == 0 {
			break
		}
		if !bytes.HasPrefix(rest, []byte("-----BEGIN ")) {
			return nil, requestErrorf("unexpected data after PEM block %d", len(blocks))
		}
		var blk *pem.Block
		blk, rest = pem.Decode(rest)
		if blk == nil {
			return nil, requestErrorf("malformed PEM block after block %d", len(blocks))
		}
		if len(blk.Headers) != 0 {
			return nil, requestErrorf("PEM block %q must not have headers", blk.Type)
		}
		blocks = append(blocks, blk)
		if len(blocks) > len(want) {
			return nil, requestErrorf("request has more than %d PEM blocks (extra %q)", len(want), blk.Type)
		}
	}
	seen := map[string]int{}
	for _, b := range blocks {
		seen[b.Type]++
	}
	for _, t := range want {
		switch seen[t] {
		case 0:
			return nil, requestErrorf("request has no %q PEM block", t)
		case 1:
		default:
			return nil, requestErrorf("request has %d %q PEM blocks, want exactly one", seen[t], t)
		}
	}
	for i, t := range want {
		if blocks[i].Type != t {
			return nil, requestErrorf("PEM block %d is %q, want %q (order: %s)", i+1, blocks[i].Type, t, strings.Join(want, ", "))
		}
	}
	csr, err := x509.ParseCertificateRequest(blocks[0].Bytes)
	if err != nil {
		return nil, requestErrorf("unable to parse PKCS#10 request: %v", err)
	}
	provider := string(blocks[1].Bytes)
	if !ValidProviderName(provider) {
		return nil, requestErrorf("invalid provider name %q in the provider block", provider)
	}
	version, err := checkEvidence(blocks[2].Bytes)
	if err != nil {
		return nil, &RequestError{Msg: err.Error(), Err: err}
	}
	return &AttestedRequest{
		CSR:      csr,
		CSRDER:   blocks[0].Bytes,
		Provider: provider,
		Evidence: blocks[2].Bytes,
		Version:  version,
	}, nil
}

var versionRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^v[0-9]+[a-z0-9]*$`) })

// EvidenceVersion returns the "version" member of an evidence document
// after CheckEvidence's rules; a failure is a *DenyError.
func EvidenceVersion(evidence Evidence) (string, error) {
	return checkEvidence(evidence)
}

// Encode marshals an evidence document of the given version into an
// Attestation without annotations. doc is a provider's evidence struct (not
// a pointer); the result is read back through DecodeEvidence, so a node
// never files evidence that the strict decoder refuses.
func Encode(version string, doc any) (*Attestation, error) {
	b, err := json.Marshal(doc)
	if err != nil {
		return nil, fmt.Errorf("unable to encode evidence: %w", err)
	}
	got, err := checkEvidence(b)
	if err == nil {
		err = DecodeEvidence(b, reflect.New(reflect.TypeOf(doc)).Interface())
	}
	if err != nil {
		return nil, fmt.Errorf("encoded evidence does not decode: %w", err)
	}
	if got != version {
		return nil, fmt.Errorf("encoded evidence has version %q, want %q", got, version)
	}
	return &Attestation{Evidence: b, Version: version}, nil
}

// The identities of the CSR's subject and of its requester, as
// kube-apiserver names them: a node's client certificate says
// CN=NodeUserPrefix+<node name>, O=NodesGroup; a bootstrap token
// authenticates as BootstrapUserPrefix+<token id> in BootstrappersGroup.
const (
	NodeUserPrefix      = "system:node:"
	NodesGroup          = "system:nodes"
	BootstrapUserPrefix = "system:bootstrap:"
	BootstrappersGroup  = "system:bootstrappers"
)
