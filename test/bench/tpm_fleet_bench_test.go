//go:build tpmsimulator

package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"

	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/device"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// Size of BenchmarkFleetJoinTPM (go test ... -args -fleet-tpm-nodes=N).
var (
	fleetTPMNodes       = flag.Int("fleet-tpm-nodes", 32, "BenchmarkFleetJoinTPM: nodes that join, per side, each with its own swtpm")
	fleetTPMConcurrency = flag.Int("fleet-tpm-concurrency", 0, "BenchmarkFleetJoinTPM: nodes joining at the same time (default: -fleet-tpm-nodes, all at once)")
)

// BenchmarkFleetJoinTPM joins a fleet of TPM nodes: -fleet-tpm-nodes swtpm
// TPMs (harness.StartSwtpms: real libtpms processes on Unix sockets, their
// EK certificates issued by one manufacturer CA the controller trusts;
// provisioning is set-up, not measured), one Machine and node per TPM,
// -fleet-tpm-concurrency (all) at a time, on each side in turn on one
// workload API server, as BenchmarkFleetJoin does:
//
//   - kcm-tuned: kubelet's TLS bootstrap in process through
//     kube-controller-manager with its client rate limit lifted, as many
//     nodes;
//   - node-attestation-controller: each node a whole `kubelet-authenticator
//     credential --verbose` process (release build) with an empty cache,
//     the tpm attestor on its own swtpm: two CSRs (evidence, then the answer
//     to the controller's challenge), through the controller with its
//     default flags (but -fleet-controller-flags): the fleet's first join,
//     where the controller records each TPM's EK (trust on first use);
//   - node-attestation-controller-rejoin, from -benchtime 2x on: the same
//     nodes again, empty caches, each finding its EK's record.
//
// One iteration runs a burst of kcm-tuned and one of ours, the first the
// first join, later ones the rejoin; kcm-tuned's figures cover all its
// bursts. It reports each side's joins per second (first start to last
// certificate), median and p99 join latency, CPU per join of the nodes, of
// the signer and of the API servers and etcd of both clusters, and how busy
// the machine was; the swtpm processes' CPU per join; and where a TPM
// join's time goes: the signer's share of each round (from the
// CSR's creation to its challenge, and to its certificate, on a watch), the
// medians of the steps of the nodes' --verbose timelines, and the TPM
// commands of one more join of one node, alone, through a proxy that times
// them. It writes the plot of join latency to bin/fleet-join-tpm.svg.
func BenchmarkFleetJoinTPM(b *testing.B) {
	n, c := *fleetTPMNodes, *fleetTPMConcurrency
	if c <= 0 {
		c = n
	}
	start := time.Now()
	tpms := harness.StartSwtpms(b, n)
	b.Logf("%d swtpm TPMs manufactured and started in %s", n, time.Since(start).Round(time.Millisecond))

	env := scenario.Start(b, scenario.Options{NoController: true, Attestors: tpm.Name})
	name := func(i int) string { return fmt.Sprintf("tpm-fleet-%05d", i) }
	names := make([]string, n)
	for i := range names {
		names[i] = name(i)
	}
	env.Mgmt.ServeInfrastructure(b, env.Namespace, names...)
	// scenario's -v=2 overridden: the default. One vendor: one bundle.
	controller := env.StartController(b, append([]string{"-v=0", "--tpm-manufacturer-ca=" + tpms[0].Bundle}, strings.Fields(*fleetController)...)...)
	// The node binary as released (no simulator, no test attestors): it
	// talks to a TPM socket as to /dev/tpmrm0.
	plugin := buildRelease(b, "../../cmd/kubelet-authenticator")
	autoApprove(b, env.Workload)
	bootCfg := restConfigFromFile(b, env.BootstrapKubeconfig)

	providerID := func(i int) string { return "test:///fleet/" + name(i) }
	createMachines(b, env.Mgmt, env.Namespace, env.Cluster, n, name, providerID)
	nodes := make([]*scenario.Node, n)
	for i := range nodes {
		nodes[i] = env.NewNode(b, name(i), providerID(i), tpm.Name, "tpm:\n  device: unix://"+tpms[i].Sock+"\n")
	}
	swtpmCPU := func() time.Duration {
		var cpu time.Duration
		for _, t := range tpms {
			cpu += procCPU(b, t.Process.PID())
		}
		return cpu
	}

	tuned := &fleetSide{name: "kcm-tuned", color: "#1f77b4"}
	ours := &fleetSide{name: "node-attestation-controller", color: "#d62728"}
	rejoin := &fleetSide{name: "node-attestation-controller-rejoin", color: "#ff7f0e"}
	tpmCPU := map[*fleetSide]time.Duration{}
	for i := 0; b.Loop(); i++ {
		runKCMSide(b, env, bootCfg, tuned, n, c, name, kcmTunedArgs...)
		clearCSRs(b, env)
		b.StopTimer()
		for _, nd := range nodes {
			if err := os.RemoveAll(nd.CacheDir); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
		// The first iteration is the fleet's first join; later ones find
		// each TPM's trust-on-first-use record.
		side := ours
		if i > 0 {
			side = rejoin
		}
		before := swtpmCPU()
		runCredentialSide(b, env, plugin, controller.PID(), side, nodes, c, "--verbose")
		tpmCPU[side] += swtpmCPU() - before
		clearCSRs(b, env)
	}
	b.StopTimer()
	sides := []*fleetSide{tuned, ours}
	if len(rejoin.joins) > 0 {
		sides = append(sides, rejoin)
	}

	// One more join of node 0 alone, its TPM commands timed.
	cmds := timeTPMCommands(b, env, plugin, nodes[0], tpms[0].Sock)

	var table strings.Builder
	fmt.Fprintf(&table, "fleet join of TPM nodes, %d nodes (swtpm, one manufacturer CA) %d at a time per side:\n", n, c)
	reportFleet(b, &table, "joins/s", "joins/s", sides)
	tpmSides := sides[1:]
	for _, s := range tpmSides {
		key := strings.TrimPrefix(s.name, "node-attestation-")
		r := s.perSecond() / tuned.perSecond()
		b.ReportMetric(r, key+"-x-kcm-tuned")
		fmt.Fprintf(&table, "  %s / kcm-tuned throughput: %.2fx (kcm-tuned / %s: %.2fx)\n", key, r, key, 1/r)
		perJoin := tpmCPU[s] / time.Duration(len(s.joins))
		b.ReportMetric(ms(perJoin), key+"-swtpm-cpu-ms/join")
		fmt.Fprintf(&table, "  %s: swtpm CPU per join %.1fms (the node's own TPM; beside the node process's CPU above)\n", key, ms(perJoin))
	}

	for _, s := range tpmSides {
		key := strings.TrimPrefix(s.name, "node-attestation-")
		fmt.Fprintf(&table, "where a join's time goes, %s:\n", s.name)
		fmt.Fprintf(&table, "  the signer's share (API server watch, CSR created to):\n")
		for _, round := range []struct {
			what, key string
			s         *sample
		}{
			{"round 1: the challenge on CSR #1", "round1", &s.challenged},
			{"round 2: the certificate on CSR #2", "round2", &s.server},
		} {
			if len(round.s.wall) == 0 {
				b.Fatalf("%s: no %s seen", s.name, round.what)
			}
			b.ReportMetric(ms(round.s.median()), key+"-signer-"+round.key+"-ms/median")
			fmt.Fprintf(&table, "    %-38s %7.1fms median %7.1fms p99 (%d CSRs)\n", round.what, ms(round.s.median()), ms(round.s.p99()), len(round.s.wall))
		}
		fmt.Fprintf(&table, "  the nodes' --verbose timelines, median of each step over %d joins (medians do not add up to the median join):\n", len(s.joins))
		for _, st := range timelineSteps(b, s) {
			b.ReportMetric(ms(st.s.median()), key+"-node-"+st.key+"-ms/median")
			fmt.Fprintf(&table, "    %-62s %7.1fms median %7.1fms p99\n", st.what, ms(st.s.median()), ms(st.s.p99()))
		}
	}
	b.ReportMetric(float64(cmds.total()), "tpm-cmds/join")
	b.ReportMetric(ms(cmds.took), "tpm-cmd-ms/join")
	fmt.Fprintf(&table, "  TPM commands of one more join of %s alone, on its swtpm through a timing proxy: %d, %.1fms (%s)\n",
		nodes[0].Name, cmds.total(), ms(cmds.took), cmds)
	median := medianJoin(ours)
	fmt.Fprintf(&table, "  the median first join (%.1fms), --verbose:\n%s", ms(ours.joins[median].took), indent(ours.stderr[median], "    "))
	table.WriteString(writeFleetFiles(b, env, "", "fleet-join-tpm.svg", n, c, sides))
	fmt.Println(table.String())
}

// timelineStep is one step of a TPM join, its duration in each join.
type timelineStep struct {
	what, key string
	s         sample
}

// The --verbose lines of a join (agent/credential), each with its time
// since the attestation started.
var (
	reAttested   = stepLine("Attested")
	reFiled      = stepLine("Filed the certificate signing request")
	reChallenged = stepLine("Challenged")
	reAnswered   = stepLine("Answered the challenge")
	reFiled2     = stepLine("Filed the answer to the challenge")
	reDecided    = stepLine("The signer decided")
)

// stepLine matches the klog text line of the step msg and captures its
// elapsed value.
func stepLine(msg string) *regexp.Regexp {
	return regexp.MustCompile(`\] "` + regexp.QuoteMeta(msg) + `" .*\belapsed="([^"]+)"`)
}

// timelineSteps splits each join of side into the steps its --verbose
// timeline shows: the TPM's work, each request, each round of the signer as
// the node sees it (its watch), and the rest of the process.
func timelineSteps(b *testing.B, side *fleetSide) []*timelineStep {
	b.Helper()
	steps := []*timelineStep{
		{what: "attest: EK, AK, quote on swtpm", key: "attest"},
		{what: "create CSR #1 (TLS handshake, the request)", key: "create1"},
		{what: "signer's round 1 until the node's watch sees the challenge", key: "round1"},
		{what: "ActivateCredential on swtpm", key: "activate"},
		{what: "create CSR #2", key: "create2"},
		{what: "signer's round 2 until the node's watch sees the certificate", key: "round2"},
		{what: "the rest: process start, config, lock, key; store, output", key: "rest"},
	}
	for i, out := range side.stderr {
		// The last of each line: a join that filed anew is timed by its
		// last attempt, and the rest holds the others.
		at := func(re *regexp.Regexp) time.Duration {
			var d time.Duration
			found := false
			for _, line := range strings.Split(out, "\n") {
				if m := re.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
					v, err := time.ParseDuration(m[1])
					if err != nil {
						b.Fatalf("join %d: %q: %v", i, line, err)
					}
					d, found = v, true
				}
			}
			if !found {
				b.Fatalf("join %d: no line matching %s in its --verbose output:\n%s", i, re, out)
			}
			return d
		}
		marks := []time.Duration{0, at(reAttested), at(reFiled), at(reChallenged), at(reAnswered), at(reFiled2), at(reDecided)}
		for s := range len(marks) - 1 {
			steps[s].s.wall = append(steps[s].s.wall, marks[s+1]-marks[s])
		}
		steps[len(steps)-1].s.wall = append(steps[len(steps)-1].s.wall, side.joins[i].took-marks[len(marks)-1])
	}
	return steps
}

