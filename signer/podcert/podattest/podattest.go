// Package podattest encodes and parses the attestation extension of the
// pod certificates node-attestation-controller issues: a non-critical
// X.509 extension under attestor.OIDPodAttestation saying what the
// controller attested about the node the pod runs on (the attestor, the
// node's provider ID, its Machine, its name, when, and the digest of the
// boot policy its evidence passed). A relying party that accepts a peer
// only from an attested node requires it with FromCertificate, after the
// certificate verified against the pod CA's trust bundle.
//
// The ASN.1 module is in docs/pod-certificates.md. Besides the standard
// library the package imports only package attestor (the OID), so that a
// workload can link it.
package podattest

import (
	"bytes"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"errors"
	"fmt"
	"regexp"
	"sync"
	"time"
	"unicode/utf8"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Version is the version of the extension this package writes and reads.
const Version = 1

// Bounds of the extension: anything larger is refused before it is parsed.
const (
	// MaxSize bounds the extension's value.
	MaxSize = 4 << 10
	// MaxProviderIDLength bounds providerID (Cluster API does not bound
	// spec.providerID; real ones are well under 256 bytes).
	MaxProviderIDLength = 1024
)

// Attestation is what the extension says.
type Attestation struct {
	// Attestor is the attestor whose evidence the controller verified
	// before it issued the node's client certificate (tpm, aws, azure,
	// gcp, insecure).
	Attestor string
	// ProviderID is the node's provider ID (its Machine's
	// spec.providerID), proven by that evidence; empty when the node has
	// none.
	ProviderID string
	// MachineNamespace and MachineName name the Cluster API Machine the
	// node is, in the management cluster.
	MachineNamespace, MachineName string
	// NodeName is the node's name, which requested the certificate.
	NodeName string
	// AttestedAt is when the controller issued the node's client
	// certificate the pod certificate was requested with, right after it
	// verified the evidence; whole seconds, UTC.
	AttestedAt time.Time
	// BootPolicySHA256 is the SHA-256 of the Cluster's policy document for
	// the attestor (the TPM boot policy) that the evidence passed; nil when
	// the Cluster had none.
	BootPolicySHA256 []byte
}

// wire is the DER form (docs/pod-certificates.md, NodeAttestation).
type wire struct {
	Version          int
	Attestor         string    `asn1:"utf8"`
	ProviderID       string    `asn1:"utf8"`
	MachineNamespace string    `asn1:"utf8"`
	MachineName      string    `asn1:"utf8"`
	NodeName         string    `asn1:"utf8"`
	AttestedAt       time.Time `asn1:"generalized"`
	BootPolicySHA256 []byte    `asn1:"optional,tag:0"`
}

var (
	dnsLabelRE     = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`) })
	dnsSubdomainRE = sync.OnceValue(func() *regexp.Regexp {
		return regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
	})
)

// validate reports every field that is not what the controller writes.
func (a *Attestation) validate() error {
	var errs []error
	if !attestor.ValidProviderName(a.Attestor) {
		errs = append(errs, fmt.Errorf("attestor %q is not an attestor name", a.Attestor))
	}
	if len(a.ProviderID) > MaxProviderIDLength || !utf8.ValidString(a.ProviderID) {
		errs = append(errs, fmt.Errorf("providerID is not UTF-8 of at most %d bytes", MaxProviderIDLength))
	}
	if len(a.MachineNamespace) > 63 || !dnsLabelRE().MatchString(a.MachineNamespace) {
		errs = append(errs, fmt.Errorf("machineNamespace %q is not a namespace name", a.MachineNamespace))
	}
	if len(a.MachineName) > 253 || !dnsSubdomainRE().MatchString(a.MachineName) {
		errs = append(errs, fmt.Errorf("machineName %q is not a Machine name", a.MachineName))
	}
	if len(a.NodeName) > 253 || !dnsSubdomainRE().MatchString(a.NodeName) {
		errs = append(errs, fmt.Errorf("nodeName %q is not a node name", a.NodeName))
	}
	if a.AttestedAt.IsZero() || a.AttestedAt.Year() < 2000 || a.AttestedAt.Year() > 9999 {
		errs = append(errs, fmt.Errorf("attestedAt %s is out of range", a.AttestedAt))
	}
	if a.BootPolicySHA256 != nil && len(a.BootPolicySHA256) != sha256.Size {
		errs = append(errs, fmt.Errorf("bootPolicySHA256 is %d bytes, not %d", len(a.BootPolicySHA256), sha256.Size))
	}
	return errors.Join(errs...)
}

func (a *Attestation) wire() wire {
	return wire{
		Version:          Version,
		Attestor:         a.Attestor,
		ProviderID:       a.ProviderID,
		MachineNamespace: a.MachineNamespace,
		MachineName:      a.MachineName,
		NodeName:         a.NodeName,
		AttestedAt:       a.AttestedAt.UTC(),
		BootPolicySHA256: a.BootPolicySHA256,
	}
}

// Extension returns the non-critical extension carrying a. AttestedAt is
// written in whole seconds (DER GeneralizedTime, UTC).
func (a *Attestation) Extension() (pkix.Extension, error) {
	b := *a
	b.AttestedAt = b.AttestedAt.UTC().Truncate(time.Second)
	if err := b.validate(); err != nil {
		return pkix.Extension{}, fmt.Errorf("unable to encode the attestation extension: %w", err)
	}
	v, err := asn1.Marshal(b.wire())
	if err != nil {
		return pkix.Extension{}, fmt.Errorf("unable to encode the attestation extension: %w", err)
	}
	return pkix.Extension{Id: attestor.OIDPodAttestation, Critical: false, Value: v}, nil
}

// Parse parses the value of the extension strictly: DER only (the value
// must be exactly what Extension writes for what it says: no other string
// types, no time zone but Z, no fractional seconds, no trailing data),
// version 1, and every field as the controller writes it.
func Parse(value []byte) (*Attestation, error) {
	if len(value) > MaxSize {
		return nil, fmt.Errorf("attestation extension is %d bytes, more than the %d allowed", len(value), MaxSize)
	}
	var w wire
	rest, err := asn1.Unmarshal(value, &w)
	if err != nil {
		return nil, fmt.Errorf("attestation extension is not a NodeAttestation: %w", err)
	}
	if len(rest) != 0 {
		return nil, errors.New("attestation extension has trailing data")
	}
	if w.Version != Version {
		return nil, fmt.Errorf("attestation extension has version %d, this parser reads version %d", w.Version, Version)
	}
	a := &Attestation{
		Attestor:         w.Attestor,
		ProviderID:       w.ProviderID,
		MachineNamespace: w.MachineNamespace,
		MachineName:      w.MachineName,
		NodeName:         w.NodeName,
		AttestedAt:       w.AttestedAt.UTC(),
		BootPolicySHA256: w.BootPolicySHA256,
	}
	if err := a.validate(); err != nil {
		return nil, fmt.Errorf("attestation extension: %w", err)
	}
	again, err := asn1.Marshal(a.wire())
	if err != nil || !bytes.Equal(again, value) {
		return nil, errors.New("attestation extension is not in DER as written by node-attestation-controller")
	}
	return a, nil
}

// FromExtensions finds the attestation extension among exts and parses it:
// exactly one, non-critical.
func FromExtensions(exts []pkix.Extension) (*Attestation, error) {
	var found *pkix.Extension
	for i := range exts {
		if exts[i].Id.Equal(attestor.OIDPodAttestation) {
			if found != nil {
				return nil, errors.New("attestation extension appears more than once")
			}
			found = &exts[i]
		}
	}
	if found == nil {
		return nil, fmt.Errorf("no attestation extension (%s): the certificate does not say its node was attested", attestor.OIDPodAttestation)
	}
	if found.Critical {
		return nil, errors.New("attestation extension must not be critical")
	}
	return Parse(found.Value)
}

// FromCertificate returns what cert's attestation extension says. Call it
// on a certificate that verified against the pod CA's trust bundle: the
// extension is only as good as the signature over it.
func FromCertificate(cert *x509.Certificate) (*Attestation, error) {
	return FromExtensions(cert.Extensions)
}
