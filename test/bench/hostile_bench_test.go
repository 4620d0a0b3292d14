package bench

import (
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// hostileWindow is how long the hostile servers attack while the healthy
// cluster's joins are measured.
const hostileWindow = 60 * time.Second

// BenchmarkSignerHostile measures the controller binary serving one
// healthy workload cluster while four tenants' API servers attack it
// (harness.HostileAPIServer: a 48 MiB answer, a list dripped a byte at a
// time, endless 8 MiB watch events, endless distinct 512 KiB CSRs): its
// resident memory idle and its peak (VmHWM) under attack, and the healthy
// cluster's join rate (insecure CSRs issued per second, in batches of 20)
// before and during the attack. The controller runs with the default
// bounds but a CSR cache budget of 64 MiB per cluster and a 5s first
// retry, so the hostile clusters are connected to again often.
func BenchmarkSignerHostile(b *testing.B) {
	bin := scenario.Binaries(b)
	mgmt := harness.StartManagement(b)
	wl := harness.StartControlPlane(b, "workload")
	mgmt.AddWorkloadCluster(b, signerNamespace, signerClusterName, wl, map[string]string{
		scenario.AnnotationEnabled:   "true",
		scenario.AnnotationAttestors: "insecure",
	})
	bootstrap := signerBootstrapClient(b, wl)
	const batch = 20
	signerCreateMachines(b, mgmt, batch)
	for b.Loop() {
		port := harness.FreePort(b)
		args := append(signerControllerArgs(mgmt, fmt.Sprintf("127.0.0.1:%d", port)),
			"--workload-bounds-retry=5s", fmt.Sprintf("--workload-max-cached-csr-bytes=%d", 64<<20))
		p := harness.StartProcess(b, "node-attestation-controller", filepath.Join(b.TempDir(), "controller.log"),
			filepath.Join(bin, "node-attestation-controller"), args...)
		synced := fmt.Sprintf(`kubelet_authenticator_signer_workload_cluster_synced{cluster="%s/%s"} 1`, signerNamespace, signerClusterName)
		harness.WaitFor(b, 3*time.Minute, func() (bool, error) {
			resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
			if err != nil {
				return false, nil
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			return err == nil && strings.Contains(string(body), synced), nil
		})
		round := 0
		joins := func(d time.Duration) float64 {
			start, n := time.Now(), 0
			for n == 0 || time.Since(start) < d {
				signerWaitIssued(b, wl.Client, signerFileCSRs(b, bootstrap, fmt.Sprintf("h%d", round), batch))
				signerDeleteCSRs(b, wl.Client)
				round++
				n += batch
			}
			return float64(n) / time.Since(start).Seconds()
		}
		idleRate := joins(15 * time.Second)
		time.Sleep(5 * time.Second)
		idleRSS, idleHWM := signerProcStatus(b, p.PID())

		servers := map[string]*harness.HostileAPIServer{}
		for _, mode := range []string{harness.HostileOversize, harness.HostileDrip, harness.HostileFlood, harness.HostileHoard} {
			servers[mode] = harness.StartHostileAPIServer(b, mode)
			mgmt.AddHostileCluster(b, fmt.Sprintf("hostile-%d", round), mode, servers[mode])
		}
		hostileRate := joins(hostileWindow)
		rss, hwm := signerProcStatus(b, p.PID())
		for mode, s := range servers {
			b.Logf("%s: requests answered %v", mode, s.Requests())
			s.Stop()
		}
		p.Stop(10 * time.Second)
		b.Logf("idle: VmRSS %d MiB, VmHWM %d MiB, %.1f joins/s; under attack for %s: VmRSS %d MiB, VmHWM %d MiB, %.1f joins/s",
			idleRSS>>10, idleHWM>>10, idleRate, hostileWindow, rss>>10, hwm>>10, hostileRate)
		b.ReportMetric(float64(idleRSS)/1024, "MiB/rss-idle")
		b.ReportMetric(float64(idleHWM)/1024, "MiB/hwm-idle")
		b.ReportMetric(float64(hwm)/1024, "MiB/hwm-hostile")
		b.ReportMetric(idleRate, "joins/s-idle")
		b.ReportMetric(hostileRate, "joins/s-hostile")
	}
}
