//go:build tpmsimulator

package bench

import (
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/binary"
	"encoding/pem"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/agent/csr"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// coldAttestors are the attestors BenchmarkColdPath measures.
var coldAttestors = []string{"insecure", "tpm", "aws", "azure", "gcp"}

// coldSwtpm is BenchmarkColdPath's side of the tpm attestor on a swtpm TPM
// (a process of its own, manufactured before the run, as a machine's TPM
// is) through the release binary: no simulator starts inside the measured
// process.
const coldSwtpm = "tpm-swtpm"

// coldSides are the sides BenchmarkColdPath can measure beside the
// baseline.
var coldSides = append(slices.Clone(coldAttestors), coldSwtpm)

// coldCompare is a node binary of another commit that BenchmarkColdPath
// runs as one more side, "<attestor>-compare", beside that attestor's: a
// before/after of a change to the cold path in one run.
var (
	coldCompare         = flag.String("cold-compare-binary", "", "BenchmarkColdPath: a kubelet-authenticator binary (e.g. built from an earlier commit) run as an extra side with the attestor of -cold-compare-attestor")
	coldCompareAttestor = flag.String("cold-compare-attestor", "insecure", "BenchmarkColdPath: the side whose node the -cold-compare-binary side joins as: insecure (a node of its own), or any side measured (-cold-attestors); for tpm the binary must be a test build, which links the simulator")
	coldOnly            = flag.String("cold-attestors", "", "BenchmarkColdPath: comma-separated sides to measure (default all: "+strings.Join(coldSides, ",")+"); the kubelet baseline always runs")
)

// kubeletSide names the baseline in BenchmarkColdPath's figures.
const kubeletSide = "kubelet-kcm"

// Join patterns of BenchmarkColdPath.
const (
	// spacedPause spaces single joins, as nodes booting one at a time into
	// an idle cluster.
	spacedPause = 200 * time.Millisecond
	// backToBack is how many joins each side runs back to back in turn.
	backToBack = 3
)

// BenchmarkColdPath obtains a certificate from nothing, the way a new node
// does, on both sides of one workload API server:
//
//   - kubelet-kcm, the baseline: kubelet's TLS bootstrap in process
//     (client-go's csr.RequestCertificate and WaitForCertificate, what
//     kubelet's bootstrap package runs, through a new client per join as
//     each kubelet process has one) approved and signed by an idle
//     kube-controller-manager running only csrapproving and csrsigning,
//     default flags;
//   - ours: a whole `kubelet-authenticator credential` process with an empty
//     cache (the release build; the test build for tpm, which links the
//     simulator), through the real node-attestation-controller (default flags),
//     with each attestor: insecure, tpm on the in-process simulator (two
//     CSRs: attestation, then the answer to the controller's challenge),
//     tpm on a swtpm TPM through the release binary (tpm-swtpm: the TPM a
//     process of its own, manufactured before the run, as a machine's is),
//     and aws, azure and gcp against their emulators.
//
// After one unmeasured join per side, one iteration runs, side after
// side, one spaced join (after a pause of
// spacedPause: a node booting into an idle cluster), then backToBack joins
// back to back per side; so the machine's load hits every side alike.
// Run it with -benchtime 30x. It reports each side's median and p99 per
// pattern, and the ratio of each attestor's median to the baseline's both
// ways (x-kubelet: ours / kubelet; kubelet-x: kubelet / ours), and the TPM
// commands one issuance sends (tpm-cmds/issuance, counted in process on
// the same attestor code over the simulator; tpm-cmd-ms/issuance is the
// time the simulator took to run them).
//
// With the simulator, each node process also starts a simulated TPM and
// provisions its EK certificate (a CreatePrimary of the RSA EK and NV
// writes) before attesting: a real TPM does not, and its commands are
// slower than the simulator's.
func BenchmarkColdPath(b *testing.B) {
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
		NoController: true,
		Attestors:    strings.Join(coldAttestors, ","),
	})
	// Machines are named machine-<node>; so are their DockerMachines.
	var infra []string
	for _, a := range append([]string{"insecure-compare"}, coldSides...) {
		infra = append(infra, "machine-cold-"+a)
	}
	env.Mgmt.ServeInfrastructure(b, env.Namespace, infra...)
	swtpmSock, swtpmCA := harness.StartSwtpm(b, nil)
	env.StartController(b,
		"--tpm-manufacturer-ca="+filepath.Join(caDir, tpmtest.BundleFile),
		"--tpm-manufacturer-ca="+swtpmCA,
		"--attestor-config="+clouds.AttestorConfig)
	autoApprove(b, env.Workload)
	startKCM(b, env.Workload, "kcm.log")
	bootCfg := restConfigFromFile(b, env.BootstrapKubeconfig)
	release := buildRelease(b, "../../cmd/kubelet-authenticator")
	ctx := context.Background()

	sides := []string{kubeletSide}
	joins := []func(i int) (time.Duration, error){func(i int) (time.Duration, error) {
		start := time.Now()
		err := kubeletJoin(ctx, bootCfg, nil, fmt.Sprintf("kcm-cold-%05d", i))
		return time.Since(start), err
	}}
	measured := coldSides
	if *coldOnly != "" {
		measured = strings.Split(*coldOnly, ",")
		for _, a := range measured {
			if !slices.Contains(coldSides, a) {
				b.Fatalf("-cold-attestors: unknown side %q (want some of %s)", a, strings.Join(coldSides, ","))
			}
		}
	}
	tpmConfig := func(seed int) string {
		return fmt.Sprintf("tpm:\n  device: simulator\n  simulator:\n    seed: %d\n    manufacturerCADir: %s\n", seed, caDir)
	}
	// tpmTimeline is the --verbose log of the last TPM join: where its
	// time went.
	var tpmTimeline string
	nodes := map[string]*scenario.Node{}
	for _, a := range measured {
		name := "cold-" + a
		var n *scenario.Node
		switch a {
		case "insecure":
			n = env.NewNode(b, name, "test:///fleet/"+name, a)
		case "tpm":
			n = env.NewNode(b, name, "test:///fleet/"+name, a, tpmConfig(7))
		case coldSwtpm:
			n = env.NewNode(b, name, "test:///fleet/"+name, "tpm", fmt.Sprintf("tpm:\n  device: unix://%s\n", swtpmSock))
		default:
			n = env.CloudNode(b, clouds, name, a)
		}
		env.Machine(b, n)
		nodes[a] = n
		sides = append(sides, a)
		joins = append(joins, func(int) (time.Duration, error) {
			if err := os.RemoveAll(n.CacheDir); err != nil {
				return 0, err
			}
			if a != "tpm" {
				// The node binary as released.
				start := time.Now()
				if _, _, err := credential(ctx, release, env, n); err != nil {
					return 0, fmt.Errorf("%s %w\ncontroller log:\n%s", a, err, harness.LastLines(env.ControllerLog(), 30))
				}
				return time.Since(start), nil
			}
			// The simulator is linked only into the test build.
			r := n.Credential(ctx, "--verbose")
			if r.Err != nil {
				return 0, fmt.Errorf("%s credential: %w\n%s\ncontroller log:\n%s", a, r.Err, r.Stderr, harness.LastLines(env.ControllerLog(), 30))
			}
			tpmTimeline = fmt.Sprintf("%s(whole process: %.1fms, ended %s)\nthe controller's log of it:\n%s", r.Stderr, ms(r.Took),
				time.Now().Format("15:04:05.000000"), harness.LastLines(env.ControllerLog(), 5))
			return r.Took, nil
		})
	}

	if *coldCompare != "" {
		var n *scenario.Node
		if *coldCompareAttestor == "insecure" {
			// A node of its own, named after its side, so that its CSRs
			// count as that side's in the signer's share.
			n = env.NewNode(b, "cold-insecure-compare", "test:///fleet/cold-insecure-compare", "insecure")
			env.Machine(b, n)
		} else if n = nodes[*coldCompareAttestor]; n == nil {
			// That side's node itself: the same TPM (simulated: its seed
			// decides how long its RSA EK takes to make) or cloud identity,
			// and the same Machine (trust on first use binds one EK to one
			// Machine).
			b.Fatalf("-cold-compare-attestor=%s needs that side (-cold-attestors)", *coldCompareAttestor)
		}
		side := *coldCompareAttestor + "-compare"
		sides = append(sides, side)
		joins = append(joins, func(int) (time.Duration, error) {
			if err := os.RemoveAll(n.CacheDir); err != nil {
				return 0, err
			}
			start := time.Now()
			if _, _, err := credential(ctx, *coldCompare, env, n); err != nil {
				return 0, fmt.Errorf("%s %w", side, err)
			}
			return time.Since(start), nil
		})
	}
	spaced := make([]sample, len(sides))
	b2b := make([]sample, len(sides))
	i := 0
	join := func(side int, into *sample) {
		i++
		took, err := joins[side](i)
		if err != nil {
			b.Fatalf("%s: %v", sides[side], err)
		}
		into.wall = append(into.wall, took)
	}
	// One join per side before the measured ones: the first run of a
	// binary just built (or of a code path in this process) pays for
	// loading it, ~100 ms here, which is no join's cost and, with 30
	// samples, would be every side's p99.
	for s := range sides {
		join(s, &sample{})
	}
	// The signer's share, per side (the node the CSR names): from the
	// CSR's creation event to its certificate's, measured joins only.
	var signerMu sync.Mutex
	signerShare := map[string]*sample{}
	stopWatch := watchIssued(b, env, func(csr *certificatesv1.CertificateSigningRequest, took time.Duration) {
		signerMu.Lock()
		defer signerMu.Unlock()
		side := coldSideOf(csr)
		s := signerShare[side]
		if s == nil {
			s = &sample{}
			signerShare[side] = s
		}
		s.wall = append(s.wall, took)
	}, nil)
	for b.Loop() {
		for s := range sides {
			b.StopTimer()
			time.Sleep(spacedPause)
			b.StartTimer()
			join(s, &spaced[s])
		}
		for s := range sides {
			for range backToBack {
				join(s, &b2b[s])
			}
		}
	}
	b.StopTimer()
	stopWatch()

	var table strings.Builder
	fmt.Fprintf(&table, "cold path, %d spaced joins (%s apart) and %d back to back per side, interleaved:\n", len(spaced[0].wall), spacedPause, len(b2b[0].wall))
	fmt.Fprintf(&table, "  %-16s %9s %9s %9s %9s   %10s %10s %10s %10s\n", "side", "spaced", "p99", "b2b", "p99", "x-kubelet", "kubelet-x", "x-kub b2b", "kub-x b2b")
	base, baseB2B := spaced[0].median(), b2b[0].median()
	for s, side := range sides {
		spaced[s].report(b, side+"-spaced-")
		b2b[s].report(b, side+"-b2b-")
		fmt.Fprintf(&table, "  %-16s %7.1fms %7.1fms %7.1fms %7.1fms", side,
			ms(spaced[s].median()), ms(spaced[s].p99()), ms(b2b[s].median()), ms(b2b[s].p99()))
		if s > 0 {
			r, rb := ratio(spaced[s].median(), base), ratio(b2b[s].median(), baseB2B)
			b.ReportMetric(r, side+"-spaced-x-kubelet")
			b.ReportMetric(rb, side+"-b2b-x-kubelet")
			fmt.Fprintf(&table, "   %9.2fx %9.2fx %9.2fx %9.2fx", r, 1/r, rb, 1/rb)
		}
		table.WriteString("\n")
	}
	table.WriteString("  signer's share of a join (CSR created to certificate, both patterns; tpm: the second CSR; a compare side on another side's node counts as that side):\n")
	for _, side := range sides {
		if s := signerShare[side]; s != nil && len(s.wall) > 0 {
			b.ReportMetric(ms(s.median()), side+"-signer-ms/median")
			fmt.Fprintf(&table, "    %-16s %7.1fms median, %7.1fms p99\n", side, ms(s.median()), ms(s.p99()))
		}
	}
	cmds := tpmIssuanceCommands(b, ca)
	b.ReportMetric(float64(cmds.total()), "tpm-cmds/issuance")
	b.ReportMetric(ms(cmds.took), "tpm-cmd-ms/issuance")
	fmt.Fprintf(&table, "TPM commands per issuance: %d (%s), %.1fms in the simulator",
		cmds.total(), cmds, ms(cmds.took))
	if tpmTimeline != "" {
		fmt.Fprintf(&table, "\nthe last TPM join, --verbose:\n%s", tpmTimeline)
	}
	fmt.Println(table.String())
}

