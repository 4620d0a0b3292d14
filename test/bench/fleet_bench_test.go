package bench

import (
	"context"
	"encoding/base64"
	"flag"
	"fmt"
	"html"
	"io"
	"maps"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// Size of BenchmarkFleetJoin (go test ... -args -fleet-nodes=N). The
// documented run is 1,000 nodes, 50 at a time.
var (
	fleetNodes       = flag.Int("fleet-nodes", 1000, "BenchmarkFleetJoin: nodes that join, per side")
	fleetConcurrency = flag.Int("fleet-concurrency", 50, "BenchmarkFleetJoin: nodes joining at the same time")
	fleetController  = flag.String("fleet-controller-flags", "", "BenchmarkFleetJoin, BenchmarkFleetJoinTPM: extra flags of the controller, space-separated (default: none, the controller's defaults)")
	fleetKCMDefault  = flag.Bool("fleet-kcm-default", true, "BenchmarkFleetJoin: also run the default kube-controller-manager side (the slowest)")
	fleetProcess     = flag.Bool("fleet-process", true, "BenchmarkFleetJoin: also run the controller's side with a whole credential process per node (the slowest of the controller's sides)")
	fleetInProcess   = flag.Bool("fleet-in-process", true, "BenchmarkFleetJoin: also run the controller's side with the nodes' credential code in the benchmark's process, as kubelet's bootstrap runs for kube-controller-manager")
	fleetPlot        = flag.String("fleet-plot", "", "BenchmarkFleetJoin: where to write the SVG plot of join latency (default bin/fleet-join.svg in the repository)")
	fleetProfile     = flag.String("fleet-profile", "", "BenchmarkFleetJoin: write a CPU profile of the controller during each of its sides' join (-fleet-profile-seconds), and one of what it allocated meanwhile, to this path with the side's name (and -allocs) added before the extension")
	fleetAPIProfile  = flag.String("fleet-api-profile", "", "BenchmarkFleetJoin: write a CPU profile of the workload API server during each side's join (-fleet-profile-seconds) to this path with the side's name added before the extension")
	fleetProfileSecs = flag.Int("fleet-profile-seconds", 20, "BenchmarkFleetJoin: length of the -fleet-profile CPU profile")
	fleetSettle      = flag.Duration("fleet-settle", 0, "BenchmarkFleetJoin: after each of the controller's sides, keep counting the controller's and the API servers' CPU for this long (work the side left queued, such as rate-limited writes, is its cost; net of idle figures take their idle CPU for as long off)")
)

// fleetJoin is one node's join in a fleet run.
type fleetJoin struct {
	start, took time.Duration // start from the run's start
}

// fleetSide is one side of BenchmarkFleetJoin or BenchmarkFleetJoinTPM.
// Each run of the side (runFleet) adds to it.
type fleetSide struct {
	name  string
	color string
	joins []fleetJoin
	wall  time.Duration // first start to last end, summed over runs
	// settled is how long the side's CPU was counted after its last join
	// (-fleet-settle), summed over runs.
	settled time.Duration
	// nodeCPU is the CPU time the nodes' side spent (the exec plugin
	// processes; the benchmark process itself for kubelet's in-process
	// bootstrap); signerCPU the signer's (the controller's or
	// kube-controller-manager's process).
	nodeCPU, signerCPU time.Duration
	// shared is what the run cost the rest of the machine (sharedCPU).
	shared sharedCPU
	// requests counts the API servers' requests during the side's runs
	// (apiRequests), by cluster, verb and resource.
	requests map[string]float64
	// server is, per CSR, from the API server announcing it to the
	// certificate's arrival on a watch: the signer's share of a join (of
	// its last round, where the signer challenges). challenged is the same
	// to the challenge's arrival, per challenged CSR: the signer's first
	// round.
	server, challenged sample
	// stderr is each join's standard error, in the order of joins (the
	// exec plugin's; --verbose makes it a timeline).
	stderr []string
}

func (s *fleetSide) perSecond() float64 { return float64(len(s.joins)) / s.wall.Seconds() }

func (s *fleetSide) latency() *sample {
	var l sample
	for _, j := range s.joins {
		l.wall = append(l.wall, j.took)
	}
	return &l
}

// runFleet runs join(0..n-1) on c goroutines and adds to side when each
// started (from this run's start) and how long it took.
func runFleet(b *testing.B, side *fleetSide, n, c int, join func(i int) error) {
	b.Helper()
	joins := make([]fleetJoin, n)
	next := make(chan int)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	t0 := time.Now()
	for range c {
		wg.Go(func() {
			for i := range next {
				start := time.Now()
				err := join(i)
				joins[i] = fleetJoin{start: start.Sub(t0), took: time.Since(start)}
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("%s: node %d: %w", side.name, i, err)
					}
					mu.Unlock()
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	side.wall += time.Since(t0)
	side.joins = append(side.joins, joins...)
	if firstErr != nil {
		b.Fatal(firstErr)
	}
}

// BenchmarkFleetJoin joins a fleet: -fleet-nodes nodes (1,000), -fleet-concurrency
// (50) at a time, on each side in turn on one workload API server:
//
//   - kcm-tuned: kubelet's TLS bootstrap in process (a new client per node,
//     as each kubelet has its own) through kube-controller-manager's
//     csrapproving and csrsigning with its client rate limit lifted
//     (kcmTunedArgs);
//   - node-attestation-controller (-fleet-process): each node a whole
//     `kubelet-authenticator credential` process from an empty cache
//     (insecure attestor), through the controller with its default flags;
//   - node-attestation-controller-in-process (-fleet-in-process): the
//     same nodes through the same controller, each node's credential code
//     run in the benchmark's process (runInProcessSide), as kubelet's
//     bootstrap is for kube-controller-manager: both signers meet nodes
//     that cost the machine alike;
//   - kcm-default: the baseline again through kube-controller-manager's
//     default flags.
//
// It reports each side's joins per second (first start to last
// certificate: CSR/s, one CSR per node), and median and p99 join latency,
// and writes an SVG plot of every node's join latency over the run.
func BenchmarkFleetJoin(b *testing.B) {
	n, c := *fleetNodes, *fleetConcurrency
	var workload []harness.Option
	if *fleetAPIProfile != "" {
		workload = append(workload, harness.WithAPIServerArgs("--profiling=true"))
	}
	env := scenario.Start(b, scenario.Options{NoController: true, Workload: workload})
	name := func(i int) string { return fmt.Sprintf("fleet-%05d", i) }
	names := make([]string, n)
	for i := range names {
		names[i] = name(i)
	}
	env.Mgmt.ServeInfrastructure(b, env.Namespace, names...)
	// scenario's -v=2 overridden: the default.
	controllerFlags := append([]string{"-v=0"}, strings.Fields(*fleetController)...)
	profiler := ""
	if *fleetProfile != "" {
		profiler = fmt.Sprintf("127.0.0.1:%d", harness.FreePort(b))
		controllerFlags = append(controllerFlags, "--profiler-address="+profiler)
	}
	controller := env.StartController(b, controllerFlags...)
	// The node binary as released (no simulator, no test attestors).
	var plugin string
	if *fleetProcess {
		plugin = buildRelease(b, "../../cmd/kubelet-authenticator")
	}
	autoApprove(b, env.Workload)
	bootCfg := restConfigFromFile(b, env.BootstrapKubeconfig)

	start := time.Now()
	providerID := func(i int) string { return "test:///fleet/" + name(i) }
	createMachines(b, env.Mgmt, env.Namespace, env.Cluster, n, name, providerID)
	nodes := make([]*scenario.Node, n)
	for i := range nodes {
		nodes[i] = env.NewNode(b, name(i), providerID(i), "insecure")
	}
	b.Logf("%d Machines and node configurations in %s", n, time.Since(start).Round(time.Millisecond))

	idle := measureFleetIdle(b, env, controller.PID())
	tuned := &fleetSide{name: "kcm-tuned", color: "#1f77b4"}
	ours := &fleetSide{name: "node-attestation-controller", color: "#d62728"}
	inProcess := &fleetSide{name: "node-attestation-controller-in-process", color: "#ff7f0e"}
	dflt := &fleetSide{name: "kcm-default", color: "#7f7f7f"}
	sides := []*fleetSide{tuned}
	if *fleetProcess {
		sides = append(sides, ours)
	}
	if *fleetInProcess {
		sides = append(sides, inProcess)
	}
	if *fleetKCMDefault {
		sides = append(sides, dflt)
	}
	for b.Loop() {
		apiProfiled := fleetStartAPIProfile(b, env, tuned)
		runKCMSide(b, env, bootCfg, tuned, n, c, name, kcmTunedArgs...)
		apiProfiled()
		clearCSRs(b, env)
		if *fleetProcess {
			profiled := fleetStartProfile(b, profiler, ours)
			apiProfiled = fleetStartAPIProfile(b, env, ours)
			runCredentialSide(b, env, plugin, controller.PID(), ours, nodes, c)
			apiProfiled()
			profiled()
			fleetSettleSide(b, env, controller.PID(), ours)
			clearCSRs(b, env)
		}
		if *fleetInProcess {
			profiled := fleetStartProfile(b, profiler, inProcess)
			apiProfiled = fleetStartAPIProfile(b, env, inProcess)
			runInProcessSide(b, env, controller.PID(), inProcess, nodes, c)
			apiProfiled()
			profiled()
			fleetSettleSide(b, env, controller.PID(), inProcess)
			clearCSRs(b, env)
		}
		if *fleetKCMDefault {
			runKCMSide(b, env, bootCfg, dflt, n, c, name)
			clearCSRs(b, env)
		}
	}
	b.StopTimer()

	var table strings.Builder
	fmt.Fprintf(&table, "fleet join, %d nodes %d at a time per side:\n", n, c)
	reportFleet(b, &table, "CSR/s", "csrs/s", sides)
	if *fleetProcess {
		r := ours.perSecond() / tuned.perSecond()
		b.ReportMetric(r, "controller-x-kcm-tuned")
		fmt.Fprintf(&table, "  controller / kcm-tuned throughput: %.2fx (kcm-tuned / controller: %.2fx)", r, 1/r)
		if *fleetKCMDefault {
			fmt.Fprintf(&table, "; controller / kcm-default: %.2fx", ours.perSecond()/dflt.perSecond())
		}
		table.WriteString("\n")
	}
	if *fleetInProcess {
		fleetRatios(b, &table, inProcess, tuned, idle)
	}
	if *fleetProcess {
		fleetRatios(b, &table, ours, tuned, idle)
	}
	table.WriteString(writeFleetFiles(b, env, *fleetPlot, "fleet-join.svg", n, c, sides))
	fmt.Println(table.String())
}

// fleetRatios reports side's signer and API servers' CPU per join over
// base's, and its throughput over base's: as measured, and net of idle
// (each side's CPU less what the same processes use in as long a time,
// its joins' and -fleet-settle's, with no join under way, idle; base's
// signer, kube-controller-manager, is charged nothing for its idle time,
// in its favour).
func fleetRatios(b *testing.B, table *strings.Builder, side, base *fleetSide, idle fleetIdle) {
	key := strings.TrimPrefix(side.name, "node-attestation-")
	perJoin := func(d time.Duration, s *fleetSide) float64 { return float64(d) / float64(len(s.joins)) }
	signer := perJoin(side.signerCPU, side) / perJoin(base.signerCPU, base)
	api := perJoin(side.shared.api, side) / perJoin(base.shared.api, base)
	rate := side.perSecond() / base.perSecond()
	counted := func(s *fleetSide) time.Duration { return s.wall + s.settled }
	netSigner := perJoin(side.signerCPU-idle.of(idle.signer, counted(side)), side) / perJoin(base.signerCPU, base)
	netAPI := perJoin(side.shared.api-idle.of(idle.api, counted(side)), side) / perJoin(base.shared.api-idle.of(idle.api, counted(base)), base)
	b.ReportMetric(signer, key+"-signer-cpu-x-"+base.name)
	b.ReportMetric(api, key+"-api-cpu-x-"+base.name)
	b.ReportMetric(netSigner, key+"-net-signer-cpu-x-"+base.name)
	b.ReportMetric(netAPI, key+"-net-api-cpu-x-"+base.name)
	fmt.Fprintf(table, "  %s / %s: throughput %.2fx, signer CPU per join %.2fx (net of idle %.2fx), API servers' CPU per join %.2fx (net of idle %.2fx)\n",
		side.name, base.name, rate, signer, netSigner, api, netAPI)
}

// fleetSettleSide adds to side what the controller (process signerPID)
// and the API servers spend, and the requests they serve, during
// -fleet-settle from now, after the side's last join: what the side left queued is its cost (the
// controller's Event client, for one, writes at most 10 a second).
// kube-controller-manager leaves nothing queued once it has signed: its
// sides are not settled.
func fleetSettleSide(b *testing.B, env *scenario.Env, signerPID int, side *fleetSide) {
	b.Helper()
	if *fleetSettle <= 0 {
		return
	}
	requests := apiRequests(b, env)
	signer, shared := procCPU(b, signerPID), readSharedCPU(b, env)
	time.Sleep(*fleetSettle)
	side.signerCPU += procCPU(b, signerPID) - signer
	side.shared.add(shared, readSharedCPU(b, env))
	side.addRequests(requests, apiRequests(b, env))
	side.settled += *fleetSettle
}

// fleetIdle is the CPU the controller (signer) and the API servers and etcd
// of both clusters (api) use with no join under way, as a share of one
// CPU: their watches, leases and probes, which run however long a side
// takes.
type fleetIdle struct{ signer, api float64 }

// of returns the CPU time a process using share of a CPU uses in d.
func (fleetIdle) of(share float64, d time.Duration) time.Duration {
	return time.Duration(share * float64(d))
}

// measureFleetIdle measures fleetIdle over 10 s, the controller (process
// signerPID) running, no join under way.
func measureFleetIdle(b *testing.B, env *scenario.Env, signerPID int) fleetIdle {
	b.Helper()
	time.Sleep(2 * time.Second)
	const window = 10 * time.Second
	signer, shared := procCPU(b, signerPID), readSharedCPU(b, env)
	time.Sleep(window)
	var s sharedCPU
	s.add(shared, readSharedCPU(b, env))
	idle := fleetIdle{signer: float64(procCPU(b, signerPID)-signer) / float64(window), api: float64(s.api) / float64(window)}
	b.Logf("idle: the controller uses %.1f%% of a CPU, the API servers and etcd %.1f%%", 100*idle.signer, 100*idle.api)
	return idle
}

// runKCMSide runs side through kube-controller-manager (startKCM, with
// args): name(0..n-1) join c at a time with kubelet's TLS bootstrap in
// process (kubeletJoin, a new client per node). It starts
// kube-controller-manager and waits until it signs, so that its start-up
// is not counted, and stops it after.
func runKCMSide(b *testing.B, env *scenario.Env, bootCfg *rest.Config, side *fleetSide, n, c int, name func(int) string, args ...string) {
	b.Helper()
	ctx := context.Background()
	p := startKCM(b, env.Workload, side.name+".log", args...)
	harness.WaitFor(b, time.Minute, func() (bool, error) {
		return kubeletJoin(ctx, bootCfg, nil, "warm-"+side.name) == nil, nil
	})
	stop := watchCSRs(b, env, side)
	requests := apiRequests(b, env)
	self, kcm, shared := selfCPU(b), procCPU(b, p.PID()), readSharedCPU(b, env)
	runFleet(b, side, n, c, func(i int) error {
		return kubeletJoin(ctx, bootCfg, nil, side.name+"-"+name(i))
	})
	side.nodeCPU += selfCPU(b) - self
	side.signerCPU += procCPU(b, p.PID()) - kcm
	side.shared.add(shared, readSharedCPU(b, env))
	side.addRequests(requests, apiRequests(b, env))
	stop()
	p.Stop(10 * time.Second)
}

// runCredentialSide runs side through the controller (process signerPID):
// every node joins, c at a time, with a whole `kubelet-authenticator
// credential` process of bin (credential, with args), and keeps each one's
// standard error.
func runCredentialSide(b *testing.B, env *scenario.Env, bin string, signerPID int, side *fleetSide, nodes []*scenario.Node, c int, args ...string) {
	b.Helper()
	ctx := context.Background()
	stop := watchCSRs(b, env, side)
	var nodeCPU atomic.Int64
	stderr := make([]string, len(nodes))
	requests := apiRequests(b, env)
	before, shared := procCPU(b, signerPID), readSharedCPU(b, env)
	runFleet(b, side, len(nodes), c, func(i int) error {
		cpu, out, err := credential(ctx, bin, env, nodes[i], args...)
		nodeCPU.Add(int64(cpu))
		stderr[i] = out
		return err
	})
	side.nodeCPU += time.Duration(nodeCPU.Load())
	side.signerCPU += procCPU(b, signerPID) - before
	side.shared.add(shared, readSharedCPU(b, env))
	side.addRequests(requests, apiRequests(b, env))
	side.stderr = append(side.stderr, stderr...)
	stop()
}

// reportFleet reports each side's figures (b.ReportMetric, keyed by the
// side's name without "node-attestation-", and a row of table): joins per
// second (rate, as the table heads it, and metric, its unit: "CSR/s" and
// "csrs/s" where a join is one CSR), median and p99 join latency, wall,
// the signer's share, the nodes', the signer's and the API servers' CPU
// per join, and how busy the machine was.
func reportFleet(b *testing.B, table *strings.Builder, rate, metric string, sides []*fleetSide) {
	fmt.Fprintf(table, "  %-34s %8s %10s %10s %9s %14s %14s %14s %14s %13s\n", "side", rate, "median", "p99", "wall", "signer median", "node CPU/join", "signer CPU/join", "API CPU/join", "machine busy")
	for _, s := range sides {
		key := strings.TrimPrefix(s.name, "node-attestation-")
		l := s.latency()
		b.ReportMetric(s.perSecond(), key+"-"+metric)
		b.ReportMetric(ms(l.median()), key+"-ms/median")
		b.ReportMetric(ms(l.p99()), key+"-ms/p99")
		b.ReportMetric(ms(s.server.median()), key+"-signer-ms/median")
		joins := time.Duration(len(s.joins))
		nodeCPU, signerCPU := s.nodeCPU/joins, s.signerCPU/joins
		b.ReportMetric(ms(nodeCPU), key+"-node-cpu-ms/join")
		b.ReportMetric(ms(signerCPU), key+"-signer-cpu-ms/join")
		apiCPU, busy := s.shared.api/joins, s.shared.busyShare()
		b.ReportMetric(ms(apiCPU), key+"-api-cpu-ms/join")
		b.ReportMetric(100*busy, key+"-machine-busy-%")
		fmt.Fprintf(table, "  %-34s %8.1f %8.0fms %8.0fms %8.2fs %12.0fms %12.1fms %12.1fms %12.1fms %12.0f%%\n", s.name, s.perSecond(), ms(l.median()), ms(l.p99()), s.wall.Seconds(),
			ms(s.server.median()), ms(nodeCPU), ms(signerCPU), ms(apiCPU), 100*busy)
	}
	for _, s := range sides {
		joins := time.Duration(len(s.joins))
		var each []string
		for _, k := range slices.Sorted(maps.Keys(s.shared.byProcess)) {
			each = append(each, fmt.Sprintf("%s %.1f ms", k, ms(s.shared.byProcess[k]/joins)))
		}
		fmt.Fprintf(table, "  %s: API servers' CPU per join: %s\n", s.name, strings.Join(each, ", "))
	}
	for _, s := range sides {
		if s.requests == nil {
			continue
		}
		key := strings.TrimPrefix(s.name, "node-attestation-")
		joins := float64(len(s.joins))
		var total float64
		var each []string
		for _, k := range slices.Sorted(maps.Keys(s.requests)) {
			if n := s.requests[k] / joins; n >= 0.05 {
				total += n
				each = append(each, fmt.Sprintf("%s %.2f", k, n))
			}
		}
		b.ReportMetric(total, key+"-api-requests/join")
		fmt.Fprintf(table, "  %s: %.1f API requests per join (%s)\n", s.name, total, strings.Join(each, ", "))
	}
}

// apiRequests reads the requests each API server of env's clusters has
// served so far (kube-apiserver's apiserver_request_total), by cluster
// ("workload", "management"), verb and resource (with its subresource).
// Requests for no resource (discovery, /metrics) are left out.
func apiRequests(b *testing.B, env *scenario.Env) map[string]float64 {
	b.Helper()
	out := map[string]float64{}
	for _, cp := range []struct {
		name string
		cp   *harness.ControlPlane
	}{{"workload", env.Workload}, {"management", env.Mgmt.ControlPlane}} {
		raw, err := cp.cp.Client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(context.Background())
		if err != nil {
			b.Fatalf("%s API server's metrics: %v", cp.name, err)
		}
		for line := range strings.Lines(string(raw)) {
			labels, ok := strings.CutPrefix(line, "apiserver_request_total{")
			if !ok {
				continue
			}
			labels, value, ok := strings.Cut(labels, "} ")
			if !ok {
				continue
			}
			v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
			if err != nil {
				b.Fatalf("%s API server's metrics: %q: %v", cp.name, line, err)
			}
			l := map[string]string{}
			for kv := range strings.SplitSeq(labels, ",") {
				k, v, _ := strings.Cut(kv, "=")
				l[k] = strings.Trim(v, `"`)
			}
			if l["resource"] == "" {
				continue
			}
			res := l["resource"]
			if l["subresource"] != "" {
				res += "/" + l["subresource"]
			}
			out[cp.name+" "+l["verb"]+" "+res] += v
		}
	}
	return out
}

// addRequests adds the difference between two readings of apiRequests.
func (s *fleetSide) addRequests(before, after map[string]float64) {
	if s.requests == nil {
		s.requests = map[string]float64{}
	}
	for k, v := range after {
		if d := v - before[k]; d > 0 {
			s.requests[k] += d
		}
	}
}

// writeFleetFiles writes the plot of join latency (writeFleetPlot) to path,
// by default bin/<name> in the repository, and the controller's log beside
// it, and returns a line that says where they are.
func writeFleetFiles(b *testing.B, env *scenario.Env, path, name string, n, c int, sides []*fleetSide) string {
	b.Helper()
	if path == "" {
		root, err := harness.RepoRoot()
		if err != nil {
			b.Fatal(err)
		}
		path = filepath.Join(root, "bin", name)
	}
	if err := writeFleetPlot(path, n, c, sides); err != nil {
		b.Fatal(err)
	}
	logPath := strings.TrimSuffix(path, ".svg") + "-controller.log"
	if err := os.WriteFile(logPath, []byte(env.ControllerLog()), 0o644); err != nil {
		b.Fatal(err)
	}
	return fmt.Sprintf("  plot of join latency over the run: %s (the controller's log: %s)", path, logPath)
}

// credential runs the exec plugin binary for node n as kubelet would (as
// scenario.Node.Credential does), with args after its own, and returns the
// CPU time it used and its standard error.
func credential(ctx context.Context, bin string, env *scenario.Env, n *scenario.Node, args ...string) (cpu time.Duration, stderr string, err error) {
	info := fmt.Sprintf(`{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","spec":{"interactive":false,"cluster":{"server":%q,"certificate-authority-data":%q}}}`,
		env.Workload.URL, base64.StdEncoding.EncodeToString(env.Workload.CACertPEM))
	cmd := exec.CommandContext(ctx, bin, append([]string{"credential", "--config=" + n.ConfigPath}, args...)...)
	cmd.Env = append(os.Environ(), "KUBERNETES_EXEC_INFO="+info)
	var errOut strings.Builder
	cmd.Stderr = &errOut
	out, err := cmd.Output()
	if cmd.ProcessState != nil {
		cpu = cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	}
	if err != nil || len(out) == 0 {
		return cpu, errOut.String(), fmt.Errorf("credential: %w\n%s", err, harness.LastLines(errOut.String(), 10))
	}
	return cpu, errOut.String(), nil
}

// procCPU returns the CPU time (user and system) process pid has used.
func procCPU(b *testing.B, pid int) time.Duration {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// Fields after the command name (in parentheses, which may hold
	// spaces): state is field 3, utime 14, stime 15.
	s := string(data)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	var ticks int64
	for _, f := range fields[11:13] {
		v, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			b.Fatalf("/proc/%d/stat: %v", pid, err)
		}
		ticks += v
	}
	return time.Duration(ticks) * time.Second / clockTicks
}

// sharedCPU is what a side's run costs the rest of the machine: the CPU
// time of the API servers and etcd of both clusters, and how long the
// machine's CPUs were busy (every process's, other users' too) out of all
// their time.
type sharedCPU struct {
	api, busy, all time.Duration
	// byProcess is api by process: "workload kube-apiserver",
	// "management etcd", ...
	byProcess map[string]time.Duration
}

// add adds the difference between two readings of readSharedCPU.
func (s *sharedCPU) add(before, after sharedCPU) {
	s.api += after.api - before.api
	if s.byProcess == nil {
		s.byProcess = map[string]time.Duration{}
	}
	for k, v := range after.byProcess {
		s.byProcess[k] += v - before.byProcess[k]
	}
	s.busy += after.busy - before.busy
	s.all += after.all - before.all
}

// busyShare is the share of the machine's CPU time that was busy.
func (s *sharedCPU) busyShare() float64 {
	if s.all == 0 {
		return 0
	}
	return float64(s.busy) / float64(s.all)
}

// readSharedCPU reads the CPU time used so far by the API servers and
// etcd of env's clusters, and the machine's busy and total CPU time
// (/proc/stat, summed over its CPUs).
func readSharedCPU(b *testing.B, env *scenario.Env) sharedCPU {
	b.Helper()
	s := sharedCPU{byProcess: map[string]time.Duration{}}
	for cluster, cp := range map[string]*harness.ControlPlane{"workload": env.Workload, "management": env.Mgmt.ControlPlane} {
		for _, p := range cp.Processes() {
			if p.Name == "kube-apiserver" || p.Name == "etcd" {
				cpu := procCPU(b, p.PID())
				s.api += cpu
				s.byProcess[cluster+" "+p.Name] += cpu
			}
		}
	}
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		b.Fatal(err)
	}
	// cpu user nice system idle iowait irq softirq steal (guest time is
	// in user already).
	line, _, _ := strings.Cut(string(data), "\n")
	fields := strings.Fields(line)
	if len(fields) < 9 || fields[0] != "cpu" {
		b.Fatalf("/proc/stat: unexpected first line %q", line)
	}
	for i, f := range fields[1:9] {
		v, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			b.Fatalf("/proc/stat: %v", err)
		}
		d := time.Duration(v) * time.Second / clockTicks
		s.all += d
		if i != 3 && i != 4 { // idle, iowait
			s.busy += d
		}
	}
	return s
}

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat's times: 100 on
// every Linux architecture Go supports.
const clockTicks = 100

// selfCPU returns the CPU time this process has used.
func selfCPU(b *testing.B) time.Duration {
	b.Helper()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// watchCSRs watches the workload cluster's CSRs until stop is called and
// adds, per CSR, the time from its creation event to the event that
// carries its certificate to side.server, and to the event that carries a
// challenge to side.challenged.
func watchCSRs(b *testing.B, env *scenario.Env, side *fleetSide) (stop func()) {
	return watchIssued(b, env, func(_ *certificatesv1.CertificateSigningRequest, took time.Duration) {
		side.server.wall = append(side.server.wall, took)
	}, func(_ *certificatesv1.CertificateSigningRequest, took time.Duration) {
		side.challenged.wall = append(side.challenged.wall, took)
	})
}

// watchIssued watches the workload cluster's CSRs from now until stop is
// called and calls issued, from one goroutine, with each CSR issued meanwhile and the
// time from its creation event to the event that carries its certificate:
// the signer's share of a join. With challenged, it calls that likewise
// with each CSR challenged meanwhile (attestor.AnnotationChallenge: the
// signer's first round where the attestor answers a challenge in a second
// CSR) and the time to the event that carries the challenge.
func watchIssued(b *testing.B, env *scenario.Env, issued, challenged func(csr *certificatesv1.CertificateSigningRequest, took time.Duration)) (stop func()) {
	b.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	// From the current version: CSRs that exist already (a warm-up's)
	// would otherwise arrive as added now, decided in no time.
	csrs := env.Workload.Client.CertificatesV1().CertificateSigningRequests()
	list, err := csrs.List(ctx, metav1.ListOptions{Limit: 1})
	if err != nil {
		b.Fatal(err)
	}
	w, err := csrs.Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		added := map[string]time.Time{}
		seenChallenge := map[string]bool{}
		for ev := range w.ResultChan() {
			csr, ok := ev.Object.(*certificatesv1.CertificateSigningRequest)
			if !ok {
				continue
			}
			if _, seen := added[csr.Name]; !seen {
				added[csr.Name] = time.Now()
			}
			t := added[csr.Name]
			if _, ok := csr.Annotations[attestor.AnnotationChallenge]; ok && challenged != nil && !t.IsZero() && !seenChallenge[csr.Name] {
				challenged(csr, time.Since(t))
				seenChallenge[csr.Name] = true
			}
			if !t.IsZero() && len(csr.Status.Certificate) > 0 {
				issued(csr, time.Since(t))
				added[csr.Name] = time.Time{}
			}
		}
	}()
	return func() {
		// Let the last events arrive.
		time.Sleep(time.Second)
		cancel()
		w.Stop()
		<-done
	}
}

// clearCSRs deletes every CSR of the workload cluster and waits until the
// list is empty, so that each side starts from the same API server state.
func clearCSRs(b *testing.B, env *scenario.Env) {
	b.Helper()
	csrs := env.Workload.Client.CertificatesV1().CertificateSigningRequests()
	if err := csrs.DeleteCollection(context.Background(), metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		b.Fatal(err)
	}
	harness.WaitFor(b, time.Minute, func() (bool, error) {
		l, err := csrs.List(context.Background(), metav1.ListOptions{Limit: 1})
		return err == nil && len(l.Items) == 0, nil
	})
}

// writeFleetPlot writes an SVG scatter plot: one point per node, x when it
// started to join (seconds into its side's run), y how long the join took
// (milliseconds, log scale), one colour per side.
func writeFleetPlot(path string, n, c int, sides []*fleetSide) error {
	const (
		width, height          = 960.0, 540.0
		left, right, top, bott = 70.0, 20.0, 50.0, 60.0
	)
	var maxX time.Duration
	minY, maxY := time.Hour, time.Duration(0)
	for _, s := range sides {
		maxX = max(maxX, s.wall)
		for _, j := range s.joins {
			minY, maxY = min(minY, j.took), max(maxY, j.took)
		}
	}
	// Decades of milliseconds that cover every latency.
	lo, hi := 1.0, 10.0
	for lo > ms(minY) && lo > 0.1 {
		lo /= 10
	}
	for lo*10 <= ms(minY) {
		lo *= 10
	}
	for hi < ms(maxY) {
		hi *= 10
	}
	pw, ph := width-left-right, height-top-bott
	xOf := func(d time.Duration) float64 { return left + pw*d.Seconds()/max(maxX.Seconds(), 1e-3) }
	yOf := func(d time.Duration) float64 {
		v := max(ms(d), lo)
		return top + ph*(1-(math.Log10(v)-math.Log10(lo))/(math.Log10(hi)-math.Log10(lo)))
	}
	var w strings.Builder
	fmt.Fprintf(&w, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(&w, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&w, `<text x="%.0f" y="20" font-size="15">%s</text>`+"\n", left,
		html.EscapeString(fmt.Sprintf("Join latency of %d nodes, %d at a time, per side (%s)", n, c, time.Now().UTC().Format("2006-01-02 15:04 UTC"))))
	for d := lo; d <= hi*1.0001; d *= 10 {
		y := yOf(time.Duration(d * float64(time.Millisecond)))
		fmt.Fprintf(&w, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", left, left+pw, y, y)
		fmt.Fprintf(&w, `<text x="%.1f" y="%.1f" text-anchor="end">%g ms</text>`+"\n", left-6, y+4, d)
	}
	step := niceStep(maxX.Seconds())
	for s := 0.0; s <= maxX.Seconds()+1e-9; s += step {
		x := xOf(time.Duration(s * float64(time.Second)))
		fmt.Fprintf(&w, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#eee"/>`+"\n", x, x, top, top+ph)
		fmt.Fprintf(&w, `<text x="%.1f" y="%.1f" text-anchor="middle">%gs</text>`+"\n", x, top+ph+16, s)
	}
	fmt.Fprintf(&w, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="none" stroke="black"/>`+"\n", left, top, pw, ph)
	fmt.Fprintf(&w, `<text x="%.1f" y="%.1f" text-anchor="middle">time since the side's first node started (s)</text>`+"\n", left+pw/2, height-20)
	fmt.Fprintf(&w, `<text transform="translate(16 %.1f) rotate(-90)" text-anchor="middle">join latency (ms, log scale)</text>`+"\n", top+ph/2)
	for i, s := range sides {
		fmt.Fprintf(&w, `<g fill="%s" fill-opacity="0.55">`+"\n", s.color)
		for _, j := range s.joins {
			fmt.Fprintf(&w, `<circle cx="%.1f" cy="%.1f" r="2"/>`+"\n", xOf(j.start), yOf(j.took))
		}
		w.WriteString("</g>\n")
		l := s.latency()
		lx, ly := left+pw-330, top+18+float64(i)*18
		fmt.Fprintf(&w, `<circle cx="%.1f" cy="%.1f" r="5" fill="%s"/>`+"\n", lx, ly-4, s.color)
		fmt.Fprintf(&w, `<text x="%.1f" y="%.1f">%s</text>`+"\n", lx+10, ly,
			html.EscapeString(fmt.Sprintf("%s: %.1f CSR/s, median %.0f ms, p99 %.0f ms", s.name, s.perSecond(), ms(l.median()), ms(l.p99()))))
	}
	w.WriteString("</svg>\n")
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, []byte(w.String()), 0o644)
}

// niceStep returns a tick step of 1, 2 or 5 times a power of ten giving
// about eight ticks over [0, span].
func niceStep(span float64) float64 {
	if span <= 0 {
		return 1
	}
	raw := span / 8
	p := 1.0
	for p*10 <= raw {
		p *= 10
	}
	for p > raw {
		p /= 10
	}
	for _, m := range []float64{1, 2, 5, 10} {
		if p*m >= raw {
			return p * m
		}
	}
	return p * 10
}

// fleetStartAPIProfile starts a CPU profile of the workload API server
// (-fleet-api-profile) for side's run and returns a function that waits
// for it and writes it.
func fleetStartAPIProfile(b *testing.B, env *scenario.Env, side *fleetSide) (wait func()) {
	b.Helper()
	if *fleetAPIProfile == "" {
		return func() {}
	}
	ext := filepath.Ext(*fleetAPIProfile)
	path := strings.TrimSuffix(*fleetAPIProfile, ext) + "-" + side.name + ext
	done := make(chan error, 1)
	go func() {
		data, err := env.Workload.Client.CoreV1().RESTClient().Get().AbsPath("/debug/pprof/profile").
			Param("seconds", strconv.Itoa(*fleetProfileSecs)).Timeout(time.Duration(*fleetProfileSecs+60) * time.Second).DoRaw(context.Background())
		if err == nil {
			err = os.WriteFile(path, data, 0o644)
		}
		done <- err
	}()
	return func() {
		if err := <-done; err != nil {
			b.Errorf("API server CPU profile: %v", err)
			return
		}
		b.Logf("CPU profile of the workload API server during %s (%d s) in %s", side.name, *fleetProfileSecs, path)
	}
}

// fleetStartProfile starts a CPU profile of the controller serving
// net/http/pprof at addr (none when addr is empty) for side's run, and a
// profile of what it allocated meanwhile, written to -fleet-profile with
// the side's name (and "-allocs") added before the extension; the
// returned function waits for them.
func fleetStartProfile(b *testing.B, addr string, side *fleetSide) (wait func()) {
	b.Helper()
	if addr == "" {
		return func() {}
	}
	ext := filepath.Ext(*fleetProfile)
	base := strings.TrimSuffix(*fleetProfile, ext) + "-" + side.name
	profiles := []struct{ what, url, path string }{
		{"CPU profile", "profile", base + ext},
		{"allocation profile", "allocs", base + "-allocs" + ext},
	}
	done := make(chan error, len(profiles))
	for _, p := range profiles {
		go func() {
			done <- fetchProfile(fmt.Sprintf("http://%s/debug/pprof/%s?seconds=%d", addr, p.url, *fleetProfileSecs), p.path)
		}()
	}
	return func() {
		for range profiles {
			if err := <-done; err != nil {
				b.Errorf("controller profile: %v", err)
			}
		}
		b.Logf("profiles of the controller during %s (%d s) in %s and %s", side.name, *fleetProfileSecs, profiles[0].path, profiles[1].path)
	}
}

// fetchProfile writes the profile net/http/pprof serves at url to path.
func fetchProfile(url, path string) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("%s: %s", url, resp.Status)
	}
	if err == nil {
		err = os.WriteFile(path, body, 0o644)
	}
	return err
}
