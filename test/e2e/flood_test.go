package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// TestControllerMemoryUnderFlood: a bootstrap-token holder files large
// requests, to the controller's signer name and to another one, as fast as
// the API server takes them. The controller binary's resident memory grows
// by far less than what was filed (it watches only its signer names and
// caches no more of a request than it reads), every flooding request of
// ours is denied, and a node joins afterwards.
func TestControllerMemoryUnderFlood(t *testing.T) {
	if testing.Short() {
		t.Skip("starts API servers")
	}
	env := scenario.Start(t, scenario.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	// A node joins first: the controller has synced and signs.
	first := env.NewNode(t, "before", "test:///flood/before", "insecure")
	env.Machine(t, first)
	if r := first.Credential(ctx); r.Err != nil {
		t.Fatalf("node before the flood: %v\n%s\ncontroller log:\n%s", r.Err, r.Stderr, env.ControllerLog())
	}
	pid := env.ControllerPID()
	time.Sleep(2 * time.Second)
	base := rssKiB(t, pid)

	cfg, err := clientcmd.BuildConfigFromFlags("", env.BootstrapKubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cfg.QPS, cfg.Burst = 200, 200
	cs := kubernetes.NewForConfigOrDie(cfg)

	// Sample the controller's resident memory while the flood lasts.
	var peak atomic.Int64
	peak.Store(base)
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			if v := rssKiBOrZero(pid); v > peak.Load() {
				peak.Store(v)
			}
		}
	}()

	const perSigner = 60
	junk := bytes.Repeat([]byte("0123456789abcdef"), 64<<10) // 1 MiB past the CSR block
	signers := []string{attestor.ClientSignerName("insecure"), "example.com/not-ours"}
	var wg sync.WaitGroup
	var filed atomic.Int64
	start := time.Now()
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < perSigner*len(signers); i += 4 {
				signer := signers[i%len(signers)]
				b, _ := signertest.Request{NodeName: fmt.Sprintf("flood-%d", i), ProviderID: "test:///flood/x", Trailer: junk}.Build(t)
				csr := signertest.CSR(fmt.Sprintf("flood-%d", i), b)
				csr.Spec.SignerName = signer
				if _, err := cs.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{}); err != nil {
					t.Errorf("filing %s: %v", csr.Name, err)
					return
				}
				filed.Add(int64(len(csr.Spec.Request)))
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)

	// Every request of ours is denied for its size.
	deadline := time.Now().Add(5 * time.Minute)
	for i := 0; i < perSigner*len(signers); i += len(signers) {
		name := fmt.Sprintf("flood-%d", i)
		for {
			csr, err := cs.CertificatesV1().CertificateSigningRequests().Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if reason := deniedReason(csr); reason != "" {
				if reason != attestor.ReasonMalformedRequest {
					t.Errorf("%s denied %s, want %s", name, reason, attestor.ReasonMalformedRequest)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s not denied 5 minutes after the flood\ncontroller log:\n%s", name, harness.LastLines(env.ControllerLog(), 40))
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	time.Sleep(time.Second)
	close(stop)
	<-sampled

	// A node joins after the flood.
	after := env.NewNode(t, "after", "test:///flood/after", "insecure")
	env.Machine(t, after)
	if r := after.Credential(ctx); r.Err != nil {
		t.Fatalf("node after the flood: %v\n%s", r.Err, r.Stderr)
	}

	grew := peak.Load() - base
	filedKiB := filed.Load() >> 10
	t.Logf("filed %d requests, %d MiB, in %s; controller RSS %d MiB before, peak %d MiB (+%d MiB, %.0f%% of what was filed)",
		perSigner*len(signers), filedKiB>>10, took.Round(time.Millisecond), base>>10, peak.Load()>>10, grew>>10, 100*float64(grew)/float64(filedKiB))
	// Caching every request (what the controller did before it watched
	// only its signer names and truncated what it does not read) holds all
	// that was filed, and grows by more; a bounded cache grows by what it
	// decodes on the way (about 40% here, garbage the collector takes
	// back), whatever else was filed.
	if grew > filedKiB {
		t.Errorf("controller RSS grew by %d MiB under a flood of %d MiB: its memory follows the flood", grew>>10, filedKiB>>10)
	}
}

func deniedReason(csr *certificatesv1.CertificateSigningRequest) string {
	for _, c := range csr.Status.Conditions {
		if c.Type == certificatesv1.CertificateDenied {
			return c.Reason
		}
	}
	return ""
}

// rssKiB returns a process's resident set size in KiB.
func rssKiB(t *testing.T, pid int) int64 {
	t.Helper()
	v := rssKiBOrZero(pid)
	if v == 0 {
		t.Fatalf("no VmRSS for process %d", pid)
	}
	return v
}

func rssKiBOrZero(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			v, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return v
		}
	}
	return 0
}
