//go:build tpmsimulator

package bench

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// bootLogName is the real machine's boot the TPM benchmarks' swtpm PCRs
// hold: go-tpm-tools' RHEL 8 UEFI machine with Secure Boot (34 KB log).
const bootLogName = "rhel8-uefi.bin"

// BenchmarkTPMBootState measures what boot state adds to a cold TPM
// issuance (empty cache to certificate: a whole `kubelet-authenticator
// credential` process, both rounds of credential activation, through the
// real API server and the real controller), on swtpm TPMs whose PCRs hold a
// real machine's boot (bootLogName extended into them):
//
//   - quote: TPM evidence v4 with the quote only (noEventLog), no policy;
//   - quote+log: the same with the machine's event log (deflated), which the
//     controller replays against the quoted PCRs;
//   - quote+log+policy: the same under the Cluster's golden policy for that
//     boot (what tpm-boot-policy prints): replay, then every rule.
//
// quote and quote+log alternate within each iteration, taking turns to go
// first, so they see the same load, each iteration ending with kubelet's
// TLS bootstrap through kube-controller-manager (the baseline of
// BenchmarkColdPath). quote+log+policy runs as many times after them, each
// followed by kubelet's bootstrap again: a Cluster with that policy denies
// the node without a log, so the policy is set and the controller
// restarted in between, and its ratio to quote is taken through the
// kubelet baseline measured beside each. Each node issues once before it
// is measured (trust on first use, informers). It reports each way's
// median and p99, the ratio of medians to quote and to kubelet's
// bootstrap, and the evidence size of CSR #1.
// Run it with -benchtime 20x.
func BenchmarkTPMBootState(b *testing.B) {
	path, err := tpmtest.RealEventLogPath(bootLogName)
	if err != nil {
		b.Fatal(err)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		b.Fatal(err)
	}
	policy, st, err := tpm.GoldenPolicy(raw, tpm.GoldenOptions{})
	if err != nil {
		b.Fatal(err)
	}
	quoteSock, quoteCA := harness.StartSwtpm(b, raw)
	logSock, logCA := harness.StartSwtpm(b, raw)
	args := []string{"--tpm-manufacturer-ca=" + quoteCA, "--tpm-manufacturer-ca=" + logCA}
	env := scenario.Start(b, scenario.Options{Attestors: tpm.Name, ControllerArgs: args})

	quote := env.NewNode(b, "boot-quote", "test:///fleet/boot-quote", tpm.Name, "tpm:\n  device: unix://"+quoteSock+"\n  noEventLog: true\n")
	withLog := env.NewNode(b, "boot-log", "test:///fleet/boot-log", tpm.Name, "tpm:\n  device: unix://"+logSock+"\n  eventLogPath: "+path+"\n")
	env.Machine(b, quote)
	env.Machine(b, withLog)
	autoApprove(b, env.Workload)
	startKCM(b, env.Workload, "kcm.log")
	bootCfg := restConfigFromFile(b, env.BootstrapKubeconfig)

	ctx := context.Background()
	kubelet := func(s *sample) {
		b.Helper()
		b.StopTimer()
		time.Sleep(spacedPause)
		b.StartTimer()
		start := time.Now()
		if err := kubeletJoin(ctx, bootCfg, nil, fmt.Sprintf("kcm-boot-%05d", len(s.wall))); err != nil {
			b.Fatal(err)
		}
		s.wall = append(s.wall, time.Since(start))
	}
	issue := func(n *scenario.Node) time.Duration {
		b.Helper()
		b.StopTimer()
		time.Sleep(spacedPause)
		if err := os.RemoveAll(n.CacheDir); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		r := n.Credential(ctx)
		if r.Err != nil {
			b.Fatalf("%s credential: %v\n%s\ncontroller log:\n%s", n.Name, r.Err, r.Stderr, harness.LastLines(env.ControllerLog(), 30))
		}
		return r.Took
	}
	issue(quote)
	issue(withLog)
	var quoteS, logS, policyS, kubeletS, kubeletPolicyS sample
	for i := 0; b.Loop(); i++ {
		// Take turns going first.
		if i%2 == 0 {
			quoteS.wall = append(quoteS.wall, issue(quote))
			logS.wall = append(logS.wall, issue(withLog))
		} else {
			logS.wall = append(logS.wall, issue(withLog))
			quoteS.wall = append(quoteS.wall, issue(quote))
		}
		kubelet(&kubeletS)
	}
	b.StopTimer()
	quoteBytes, logBytes := firstEvidenceSize(b, env, quote.Name), firstEvidenceSize(b, env, withLog.Name)

	env.AnnotateCluster(b, "kubelet-authenticator.x-k8s.io/tpm-policy", string(policy.YAML(st)))
	env.StopController()
	env.StartController(b, args...)
	issue(withLog)
	for range len(logS.wall) {
		policyS.wall = append(policyS.wall, issue(withLog))
		kubelet(&kubeletPolicyS)
	}
	b.StopTimer()

	// The policy's runs come after the others, so their ratio to the quote
	// is taken through kubelet's bootstrap, measured beside each: the
	// policy's ratio to its kubelet over the quote's ratio to its own.
	kubeletMedian := func(s *sample) float64 {
		if s == &policyS {
			return float64(kubeletPolicyS.median())
		}
		return float64(kubeletS.median())
	}
	var table strings.Builder
	fmt.Fprintf(&table, "cold TPM issuance on swtpm booted as %s, %d runs each, kubelet's bootstrap beside them (%.1f ms; %.1f ms beside the policy's runs):\n  %-17s %10s %10s %8s %9s %16s\n",
		bootLogName, len(quoteS.wall), ms(kubeletS.median()), ms(kubeletPolicyS.median()), "evidence", "median", "p99", "×quote", "×kubelet", "CSR #1 evidence")
	kubeletS.report(b, "kubelet-")
	kubeletPolicyS.report(b, "kubelet-policy-")
	quoteRatio := float64(quoteS.median()) / float64(kubeletS.median())
	for _, w := range []struct {
		name   string
		s      *sample
		prefix string
		bytes  int
	}{
		{"quote", &quoteS, "quote-", quoteBytes},
		{"quote+log", &logS, "quote-log-", logBytes},
		{"quote+log+policy", &policyS, "quote-log-policy-", logBytes},
	} {
		w.s.report(b, w.prefix)
		toKubelet := float64(w.s.median()) / kubeletMedian(w.s)
		ratio := toKubelet / quoteRatio
		if w.name != "quote" {
			b.ReportMetric(ratio, w.prefix+"x-quote")
		}
		b.ReportMetric(toKubelet, w.prefix+"x-kubelet")
		b.ReportMetric(float64(w.bytes), w.prefix+"evidence-bytes")
		fmt.Fprintf(&table, "  %-17s %8.1fms %8.1fms %8.2f %9.2f %14.1fKiB\n", w.name, ms(w.s.median()), ms(w.s.p99()), ratio, toKubelet, float64(w.bytes)/1024)
	}
	b.Log(table.String())
}

// firstEvidenceSize returns the size of the evidence (the decoded
// attestation data block) of a TPM node's last CSR #1.
func firstEvidenceSize(b *testing.B, env *scenario.Env, node string) int {
	b.Helper()
	list, err := env.Workload.Client.CertificatesV1().CertificateSigningRequests().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		b.Fatal(err)
	}
	size := 0
	for _, c := range list.Items {
		r, err := attestor.ParseRequest(c.Spec.Request)
		if err != nil || r.CSR.Subject.CommonName != attestor.NodeUserPrefix+node {
			continue
		}
		if ev, err := tpm.DecodeEvidence(r.Evidence); err == nil && ev.Attestation != nil {
			size = len(r.Evidence)
		}
	}
	if size == 0 {
		b.Fatalf("node %s filed no attestation", node)
	}
	return size
}
