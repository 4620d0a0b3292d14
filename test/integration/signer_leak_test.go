package integration

import (
	"bytes"
	"flag"
	"fmt"
	"runtime"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// optInCycles is how many times TestSignerOptInCycles opts its Cluster in
// and out after warming up; make bench-signer asks for 100.
var optInCycles = flag.Int("opt-in-cycles", 20, "opt-in/opt-out cycles of TestSignerOptInCycles")

// Tolerances of TestSignerOptInCycles: what the process may hold above
// its idle figure after the cycles. An opted-in Cluster costs tens of
// goroutines and hundreds of KiB, so one left behind by every cycle, or
// even one goroutine a cycle, exceeds them.
const (
	leakGoroutines = 8
	leakHeapBytes  = 8 << 20
)

// TestSignerOptInCycles opts a Cluster in and out again and again through
// a sharded replica, a node joining each time it is in. Once it is out,
// the process (the replica runs in it) is back to its idle figures: as
// many goroutines, and as much live heap, as after the first cycles
// (within leakGoroutines and leakHeapBytes). A leak fails it, with the
// goroutine stacks that grew.
func TestSignerOptInCycles(t *testing.T) {
	harness.Binaries(t)
	mgmt := harness.StartManagement(t)
	const (
		ns     = "cycles"
		name   = "c0"
		warmUp = 3
	)
	wl := harness.StartControlPlane(t, name)
	mgmt.AddWorkloadCluster(t, ns, name, wl, map[string]string{
		capi.AnnotationEnabled:             "false",
		capi.AnnotationAuthorizedAttestors: "insecure",
	})
	e := &signerEnv{mgmt: mgmt, wl: wl, bootstrap: wl.BootstrapClient(t)}
	startReplica(t, mgmt, "replica-a", func(o *app.Options) {
		o.ShardLeaseDuration = 3 * time.Second
		o.ProbePeriod = time.Second
		o.MaxClientCertificateLifetime = 24 * time.Hour
	})

	// cycle opts the Cluster in, has a node join, and opts it out; it
	// returns once the replica released it.
	cycle := func(i int) time.Duration {
		t.Helper()
		start := time.Now()
		setEnabled(t, mgmt, ns, name, true)
		node, pid := fmt.Sprintf("node-%d", i), fmt.Sprintf("test:///%d", i)
		mgmt.CreateMachine(t, ns, name, node, pid, true)
		b, _ := signertest.Request{NodeName: node, ProviderID: pid}.Build(t)
		e.file(t, signertest.CSR(node, b))
		e.expectIssued(t, node, node, pid, 24*time.Hour)
		setEnabled(t, mgmt, ns, name, false)
		if err := pollFor(30*time.Second, func() bool { return claimHolder(t, mgmt, ns, name) == "" }); err != nil {
			t.Fatalf("cycle %d: opted out, still claimed by %s", i, claimHolder(t, mgmt, ns, name))
		}
		return time.Since(start)
	}
	for i := range warmUp {
		cycle(i)
	}
	baseG, baseStacks := settledGoroutines(t, 0)
	baseHeap := liveHeap()
	t.Logf("idle after %d cycles: %d goroutines, %.1f MiB live heap", warmUp, baseG, float64(baseHeap)/(1<<20))

	var took time.Duration
	for i := range *optInCycles {
		took += cycle(warmUp + i)
	}
	g, stacks := settledGoroutines(t, baseG+leakGoroutines)
	heap := liveHeap()
	t.Logf("idle after %d more cycles (%s each on average): %d goroutines (%+d), %.1f MiB live heap (%+.1f MiB)",
		*optInCycles, (took / time.Duration(max(1, *optInCycles))).Round(time.Millisecond), g, g-baseG, float64(heap)/(1<<20), (float64(heap)-float64(baseHeap))/(1<<20))
	if g > baseG+leakGoroutines {
		t.Errorf("%d goroutines after %d opt-in/opt-out cycles, %d before: leaked; the stacks that grew:\n%s",
			g, *optInCycles, baseG, grownStacks(baseStacks, stacks, 5))
	}
	if heap > baseHeap+leakHeapBytes {
		t.Errorf("%.1f MiB live heap after %d opt-in/opt-out cycles, %.1f MiB before: leaked",
			float64(heap)/(1<<20), *optInCycles, float64(baseHeap)/(1<<20))
	}
}

// settledGoroutines waits until the process's goroutines are at most
// want (when want > 0), or else steady (two samples two seconds apart
// within two of each other: what was starting has started, what was
// ending has ended), and returns their number and their stacks.
func settledGoroutines(t *testing.T, want int) (int, map[string]int) {
	t.Helper()
	n := runtime.NumGoroutine()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		time.Sleep(2 * time.Second)
		next := runtime.NumGoroutine()
		steady := next-n <= 2 && n-next <= 2
		n = next
		if (want > 0 && n <= want) || (want == 0 && steady) {
			break
		}
	}
	return n, goroutineStacks(t)
}

// goroutineStacks counts the process's goroutines by stack (the
// goroutine profile of runtime/pprof).
func goroutineStacks(t *testing.T) map[string]int {
	t.Helper()
	var b bytes.Buffer
	if err := pprof.Lookup("goroutine").WriteTo(&b, 1); err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	// debug=1: a header line, then blocks separated by blank lines, one
	// per stack: "<count> @ <pcs>" and a "#" line per frame.
	_, blocks, _ := strings.Cut(b.String(), "\n")
	for _, block := range strings.Split(blocks, "\n\n") {
		head, frames, ok := strings.Cut(block, "\n")
		count, _, found := strings.Cut(head, " @ ")
		n, err := strconv.Atoi(count)
		if !ok || !found || err != nil || strings.Contains(frames, "goroutineStacks") {
			continue // not a stack, or the one taking this profile
		}
		out[frames] += n
	}
	return out
}

// grownStacks describes the top stacks of after that count more
// goroutines than in before.
func grownStacks(before, after map[string]int, top int) string {
	type grown struct {
		stack string
		by    int
	}
	var gs []grown
	for s, n := range after {
		if d := n - before[s]; d > 0 {
			gs = append(gs, grown{s, d})
		}
	}
	sort.Slice(gs, func(i, j int) bool { return gs[i].by > gs[j].by })
	var b strings.Builder
	for i, g := range gs {
		if i == top {
			break
		}
		fmt.Fprintf(&b, "+%d:\n%s\n", g.by, g.stack)
	}
	return b.String()
}

// liveHeap is the heap the process holds after a garbage collection.
func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}