// coldSideOf returns the side of BenchmarkColdPath a CSR belongs to, from
// the node its request names: kubelet's nodes are kcm-cold-<n>, each
// other side's node cold-<side>.
func coldSideOf(csr *certificatesv1.CertificateSigningRequest) string {
	b, _ := pem.Decode(csr.Spec.Request)
	if b == nil {
		return ""
	}
	req, err := x509.ParseCertificateRequest(b.Bytes)
	if err != nil {
		return ""
	}
	node := strings.TrimPrefix(req.Subject.CommonName, attestor.NodeUserPrefix)
	if strings.HasPrefix(node, "kcm-cold-") {
		return kubeletSide
	}
	side, _ := strings.CutPrefix(node, "cold-")
	return side
}

// ratio returns a / b.
func ratio(a, b time.Duration) float64 { return float64(a) / float64(b) }

// countingTPM counts the commands sent to a TPM, by command code.
type countingTPM struct {
	t     transport.TPM
	count map[tpm2.TPMCC]int
	took  time.Duration
	// spent is the simulator's time per command code.
	spent map[tpm2.TPMCC]time.Duration
}

func (c *countingTPM) Send(cmd []byte) ([]byte, error) {
	// TPM command header: tag (2 bytes), size (4), command code (4).
	var cc tpm2.TPMCC
	if len(cmd) >= 10 {
		cc = tpm2.TPMCC(binary.BigEndian.Uint32(cmd[6:10]))
		c.count[cc]++
	}
	start := time.Now()
	defer func() {
		took := time.Since(start)
		c.took += took
		c.spent[cc] += took
	}()
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
	tpm2.TPMCCQuote:              "Quote",
	tpm2.TPMCCPCRRead:            "PCR_Read",
	tpm2.TPMCCContextSave:        "ContextSave",
	tpm2.TPMCCContextLoad:        "ContextLoad",
}

// String lists the commands by code with the simulator's time for them,
// e.g. "CreatePrimary×2 9.1ms, Quote×1 1.2ms".
func (c *countingTPM) String() string {
	var parts []string
	for _, cc := range slices.Sorted(maps.Keys(c.count)) {
		name, ok := ccNames[cc]
		if !ok {
			name = fmt.Sprintf("0x%x", uint32(cc))
		}
		parts = append(parts, fmt.Sprintf("%s×%d %.1fms", name, c.count[cc], ms(c.spent[cc])))
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
	counter := &countingTPM{t: sim, count: map[tpm2.TPMCC]int{}, spent: map[tpm2.TPMCC]time.Duration{}}
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
