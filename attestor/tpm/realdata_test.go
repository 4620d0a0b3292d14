package tpm

import (
	"encoding/pem"
	"os"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	realdatapkg "sigs.k8s.io/kubelet-authenticator/test/realdata"
)

// realVerifyTime is a fixed time at which every accepted real certificate
// and its chain are valid.
var realVerifyTime = time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)

// realBundle is the manufacturer CA bundle an operator would assemble for
// the TPMs below: vendor roots plus the intermediates TPMs do not carry.
var realBundle = []string{
	"keylime-GS_TPM_RT.pem", "keylime-STM_RSA_RT.pem", "keylime-STM_RSA_05I.pem",
	"loicsikidi-bundle-tpm-root-ca-certificates.pem", "keylime-STM_ECC_01RT.pem", "keylime-STM_ECC_01I.pem",
	"keylime-NUVO_2111.pem",
	"keylime-INF_RSA_010RT.pem", "intel-secl-infineon-optiga-rsa-mfr-ca-007.pem",
	"keylime-INTEL_RT.pem", "keylime-INTEL_I.pem",
	"dltf-amd-AMDTPM-root.pem", "dltf-amd-PRG-RN-intermediate.pem",
	"google-tpm_ek_root_1.pem", "google-tpm_ek_intermediate_3.pem",
	"google-gcp_ek_ak_ca_root.pem", "google-gcp_ek_ak_ca_intermediate_v3.pem",
}

func readRealCert(t *testing.T, path string) []byte {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := pem.Decode(raw); b != nil {
		return b.Bytes
	}
	return raw
}

func realVerifier(t *testing.T, caFiles []string) *Verifier {
	t.Helper()
	var bundles [][]byte
	for _, f := range caFiles {
		// A CA whose sample is restricted (realdata) only adds its
		// manufacturer's EKs, whose tests skip without it.
		p, ok := realdatapkg.Available(t, "tpm-ca", f)
		if !ok {
			continue
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		bundles = append(bundles, b)
	}
	roots, inters, err := LoadManufacturerCAs(bundles...)
	if err != nil {
		t.Fatalf("LoadManufacturerCAs: %v", err)
	}
	return newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters, Clock: clocktesting.NewFakePassiveClock(realVerifyTime)})
}

// checkRealEK runs what Verify runs on an evidence's EK certificate.
func checkRealEK(v *Verifier, der []byte) error {
	cert, err := parseEKCertificate(der)
	if err != nil {
		return err
	}
	return v.verifyEKCertificate(cert)
}

