//go:build tpmsimulator

// Package tpmsim runs the TPM attestor against the in-process TPM simulator
// (Microsoft's reference TPM via go-tpm-tools, cgo). It exists for tests and
// `make demo` only: it builds only with the tpmsimulator build tag, so a
// release node binary cannot link it.
//
// The simulator is a process-wide singleton: Open blocks until the previous
// simulator is closed.
package tpmsim

import (
	"crypto/x509"
	"fmt"

	"github.com/google/go-tpm-tools/simulator"
	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// Open starts a freshly manufactured simulator (new seeds, empty NV).
func Open() (transport.TPMCloser, error) {
	sim, err := simulator.Get()
	if err != nil {
		return nil, fmt.Errorf("unable to start the TPM simulator: %w", err)
	}
	return transport.FromReadWriteCloser(sim), nil
}

// NopCloser wraps t so that closing it does nothing, for handing one
// simulator to code that opens and closes its TPM on every use.
func NopCloser(t transport.TPM) transport.TPMCloser { return nopCloser{t} }

type nopCloser struct{ transport.TPM }

func (nopCloser) Close() error { return nil }

// EKCertIndex is the NV index of the RSA EK certificate.
const EKCertIndex tpm2.TPMHandle = 0x01c00002

// EKPersistentHandle is where OpenProvisioned persists the RSA EK (the TCG
// provisioning guidance's handle for it).
const EKPersistentHandle tpm2.TPMHandle = 0x81010001

// Provision does what a TPM manufacturer does: it creates the RSA EK from
// the TCG template, has ca issue its certificate, and stores the
// certificate in NV at EKCertIndex, followed by 0xFF filler up to nvSize
// bytes (0 means exactly the certificate), as real NV indices are. It
// returns the certificate.
func Provision(t transport.TPM, ca *tpmtest.ManufacturerCA, nvSize int) (*x509.Certificate, error) {
	return provision(t, ca, nvSize, false)
}

// provision is Provision, and with persist it also makes the EK persistent
// at EKPersistentHandle, as a machine's provisioning does.
func provision(t transport.TPM, ca *tpmtest.ManufacturerCA, nvSize int, persist bool) (*x509.Certificate, error) {
	ek, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.AuthHandle{Handle: tpm2.TPMRHEndorsement, Auth: tpm2.PasswordAuth(nil)},
		InPublic:      tpm2.New2B(tpm2.RSAEKTemplate),
	}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("unable to create the EK: %w", err)
	}
	defer func() { _, _ = tpm2.FlushContext{FlushHandle: ek.ObjectHandle}.Execute(t) }()
	if persist {
		if _, err := (tpm2.EvictControl{
			Auth:             tpm2.AuthHandle{Handle: tpm2.TPMRHOwner, Auth: tpm2.PasswordAuth(nil)},
			ObjectHandle:     &tpm2.NamedHandle{Handle: ek.ObjectHandle, Name: ek.Name},
			PersistentHandle: EKPersistentHandle,
		}).Execute(t); err != nil {
			return nil, fmt.Errorf("unable to persist the EK: %w", err)
		}
	}
	pub, err := ek.OutPublic.Contents()
	if err != nil {
		return nil, err
	}
	key, err := tpm2.Pub(*pub)
	if err != nil {
		return nil, err
	}
	der, err := ca.IssueEKCertificate(key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	if nvSize < len(der) {
		nvSize = len(der)
	}
	data := make([]byte, nvSize)
	copy(data, der)
	for i := len(der); i < nvSize; i++ {
		data[i] = 0xFF
	}
	nvPub := tpm2.TPMSNVPublic{
		NVIndex: EKCertIndex,
		NameAlg: tpm2.TPMAlgSHA256,
		Attributes: tpm2.TPMANV{
			PPWrite: true, PPRead: true, OwnerRead: true, AuthRead: true,
			NoDA: true, PlatformCreate: true, NT: tpm2.TPMNTOrdinary,
		},
		DataSize: uint16(nvSize),
	}
	platform := tpm2.AuthHandle{Handle: tpm2.TPMRHPlatform, Auth: tpm2.PasswordAuth(nil)}
	if _, err := (tpm2.NVDefineSpace{AuthHandle: platform, PublicInfo: tpm2.New2B(nvPub)}).Execute(t); err != nil {
		return nil, fmt.Errorf("unable to define the EK certificate NV index: %w", err)
	}
	name, err := tpm2.NVName(&nvPub)
	if err != nil {
		return nil, err
	}
	// NV_Write sets TPMA_NV_WRITTEN, which changes the Name; the TPM
	// computes it itself, so only the handle matters here.
	for off := 0; off < len(data); off += 512 {
		end := min(off+512, len(data))
		if _, err := (tpm2.NVWrite{
			AuthHandle: platform,
			NVIndex:    tpm2.NamedHandle{Handle: EKCertIndex, Name: *name},
			Data:       tpm2.TPM2BMaxNVBuffer{Buffer: data[off:end]},
			Offset:     uint16(off),
		}).Execute(t); err != nil {
			return nil, fmt.Errorf("unable to write the EK certificate to NV: %w", err)
		}
		// After the first write the index's Name includes WRITTEN.
		nvPub.Attributes.Written = true
		if name, err = tpm2.NVName(&nvPub); err != nil {
			return nil, err
		}
	}
	return cert, nil
}

// OpenProvisioned starts a simulator whose seeds derive from seed, so that
// every process opening it with the same seed sees the same EK (a
// stand-in for one machine's TPM across invocations), provisions its EK
// certificate from ca and persists the EK at EKPersistentHandle. Insecure
// by construction: for tests and the demo.
func OpenProvisioned(seed int64, ca *tpmtest.ManufacturerCA) (transport.TPMCloser, error) {
	sim, err := simulator.GetWithFixedSeedInsecure(seed)
	if err != nil {
		return nil, fmt.Errorf("unable to start the TPM simulator: %w", err)
	}
	t := transport.FromReadWriteCloser(sim)
	if _, err := provision(t, ca, 0, true); err != nil {
		t.Close()
		return nil, fmt.Errorf("unable to provision the TPM simulator: %w", err)
	}
	return t, nil
}
