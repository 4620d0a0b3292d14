package bench

import (
	"context"
	"flag"
	"fmt"
	"html"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// Size of BenchmarkFleetJoin (go test ... -args -fleet-nodes=N). The
// documented run is 1,000 nodes, 50 at a time.
var (
	fleetNodes       = flag.Int("fleet-nodes", 1000, "BenchmarkFleetJoin: nodes that join, per side")
	fleetConcurrency = flag.Int("fleet-concurrency", 50, "BenchmarkFleetJoin: nodes joining at the same time")
	fleetPlot        = flag.String("fleet-plot", "", "BenchmarkFleetJoin: where to write the SVG plot of join latency (default bin/fleet-join.svg in the repository)")
)

// fleetJoin is one node's join in a fleet run.
type fleetJoin struct {
	start, took time.Duration // start from the run's start
}

// fleetSide is one side of BenchmarkFleetJoin.
type fleetSide struct {
	name  string
	color string
	joins []fleetJoin
	wall  time.Duration // first start to last end
}

func (s *fleetSide) perSecond() float64 { return float64(len(s.joins)) / s.wall.Seconds() }

func (s *fleetSide) latency() *sample {
	var l sample
	for _, j := range s.joins {
		l.wall = append(l.wall, j.took)
	}
	return &l
}

// runFleet runs join(0..n-1) on c goroutines and records when each started
// and how long it took.
func runFleet(b *testing.B, side *fleetSide, n, c int, join func(i int) error) {
	b.Helper()
	side.joins = make([]fleetJoin, n)
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
				side.joins[i] = fleetJoin{start: start.Sub(t0), took: time.Since(start)}
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
	side.wall = time.Since(t0)
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
//   - node-attestation-controller: each node a whole `kubelet-authenticator
//     credential` process from an empty cache (insecure attestor), through
//     the controller with its default flags;
//   - kcm-default: the baseline again through kube-controller-manager's
//     default flags.
//
// It reports each side's joins per second (first start to last
// certificate: CSR/s, one CSR per node), and median and p99 join latency,
// and writes an SVG plot of every node's join latency over the run.
func BenchmarkFleetJoin(b *testing.B) {
	n, c := *fleetNodes, *fleetConcurrency
	env := scenario.Start(b, scenario.Options{NoController: true})
	env.StartController(b, "-v=0") // scenario's -v=2 overridden: the default
	autoApprove(b, env.Workload)
	bootCfg := restConfigFromFile(b, env.BootstrapKubeconfig)
	ctx := context.Background()

	start := time.Now()
	name := func(i int) string { return fmt.Sprintf("fleet-%05d", i) }
	providerID := func(i int) string { return "test:///fleet/" + name(i) }
	createMachines(b, env.Mgmt, env.Namespace, env.Cluster, n, name, providerID)
	nodes := make([]*scenario.Node, n)
	for i := range nodes {
		nodes[i] = env.NewNode(b, name(i), providerID(i), "insecure")
	}
	b.Logf("%d Machines and node configurations in %s", n, time.Since(start).Round(time.Millisecond))

	kcmSide := func(side *fleetSide, args ...string) {
		p := startKCM(b, env.Workload, side.name+".log", args...)
		// Wait until it signs, so that its start-up is not counted.
		harness.WaitFor(b, time.Minute, func() (bool, error) {
			return kubeletJoin(ctx, bootCfg, nil, "warm-"+side.name) == nil, nil
		})
		runFleet(b, side, n, c, func(i int) error {
			return kubeletJoin(ctx, bootCfg, nil, side.name+"-"+name(i))
		})
		p.Stop(10 * time.Second)
	}
	tuned := &fleetSide{name: "kcm-tuned", color: "#1f77b4"}
	ours := &fleetSide{name: "node-attestation-controller", color: "#d62728"}
	dflt := &fleetSide{name: "kcm-default", color: "#7f7f7f"}
	sides := []*fleetSide{tuned, ours, dflt}
	for b.Loop() {
		kcmSide(tuned, kcmTunedArgs...)
		clearCSRs(b, env)
		runFleet(b, ours, n, c, func(i int) error {
			r := nodes[i].Credential(ctx)
			if r.Err != nil {
				return fmt.Errorf("credential: %v\n%s", r.Err, lastLines(r.Stderr, 10))
			}
			return nil
		})
		clearCSRs(b, env)
		kcmSide(dflt)
		clearCSRs(b, env)
	}
	b.StopTimer()

	var table strings.Builder
	fmt.Fprintf(&table, "fleet join, %d nodes %d at a time per side:\n  %-28s %8s %10s %10s %9s\n", n, c, "side", "CSR/s", "median", "p99", "wall")
	for _, s := range sides {
		key := strings.TrimPrefix(s.name, "node-attestation-")
		l := s.latency()
		b.ReportMetric(s.perSecond(), key+"-csrs/s")
		b.ReportMetric(ms(l.median()), key+"-ms/median")
		b.ReportMetric(ms(l.p99()), key+"-ms/p99")
		fmt.Fprintf(&table, "  %-28s %8.1f %8.0fms %8.0fms %8.1fs\n", s.name, s.perSecond(), ms(l.median()), ms(l.p99()), s.wall.Seconds())
	}
	r := ours.perSecond() / tuned.perSecond()
	b.ReportMetric(r, "controller-x-kcm-tuned")
	fmt.Fprintf(&table, "  controller / kcm-tuned throughput: %.2fx (kcm-tuned / controller: %.2fx); controller / kcm-default: %.2fx\n",
		r, 1/r, ours.perSecond()/dflt.perSecond())
	path := *fleetPlot
	if path == "" {
		root, err := harness.RepoRoot()
		if err != nil {
			b.Fatal(err)
		}
		path = filepath.Join(root, "bin", "fleet-join.svg")
	}
	if err := writeFleetPlot(path, n, c, sides); err != nil {
		b.Fatal(err)
	}
	fmt.Fprintf(&table, "  plot of join latency over the run: %s", path)
	b.Log(table.String())
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
