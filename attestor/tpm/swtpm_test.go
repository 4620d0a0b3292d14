package tpm

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/utils/clock"

	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/device"
)

// startSwtpm manufactures a swtpm (libtpms) TPM with test/tools/
// swtpm-provision.sh, whose EK certificates chain to a self-made
// manufacturer CA, and runs it as a socket TPM in a temporary directory. It
// returns the socket address and the CA bundle. A missing swtpm is a
// failure: CI installs it (test/tools/apt-packages.txt).
func startSwtpm(t *testing.T) (addr string, bundle []byte) {
	t.Helper()
	for _, tool := range []string{"swtpm", "swtpm_setup", "swtpm_localca"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found: install the packages in test/tools/apt-packages.txt (apt-get install swtpm swtpm-tools)", tool)
		}
	}
	dir := t.TempDir()
	out, err := exec.Command(filepath.Join(repoRoot(t), "test", "tools", "swtpm-provision.sh"), dir).CombinedOutput()
	if err != nil {
		t.Fatalf("swtpm-provision.sh: %v\n%s", err, out)
	}
	sock := filepath.Join(dir, "tpm.sock")
	cmd := exec.Command("swtpm", "socket", "--tpm2",
		"--tpmstate", "dir="+filepath.Join(dir, "state"),
		"--server", "type=unixio,path="+sock,
		"--ctrl", "type=unixio,path="+filepath.Join(dir, "ctrl.sock"),
		"--flags", "not-need-init,startup-clear")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	// The socket file appears before swtpm listens on it: wait until it
	// answers a connection.
	for deadline := time.Now().Add(10 * time.Second); ; {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("swtpm did not listen on its socket")
		}
		time.Sleep(20 * time.Millisecond)
	}
	bundle, err = os.ReadFile(filepath.Join(dir, "manufacturer-ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	return "unix://" + sock, bundle
}

// TestSwtpmRoundTrip is the conformance round trip against swtpm, a second,
// independent TPM implementation, over its socket, with the EK certificate
// swtpm_setup provisioned: once with the RSA EK (policy-authorized) and once
// with the ECC P-384 EK (high-range template). swtpm has no resource
// manager, so a leaked handle would stay visible: none may.
func TestSwtpmRoundTrip(t *testing.T) {
	addr, bundle := startSwtpm(t)
	roots, inters, err := LoadManufacturerCAs(bundle)
	if err != nil {
		t.Fatal(err)
	}
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters, Clock: clock.RealClock{}})

	probe, err := device.Open(addr)
	if err != nil {
		t.Fatal(err)
	}
	before := transientHandles(t, probe)
	probe.Close()

	for _, kind := range []EKKind{EKRSA2048, EKECCP384} {
		t.Run(string(kind), func(t *testing.T) {
			node, err := NewAttestor(func() (transport.TPMCloser, error) { return device.Open(addr) }, kind)
			if err != nil {
				t.Fatal(err)
			}
			id := roundTrip(t, node, v, nil)

			// The identity is the EK swtpm_setup certified.
			ekDir := filepath.Join(filepath.Dir(addr[len("unix://"):]), "ek")
			file := map[EKKind]string{EKRSA2048: "ek-rsa2048.crt", EKECCP384: "ek-secp384r1.crt"}[kind]
			raw, err := os.ReadFile(filepath.Join(ekDir, file))
			if err != nil {
				t.Fatal(err)
			}
			if b, _ := pem.Decode(raw); b != nil {
				raw = b.Bytes
			}
			cert, err := x509.ParseCertificate(raw)
			if err != nil {
				t.Fatal(err)
			}
			// swtpm_localca issues EK certificates with every field of
			// the TCG profile: no exception is needed for them.
			if errs := checkEKProfile(cert, checkTCGSubjectAltName(cert), nil); len(errs) != 0 {
				t.Errorf("swtpm's %s EK certificate lacks fields of the TCG profile: %v", kind, errs)
			}
			spki, _ := x509.MarshalPKIXPublicKey(cert.PublicKey)
			if id.Stable != StableIdentity(spki) {
				t.Errorf("stable identity %s, want the %s EK's %s", id.Stable, kind, StableIdentity(spki))
			}
		})
	}

	// swtpm-provision.sh allocates the SHA-256 bank only: quoting another
	// is an error on the node, not a quote of nothing.
	node, err := New(func() (transport.TPMCloser, error) { return device.Open(addr) }, AttestorConfig{PCRBank: "sha384"})
	if err != nil {
		t.Fatal(err)
	}
	_, csr := csrFor(t, newKey(t), testNode, testProviderID)
	if _, err := node.Attest(context.Background(), &attestor.Request{Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo}); err == nil || !strings.Contains(err.Error(), "allocated") {
		t.Errorf("quoting an unallocated bank gave %v, want an error", err)
	}

	probe, err = device.Open(addr)
	if err != nil {
		t.Fatal(err)
	}
	defer probe.Close()
	if after := transientHandles(t, probe); !slices.Equal(before, after) {
		t.Errorf("transient handles before %v, after %v: the attestor leaks", before, after)
	}
}

// connectionPerCommand is a transport.TPM that opens swtpm's socket for
// each command: swtpm serves one connection at a time, and the node
// attestor opens its own.
type connectionPerCommand string

func (addr connectionPerCommand) Send(cmd []byte) ([]byte, error) {
	tp, err := device.Open(string(addr))
	if err != nil {
		return nil, err
	}
	defer tp.Close()
	return tp.Send(cmd)
}

// TestSwtpmBootState: boot-state attestation end to end on swtpm (libtpms),
// a fresh swtpm per boot, its SHA-256 PCRs extended with real machines'
// boots.
func TestSwtpmBootState(t *testing.T) {
	runBootScenarios(t, func(t *testing.T) bootedTPM {
		addr, _ := startSwtpm(t)
		return bootedTPM{tpm: connectionPerCommand(addr), open: func() (transport.TPMCloser, error) { return device.Open(addr) }}
	})
}