// medianJoin returns the index of side's join of median latency.
func medianJoin(side *fleetSide) int {
	idx := make([]int, len(side.joins))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int { return int(side.joins[a].took - side.joins[b].took) })
	return idx[len(idx)/2]
}

func indent(s, prefix string) string {
	var out strings.Builder
	for _, line := range strings.Split(strings.TrimRight(s, "\n"), "\n") {
		out.WriteString(prefix + line + "\n")
	}
	return out.String()
}

// timeTPMCommands joins node n once more (empty cache, the same Machine
// and TPM) with its TPM behind a proxy that times each command
// (countingTPM) on the way to the swtpm at sock, and returns the counts
// and times.
func timeTPMCommands(b *testing.B, env *scenario.Env, bin string, n *scenario.Node, sock string) *countingTPM {
	b.Helper()
	dir := b.TempDir()
	proxySock := filepath.Join(dir, "tpm-proxy.sock")
	l, err := net.Listen("unix", proxySock)
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	counter := &countingTPM{count: map[tpm2.TPMCC]int{}, spent: map[tpm2.TPMCC]time.Duration{}}
	served := make(chan error, 1)
	go func() { served <- proxyTPM(l, sock, counter) }()

	cfg, err := os.ReadFile(n.ConfigPath)
	if err != nil {
		b.Fatal(err)
	}
	via := *n
	via.ConfigPath = filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(via.ConfigPath, []byte(strings.ReplaceAll(string(cfg), "unix://"+sock, "unix://"+proxySock)), 0o600); err != nil {
		b.Fatal(err)
	}
	if err := os.RemoveAll(n.CacheDir); err != nil {
		b.Fatal(err)
	}
	if _, out, err := credential(context.Background(), bin, env, &via); err != nil {
		b.Fatalf("%v\n%s", err, out)
	}
	l.Close()
	if err := <-served; err != nil {
		b.Fatal(err)
	}
	if counter.total() == 0 {
		b.Fatal("the node sent its TPM no command through the proxy")
	}
	return counter
}

// proxyTPM serves the connections l accepts, one at a time as swtpm does,
// each over a connection of its own to the swtpm at sock, sending every
// command through counter, until l is closed.
func proxyTPM(l net.Listener, sock string, counter *countingTPM) error {
	for {
		conn, err := l.Accept()
		if errors.Is(err, net.ErrClosed) {
			return nil
		}
		if err != nil {
			return err
		}
		t, err := device.Open("unix://" + sock)
		if err != nil {
			conn.Close()
			return err
		}
		counter.t = t
		err = proxyCommands(conn, counter)
		conn.Close()
		t.Close()
		if err != nil {
			return err
		}
	}
}

// proxyCommands reads TPM commands from conn (each sized by its header),
// sends them to t and writes back the responses, until conn is closed.
func proxyCommands(conn net.Conn, t *countingTPM) error {
	for {
		cmd, err := device.ReadMessage(conn)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("unable to read a TPM command: %w", err)
		}
		rsp, err := t.Send(cmd)
		if err != nil {
			return err
		}
		if _, err := conn.Write(rsp); err != nil {
			return fmt.Errorf("unable to write a TPM response: %w", err)
		}
	}
}
