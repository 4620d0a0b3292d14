// Package trustbundle projects ClusterTrustBundle objects onto the node's
// file system: for each configured projection it watches the selected
// objects (by name, or by signer name and label selector), assembles their
// certificates into one PEM file (validated, de-duplicated, sorted) and
// writes it the way kubelet's AtomicWriter writes a volume, so that a reader
// sees the old bundle or the new one, never a mix, a partial or an empty file.
//
// Content policy: every PEM block of every selected object must be a
// CERTIFICATE block without headers that parses as X.509, with nothing but
// white space between blocks. If one selected object breaks this rule the
// projection is not changed at all: the last good content stays on disk and
// the projection is reported stale. (kube-apiserver validates trust bundles
// on write, so this guards against a server or a version that does not, and
// never drops one CA of a rotation pair while keeping the other.) The same
// holds when the selected objects disappear: the last good content stays.
package trustbundle

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Bundle is an assembled trust bundle.
type Bundle struct {
	// PEM is the certificates, PEM encoded, sorted by their DER bytes,
	// without duplicates.
	PEM []byte
	// Certificates is how many certificates PEM holds.
	Certificates int
}

// Assemble validates the trust bundles of the selected objects (object
// name to spec.trustBundle) and merges them. It returns an error naming
// every invalid object and what is wrong with it; no bundle is returned
// then. No objects at all is an error too: there is nothing to trust.
func Assemble(objects map[string]string) (*Bundle, error) {
	if len(objects) == 0 {
		return nil, errors.New("no ClusterTrustBundle selected")
	}
	names := make([]string, 0, len(objects))
	for n := range objects {
		names = append(names, n)
	}
	slices.Sort(names)
	var ders [][]byte
	var errs []error
	for _, n := range names {
		certs, err := ParseCertificates(objects[n])
		if err != nil {
			errs = append(errs, fmt.Errorf("ClusterTrustBundle %s: %w", n, err))
			continue
		}
		for _, c := range certs {
			ders = append(ders, c.Raw)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	slices.SortFunc(ders, bytes.Compare)
	ders = slices.CompactFunc(ders, bytes.Equal)
	var out bytes.Buffer
	for _, der := range ders {
		_ = pem.Encode(&out, &pem.Block{Type: "CERTIFICATE", Bytes: der})
	}
	return &Bundle{PEM: out.Bytes(), Certificates: len(ders)}, nil
}

// ParseCertificates parses a trust bundle: one or more CERTIFICATE PEM
// blocks, without headers, separated by nothing but white space. Any other
// content makes the whole bundle invalid.
func ParseCertificates(bundle string) ([]*x509.Certificate, error) {
	rest := []byte(strings.TrimSpace(bundle))
	if len(rest) == 0 {
		return nil, errors.New("trust bundle is empty")
	}
	var certs []*x509.Certificate
	for i := 0; len(rest) > 0; i++ {
		if !bytes.HasPrefix(rest, []byte("-----BEGIN ")) {
			return nil, fmt.Errorf("data outside PEM blocks after block %d", i)
		}
		var blk *pem.Block
		blk, rest = pem.Decode(rest)
		if blk == nil {
			return nil, fmt.Errorf("block %d is not valid PEM", i)
		}
		rest = bytes.TrimSpace(rest)
		if blk.Type != "CERTIFICATE" {
			return nil, fmt.Errorf("block %d is a %q block, not CERTIFICATE", i, blk.Type)
		}
		if len(blk.Headers) != 0 {
			return nil, fmt.Errorf("block %d has PEM headers", i)
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			return nil, fmt.Errorf("block %d: %w", i, err)
		}
		certs = append(certs, c)
	}
	return certs, nil
}

// Count returns how many certificates a PEM file written by this package
// holds (0 when it does not parse).
func Count(data []byte) int {
	certs, err := ParseCertificates(string(data))
	if err != nil {
		return 0
	}
	return len(certs)
}
