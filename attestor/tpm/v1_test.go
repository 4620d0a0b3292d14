package tpm

// Evidence v1 is no longer produced by the node (it needed the CSR's
// private key inside the TPM), but the signer still verifies it for older
// nodes. These helpers make v1 evidence in tests: in software here, with
// the simulator in sim_test.go.

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"errors"
	"fmt"

	"github.com/google/go-tpm/tpm2"
)

// tpmPublicForKey returns the TPMT_PUBLIC under which the node loads the
// CSR key into the TPM to certify it: an unrestricted signing key, nameAlg
// SHA-256, empty auth value, no policy. fixedTPM and fixedParent are clear,
// as TPM2_LoadExternal requires for a key with its private part.
func tpmPublicForKey(key crypto.PublicKey) (*tpm2.TPMTPublic, error) {
	attrs := tpm2.TPMAObject{SignEncrypt: true, UserWithAuth: true, NoDA: true}
	switch k := key.(type) {
	case *ecdsa.PublicKey:
		var curve tpm2.TPMECCCurve
		switch k.Curve {
		case elliptic.P256():
			curve = tpm2.TPMECCNistP256
		case elliptic.P384():
			curve = tpm2.TPMECCNistP384
		default:
			return nil, fmt.Errorf("unsupported ECDSA curve %s", k.Curve.Params().Name)
		}
		enc, err := k.Bytes()
		if err != nil {
			return nil, fmt.Errorf("invalid ECDSA key: %w", err)
		}
		size := (len(enc) - 1) / 2
		return &tpm2.TPMTPublic{
			Type:             tpm2.TPMAlgECC,
			NameAlg:          tpm2.TPMAlgSHA256,
			ObjectAttributes: attrs,
			Parameters: tpm2.NewTPMUPublicParms(tpm2.TPMAlgECC, &tpm2.TPMSECCParms{
				Symmetric: tpm2.TPMTSymDefObject{Algorithm: tpm2.TPMAlgNull},
				Scheme:    tpm2.TPMTECCScheme{Scheme: tpm2.TPMAlgNull},
				CurveID:   curve,
				KDF:       tpm2.TPMTKDFScheme{Scheme: tpm2.TPMAlgNull},
			}),
			Unique: tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{
				X: tpm2.TPM2BECCParameter{Buffer: enc[1 : 1+size]},
				Y: tpm2.TPM2BECCParameter{Buffer: enc[1+size:]},
			}),
		}, nil
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 || k.N.BitLen()%8 != 0 {
			return nil, fmt.Errorf("unsupported RSA key size %d", k.N.BitLen())
		}
		exp := uint32(k.E)
		if k.E == 65537 {
			exp = 0
		}
		return &tpm2.TPMTPublic{
			Type:             tpm2.TPMAlgRSA,
			NameAlg:          tpm2.TPMAlgSHA256,
			ObjectAttributes: attrs,
			Parameters: tpm2.NewTPMUPublicParms(tpm2.TPMAlgRSA, &tpm2.TPMSRSAParms{
				Symmetric: tpm2.TPMTSymDefObject{Algorithm: tpm2.TPMAlgNull},
				Scheme:    tpm2.TPMTRSAScheme{Scheme: tpm2.TPMAlgNull},
				KeyBits:   tpm2.TPMIRSAKeyBits(k.N.BitLen()),
				Exponent:  exp,
			}),
			Unique: tpm2.NewTPMUPublicID(tpm2.TPMAlgRSA, &tpm2.TPM2BPublicKeyRSA{Buffer: k.N.Bytes()}),
		}, nil
	}
	return nil, fmt.Errorf("unsupported CSR key type %T", key)
}

// tpmSensitiveForKey returns the TPMT_SENSITIVE of the CSR's private key,
// which must be the key of the request's SPKI.
func tpmSensitiveForKey(priv crypto.Signer, pub crypto.PublicKey) (*tpm2.TPMTSensitive, error) {
	if priv == nil {
		return nil, errors.New("tpm attestor needs the CSR's private key (Request.Key) to have the TPM certify it")
	}
	if !publicKeysEqual(priv.Public(), pub) {
		return nil, errors.New("request key is not the key of its SPKI")
	}
	switch k := priv.(type) {
	case *ecdsa.PrivateKey:
		d, err := k.Bytes()
		if err != nil {
			return nil, fmt.Errorf("unable to encode the CSR private key: %w", err)
		}
		return &tpm2.TPMTSensitive{
			SensitiveType: tpm2.TPMAlgECC,
			Sensitive:     tpm2.NewTPMUSensitiveComposite(tpm2.TPMAlgECC, &tpm2.TPM2BECCParameter{Buffer: d}),
		}, nil
	case *rsa.PrivateKey:
		if len(k.Primes) != 2 {
			return nil, errors.New("unsupported multi-prime RSA key")
		}
		return &tpm2.TPMTSensitive{
			SensitiveType: tpm2.TPMAlgRSA,
			Sensitive:     tpm2.NewTPMUSensitiveComposite(tpm2.TPMAlgRSA, &tpm2.TPM2BPrivateKeyRSA{Buffer: k.Primes[0].Bytes()}),
		}, nil
	}
	return nil, fmt.Errorf("unsupported CSR private key type %T", priv)
}
