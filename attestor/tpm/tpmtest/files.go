package tpmtest

import (
	"crypto"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// Files a ManufacturerCA is saved as.
const (
	RootFile         = "manufacturer-root.pem"
	IntermediateFile = "manufacturer-intermediate.pem"
	KeyFile          = "manufacturer-intermediate.key"
	// BundleFile holds root and intermediate, for a verifier's
	// manufacturer CA bundle.
	BundleFile = "manufacturer-ca.pem"
)

// Save writes the CA to dir (the intermediate's key 0600), so that another
// process (a node's exec plugin under test) can issue EK certificates.
func (ca *ManufacturerCA) Save(dir string) error {
	keyDER, err := x509.MarshalPKCS8PrivateKey(ca.key)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	for name, data := range map[string][]byte{
		RootFile:         pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Root.Raw}),
		IntermediateFile: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Intermediate.Raw}),
		KeyFile:          pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
		BundleFile:       ca.BundlePEM(),
	} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			return err
		}
	}
	return nil
}

// Load reads a CA written by Save.
func Load(dir string) (*ManufacturerCA, error) {
	read := func(name, typ string) ([]byte, error) {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return nil, err
		}
		blk, _ := pem.Decode(data)
		if blk == nil || blk.Type != typ {
			return nil, fmt.Errorf("%s: no %s block", name, typ)
		}
		return blk.Bytes, nil
	}
	rootDER, err := read(RootFile, "CERTIFICATE")
	if err != nil {
		return nil, err
	}
	interDER, err := read(IntermediateFile, "CERTIFICATE")
	if err != nil {
		return nil, err
	}
	keyDER, err := read(KeyFile, "PRIVATE KEY")
	if err != nil {
		return nil, err
	}
	root, err := x509.ParseCertificate(rootDER)
	if err != nil {
		return nil, err
	}
	inter, err := x509.ParseCertificate(interDER)
	if err != nil {
		return nil, err
	}
	k, err := x509.ParsePKCS8PrivateKey(keyDER)
	if err != nil {
		return nil, err
	}
	signer, ok := k.(crypto.Signer)
	if !ok {
		return nil, errors.New("manufacturer key cannot sign")
	}
	return &ManufacturerCA{
		Root: root, Intermediate: inter, key: signer,
		Manufacturer: "id:FFFFF1D0", Model: root.Subject.Organization[0], Version: "id:00010002",
		NotBefore: inter.NotBefore, NotAfter: inter.NotAfter.Add(-time.Second),
	}, nil
}