// TestRealEKCertificates verifies EK certificates from real TPMs (discrete,
// firmware and cloud vTPMs) against their manufacturers' real CAs, with the
// TCG SAN validated rather than ignored, and refuses the ones a TPM 2.0
// verifier must refuse, each with a reason that says why.
func TestRealEKCertificates(t *testing.T) {
	v := realVerifier(t, realBundle)

	accept := []string{
		"stm-st33htph-rsa-ek.pem",
		"stm-st33htph-ecc-ek.pem",
		"nuvoton-npct75x-rsa-ek.pem",
		"nuvoton-npct75x-rsa-ek.der",
		"infineon-slb9670-tpm20-rsa-ek.pem",
		"intel-ptt-spt-h-rsa-ek.pem",
		"amd-ftpm-ryzen5-5600x-prg-rn-ek.pem",
		"gce-uca_tpm_rsa_enc_cert.pem",
		"gce-uca_tpm_ecc_enc_cert.pem",
		// Google's EK/AK CA omits the TCG extended key usage and subject
		// alternative name, the one exception allowed (ekcert.go).
		"gce-pca_tpm_rsa_enc_cert.pem",
		"gce-pca_tpm_ecc_enc_cert.pem",
		"gce-shielded-vm-rsa-ek-salrashid123-attribute_certificate.pem",
		// An NV read returns the whole index: 1169 bytes of DER and 431
		// bytes of 0xFF. Verifiers must take the DER length, since that is
		// what TPMs hand out; only uniform 0xFF/0x00 filler is dropped.
		"stm-st33htph-rsa-ek-nvread-with-0xff-padding.der",
	}
	for _, f := range accept {
		t.Run("accept/"+f, func(t *testing.T) {
			if err := checkRealEK(v, readRealCert(t, realdatapkg.Path(t, "tpm-ek", f))); err != nil {
				t.Errorf("rejected: %v", err)
			}
		})
	}

	reject := []struct{ file, want string }{
		{"stm-st33zp24-tpm12-ek-ab21ccf2.pem", "SHA1-RSA"},
		{"stm-st33zp24-tpm12-ek-nuc1.pem", "TPM 1.2"},
		{"stm-st33zp24-tpm12-ek-nuc2.pem", "TPM 1.2"},
		{"infineon-slb9635-tpm12-ek.pem", "TPM 1.2"},
		{"nuvoton-npct6xx-ek.pem", "TPM 1.2"},
		{"nuvoton-npct6xx-ek-with-0x11-padding.der", "not 0xFF or 0x00 NV filler"},
		{"stm-st33zp24-tpm12-ek-nuc2-nvread-with-7byte-tcg-header.bin", "not a DER SEQUENCE"},
		{"infineon-slb9635-tpm12-ek-nvread-with-7byte-tcg-header.bin", "not a DER SEQUENCE"},
		// Not endorsement keys: GCE's vTPM signing key and Azure's AK.
		{"gce-uca_tpm_rsa_sign_cert.pem", "not an endorsement key"},
		{"gce-pca_tpm_ecc_sign_cert.pem", "not an endorsement key"},
		{"gce-pca_tpm_rsa_sign_cert.pem", "not an endorsement key"},
		{"azure-trustedlaunch-vtpm-ak-cert-0x01C101D0.pem", "tcg-kp-EKCertificate"},
		// Its GLK intermediate is nowhere to be had.
		{"intel-ptt-glk-ecc-ek.pem", "does not chain"},
	}
	for _, c := range reject {
		t.Run("reject/"+c.file, func(t *testing.T) {
			err := checkRealEK(v, readRealCert(t, realdatapkg.Path(t, "tpm-ek", c.file)))
			if err == nil {
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q does not say %q", err, c.want)
			}
		})
	}
}

// TestRealEKWrongManufacturer: a real STMicro EK is refused by a verifier
// that trusts only Infineon.
func TestRealEKWrongManufacturer(t *testing.T) {
	v := realVerifier(t, []string{"keylime-INF_RSA_010RT.pem", "intel-secl-infineon-optiga-rsa-mfr-ca-007.pem", "keylime-IFX_RSA_RT.pem"})
	err := checkRealEK(v, readRealCert(t, realdatapkg.Path(t, "tpm-ek", "stm-st33htph-rsa-ek.pem")))
	if err == nil || !strings.Contains(err.Error(), "does not chain to the manufacturer CA pool") {
		t.Fatalf("got %v, want a chain failure", err)
	}
	if err := checkRealEK(v, readRealCert(t, realdatapkg.Path(t, "tpm-ek", "infineon-slb9670-tpm20-rsa-ek.pem"))); err != nil {
		t.Fatalf("the Infineon EK should verify: %v", err)
	}
}

// TestRealEKExpiry: the chain is checked at the verifier's clock.
func TestRealEKExpiry(t *testing.T) {
	v := realVerifier(t, realBundle)
	v.clock = clocktesting.NewFakePassiveClock(time.Date(2029, 1, 1, 0, 0, 0, 0, time.UTC))
	err := checkRealEK(v, readRealCert(t, realdatapkg.Path(t, "tpm-ek", "stm-st33htph-rsa-ek.pem")))
	if err == nil || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("got %v, want expiry (the STM EK expires in July 2028)", err)
	}
}
