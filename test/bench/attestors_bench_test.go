//go:build tpmsimulator

package bench

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/agent/csr"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// coldAttestors are the attestors BenchmarkColdIssuance compares, the
// baseline first.
var coldAttestors = []string{"insecure", "tpm", "aws", "azure", "gcp"}

// issuancePause spaces BenchmarkColdIssuance's issuances. The controller's
// management-cluster client is throttled client-side (client-go's default
// 5 requests/s, burst 10) and every decision reads trust-on-first-use
// records through it: back to back, the issuances drain the burst and every
// later decision waits for a token (a 200 ms grid). Spaced, each issuance
// sees what one node booting into an idle fleet sees.
const issuancePause = 700 * time.Millisecond

// BenchmarkColdIssuance obtains a certificate from nothing (empty cache,
// whole `kubelet-authenticator credential` process, through the real API
// server and the real controller) with each attestor: insecure (the
// baseline: no evidence checked), tpm on the in-process simulator (two CSRs:
// attestation, then the answer to the controller's challenge), and aws,
// azure and gcp against their emulators. One iteration is one issuance per
// attestor, in turn, so all see the same machine load (spaced by
// issuancePause: this measures a node's latency, not the controller's
// throughput); run it with -benchtime 50x. It reports each attestor's median and p99 wall time and
// the TPM commands one issuance sends (tpm-cmds/issuance, counted in
// process on the same attestor code over the simulator; tpm-cmd-ms/issuance
// is the time the simulator took to run them).
//
// With the simulator, each node process also starts a simulated TPM and
// provisions its EK certificate (a CreatePrimary of the RSA EK and NV
// writes) before attesting: a real TPM does not, and its commands are
// slower than the simulator's.
func BenchmarkColdIssuance(b *testing.B) {
	caDir := b.TempDir()
	ca, err := tpmtest.NewManufacturerCA("Bench TPM Manufacturer", time.Now().Add(-time.Hour))
	if err != nil {
		b.Fatal(err)
	}
	if err := ca.Save(caDir); err != nil {
		b.Fatal(err)
	}
	clouds := scenario.StartClouds(b, "cold-gcp")
	env := scenario.Start(b, scenario.Options{
		Attestors: strings.Join(coldAttestors, ","),
		ControllerArgs: []string{
			"--tpm-manufacturer-ca=" + filepath.Join(caDir, tpmtest.BundleFile),
			"--attestor-config=" + clouds.AttestorConfig,
		},
	})
	nodes := make([]*scenario.Node, len(coldAttestors))
	for i, a := range coldAttestors {
		name := "cold-" + a
		switch a {
		case "insecure":
			nodes[i] = env.NewNode(b, name, "test:///fleet/"+name, a)
		case "tpm":
			nodes[i] = env.NewNode(b, name, "test:///fleet/"+name, a,
				fmt.Sprintf("tpm:\n  device: simulator\n  simulator:\n    seed: 7\n    manufacturerCADir: %s\n", caDir))
		default:
			nodes[i] = env.CloudNode(b, clouds, name, a)
		}
		env.Machine(b, nodes[i])
	}

	ctx := context.Background()
	samples := make([]sample, len(nodes))
	for b.Loop() {
		for i, n := range nodes {
			b.StopTimer()
			time.Sleep(issuancePause)
			b.StartTimer()
			if err := os.RemoveAll(n.CacheDir); err != nil {
				b.Fatal(err)
			}
			r := n.Credential(ctx)
			if r.Err != nil {
				b.Fatalf("%s credential: %v\n%s\ncontroller log:\n%s", coldAttestors[i], r.Err, r.Stderr, lastLines(env.ControllerLog(), 30))
			}
			samples[i].wall = append(samples[i].wall, r.Took)
		}
	}
	b.StopTimer()

	var table strings.Builder
	fmt.Fprintf(&table, "cold issuance over %d runs each:\n  %-9s %10s %10s\n", len(samples[0].wall), "attestor", "median", "p99")
	for i, a := range coldAttestors {
		samples[i].report(b, a+"-")
		fmt.Fprintf(&table, "  %-9s %8.1fms %8.1fms\n", a, ms(samples[i].median()), ms(samples[i].p99()))
	}
	cmds := tpmIssuanceCommands(b, ca)
	b.ReportMetric(float64(cmds.total()), "tpm-cmds/issuance")
	b.ReportMetric(ms(cmds.took), "tpm-cmd-ms/issuance")
	fmt.Fprintf(&table, "TPM commands per issuance: %d (%s), %.1fms in the simulator",
		cmds.total(), cmds, ms(cmds.took))
	b.Log(table.String())
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// countingTPM counts the commands sent to a TPM, by command code.
type countingTPM struct {
	t     transport.TPM
	count map[tpm2.TPMCC]int
	took  time.Duration
}

func (c *countingTPM) Send(cmd []byte) ([]byte, error) {
	// TPM command header: tag (2 bytes), size (4), command code (4).
	if len(cmd) >= 10 {
		c.count[tpm2.TPMCC(binary.BigEndian.Uint32(cmd[6:10]))]++
	}
	start := time.Now()
	defer func() { c.took += time.Since(start) }()
	return c.t.Send(cmd)
}

func (c *countingTPM) total() int {
	n := 0
	for _, v := range c.count {
		n += v
	}
	return n
}

var ccNames = map[tpm2.TPMCC]string{
	tpm2.TPMCCCreatePrimary:      "CreatePrimary",
	tpm2.TPMCCFlushContext:       "FlushContext",
	tpm2.TPMCCNVRead:             "NV_Read",
	tpm2.TPMCCNVReadPublic:       "NV_ReadPublic",
	tpm2.TPMCCGetCapability:      "GetCapability",
	tpm2.TPMCCReadPublic:         "ReadPublic",
	tpm2.TPMCCLoadExternal:       "LoadExternal",
	tpm2.TPMCCCertify:            "Certify",
	tpm2.TPMCCActivateCredential: "ActivateCredential",
	tpm2.TPMCCStartAuthSession:   "StartAuthSession",
	tpm2.TPMCCPolicySecret:       "PolicySecret",
}

// String lists the commands by code, e.g. "CreatePrimary×4, Certify×1".
func (c *countingTPM) String() string {
	var parts []string
	for _, cc := range slices.Sorted(maps.Keys(c.count)) {
		name, ok := ccNames[cc]
		if !ok {
			name = fmt.Sprintf("0x%x", uint32(cc))
		}
		parts = append(parts, fmt.Sprintf("%s×%d", name, c.count[cc]))
	}
	return strings.Join(parts, ", ")
}

// tpmIssuanceCommands runs one TPM issuance in process, the node's Attest
// and Respond against a counting transport over the simulator provisioned
// by ca, with the signer's verifier making the challenge and accepting the
// answer in between, and returns the count of the node's commands (the
// simulator's own provisioning excluded).
func tpmIssuanceCommands(b *testing.B, ca *tpmtest.ManufacturerCA) *countingTPM {
	b.Helper()
	ctx := context.Background()
	sim, err := tpmsim.OpenProvisioned(8, ca)
	if err != nil {
		b.Fatal(err)
	}
	defer sim.Close()
	counter := &countingTPM{t: sim, count: map[tpm2.TPMCC]int{}}
	node, err := tpm.NewAttestor(func() (transport.TPMCloser, error) { return tpmsim.NopCloser(counter), nil })
	if err != nil {
		b.Fatal(err)
	}
	roots, inters := ca.Pools()
	hmacKey := make([]byte, 32)
	_, _ = rand.Read(hmacKey)
	verifier, err := tpm.NewVerifier(tpm.VerifierConfig{Roots: roots, Intermediates: inters, HMACKey: hmacKey})
	if err != nil {
		b.Fatal(err)
	}

	const nodeName, providerID, requester = "count-1", "test:///fleet/count-1", "system:bootstrap:abcdef"
	key, err := csr.GenerateKey()
	if err != nil {
		b.Fatal(err)
	}
	spki, err := csr.SPKI(key)
	if err != nil {
		b.Fatal(err)
	}
	pkcs10, err := csr.PKCS10(key, nodeName, providerID)
	if err != nil {
		b.Fatal(err)
	}
	req := &attestor.Request{NodeName: nodeName, ProviderID: providerID, Binding: attestor.Binding(spki), SPKI: spki}
	// verify hands the verifier one request's evidence the way the signer's
	// engine does; round is the challenged first request, for an answer.
	verify := func(uid string, att *attestor.Attestation, round *attestor.Round) (*attestor.Result, *attestor.Round) {
		b.Helper()
		request, err := attestor.EncodeRequest(pkcs10, tpm.Name, att.Evidence)
		if err != nil {
			b.Fatal(err)
		}
		parsed, err := attestor.ParseRequest(request)
		if err != nil {
			b.Fatal(err)
		}
		res, err := verifier.Verify(ctx, &attestor.VerifyRequest{
			Evidence: parsed.Evidence, Version: parsed.Version, Binding: attestor.Binding(parsed.CSR.RawSubjectPublicKeyInfo),
			CSR: parsed.CSR, NodeName: nodeName, ProviderID: providerID, UID: uid,
			Annotations: att.Annotations, Answered: round,
		})
		if err != nil {
			b.Fatalf("verify %s: %v", uid, err)
		}
		return res, &attestor.Round{Name: "csr-1", UID: uid, CSR: parsed.CSR, Evidence: parsed.Evidence, Version: parsed.Version, Annotations: att.Annotations}
	}

	att, err := node.Attest(ctx, req)
	if err != nil {
		b.Fatal(err)
	}
	res, first := verify("uid-csr-1", att, nil)
	if res.Challenge == nil {
		b.Fatal("CSR #1 was not challenged")
	}
	first.Challenge = res.Challenge
	answer, err := node.Respond(ctx, req, &attestor.Challenge{CSRName: "csr-1", CSRUID: "uid-csr-1", Data: res.Challenge.Data})
	if err != nil {
		b.Fatal(err)
	}
	if res, _ := verify("uid-csr-2", answer, nil); res.Answers != "csr-1" {
		b.Fatalf("CSR #2 answers %q, want csr-1", res.Answers)
	}
	if res, _ := verify("uid-csr-2", answer, first); res.Identity == nil {
		b.Fatal("CSR #2 proved no identity")
	}
	return counter
}
