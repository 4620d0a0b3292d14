package integration

import (
	"bytes"
	"fmt"
	"sync"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestSignerFlood: a bootstrap-token holder of one workload cluster floods
// the controller's signer name with requests far larger than the signer
// reads. Every one is denied for its size, a node of another cluster joins
// while the flood is under way, and a node of the flooded cluster joins
// once it has passed.
func TestSignerFlood(t *testing.T) {
	harness.Binaries(t)
	mgmt := harness.StartManagement(t)
	const ns = "flood"
	envs := map[string]*signerEnv{}
	for _, n := range []string{"flooded", "quiet"} {
		wl := harness.StartControlPlane(t, n)
		mgmt.AddWorkloadCluster(t, ns, n, wl, map[string]string{
			capi.AnnotationEnabled:             "true",
			capi.AnnotationAuthorizedAttestors: "insecure",
		})
		envs[n] = &signerEnv{mgmt: mgmt, wl: wl, bootstrap: wl.BootstrapClient(t)}
	}
	runSigner(t, mgmt, nil)

	const flood = 60
	junk := bytes.Repeat([]byte("0123456789abcdef"), 48<<10) // 768 KiB after the three PEM blocks
	var wg sync.WaitGroup
	start := time.Now()
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < flood; i += 4 {
				b, _ := signertest.Request{NodeName: fmt.Sprintf("flood-%d", i), ProviderID: "test:///flood", Trailer: junk}.Build(t)
				envs["flooded"].file(t, signertest.CSR(fmt.Sprintf("flood-%d", i), b))
			}
		}()
	}

	// Another cluster's node joins during the flood.
	mgmt.CreateMachine(t, ns, "quiet", "quiet-0", "test:///quiet/0", true)
	b, _ := signertest.Request{NodeName: "quiet-0", ProviderID: "test:///quiet/0"}.Build(t)
	filed := time.Now()
	envs["quiet"].file(t, signertest.CSR("quiet-0", b))
	envs["quiet"].expectIssued(t, "quiet-0", "quiet-0", "test:///quiet/0", 24*time.Hour)
	t.Logf("a node of another cluster joined in %s during the flood", time.Since(filed).Round(time.Millisecond))
	wg.Wait()
	t.Logf("%d requests of %d KiB filed in %s", flood, len(junk)>>10, time.Since(start).Round(time.Millisecond))

	for i := range flood {
		envs["flooded"].expectDenied(t, fmt.Sprintf("flood-%d", i), attestor.ReasonMalformedRequest)
	}
	t.Logf("every flooding request denied %s after the flood began", time.Since(start).Round(time.Millisecond))

	// The flooded cluster's own nodes still join.
	mgmt.CreateMachine(t, ns, "flooded", "flooded-0", "test:///flooded/0", true)
	b, _ = signertest.Request{NodeName: "flooded-0", ProviderID: "test:///flooded/0"}.Build(t)
	envs["flooded"].file(t, signertest.CSR("flooded-0", b))
	envs["flooded"].expectIssued(t, "flooded-0", "flooded-0", "test:///flooded/0", 24*time.Hour)
}
