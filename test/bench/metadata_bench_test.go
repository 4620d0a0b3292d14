package bench

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// metadataFlood is how many CSRs with huge metadata BenchmarkSignerMetadataFlood
// files (go test ... -args -metadata-flood=N).
var metadataFlood = flag.Int("metadata-flood", 200, "BenchmarkSignerMetadataFlood: CSRs with huge metadata")

// metadataJoins is how many healthy nodes join during the flood.
const metadataJoins = 50

// floodMetadata gives csr as much metadata as the API server lets a
// requester write: 250 KiB of annotations, 4,000 labels, 2,000 finalizers.
func floodMetadata(csr *certificatesv1.CertificateSigningRequest) {
	csr.Annotations, csr.Labels = map[string]string{}, map[string]string{}
	for i := range 250 {
		csr.Annotations[fmt.Sprintf("example.com/padding-%03d", i)] = strings.Repeat("a", 1000)
	}
	for i := range 4000 {
		csr.Labels[fmt.Sprintf("example.com/label-%04d", i)] = fmt.Sprintf("value-%04d", i)
	}
	for i := range 2000 {
		csr.Finalizers = append(csr.Finalizers, fmt.Sprintf("example.com/finalizer-%04d", i))
	}
}

// BenchmarkSignerMetadataFlood measures what a bootstrap-token holder's
// metadata flood costs the controller: the controller binary (default
// flags) serves a workload cluster; its resident set is read once it is
// ready (idle); then the token files -metadata-flood (200) CSRs, each with
// 250 KiB of annotations, 4,000 labels and 2,000 finalizers, for node names
// no Machine claims (each is denied MachineNotFound), while metadataJoins
// nodes of real Machines file theirs. It reports the idle and the peak
// resident set (VmHWM) under the flood, the growth per flooding CSR, the
// rate at which the healthy nodes were issued during the flood, and the
// peak of a controller started afresh with every flooding CSR still in the
// cluster (a restart lists them all again).
func BenchmarkSignerMetadataFlood(b *testing.B) {
	bin := scenario.Binaries(b)
	mgmt := harness.StartManagement(b)
	wl := harness.StartControlPlane(b, "workload")
	mgmt.AddWorkloadCluster(b, signerNamespace, signerClusterName, wl, map[string]string{
		scenario.AnnotationEnabled:   "true",
		scenario.AnnotationAttestors: "insecure",
	})
	signerCreateMachines(b, mgmt, metadataJoins)
	infra := make([]string, metadataJoins)
	for i := range infra {
		infra[i] = signerMachineName(i)
	}
	mgmt.ServeInfrastructure(b, signerNamespace, infra...)
	bootstrap := signerBootstrapClient(b, wl)
	n := *metadataFlood

	// The flooding requests, built before the clock runs.
	flood := make([]*certificatesv1.CertificateSigningRequest, n)
	for i := range flood {
		req, _ := signertest.Request{NodeName: fmt.Sprintf("flood-%05d", i), ProviderID: fmt.Sprintf("test:///flood/%05d", i)}.Build(b)
		csr := signertest.CSR(fmt.Sprintf("flood-%05d", i), req)
		csr.Spec.Username, csr.Spec.Groups = "", nil
		floodMetadata(csr)
		flood[i] = csr
	}
	b.Logf("each flooding CSR is %d bytes as filed", flood[0].Size())

	for b.Loop() {
		port := harness.FreePort(b)
		p := harness.StartProcess(b, "node-attestation-controller", filepath.Join(b.TempDir(), "controller.log"),
			filepath.Join(bin, "node-attestation-controller"), signerControllerArgs(mgmt, fmt.Sprintf("127.0.0.1:%d", port))...)
		waitSynced(b, port)
		time.Sleep(5 * time.Second)
		idleRSS, idleHWM := signerProcStatus(b, p.PID())

		// Sample the resident set while the flood is filed and decided.
		stop := make(chan struct{})
		var peakRSS int64
		var sampler sync.WaitGroup
		sampler.Go(func() {
			t := time.NewTicker(200 * time.Millisecond)
			defer t.Stop()
			for {
				if rss, _ := signerProcStatus(b, p.PID()); rss > peakRSS {
					peakRSS = rss
				}
				select {
				case <-stop:
					return
				case <-t.C:
				}
			}
		})
		t0 := time.Now()
		var filing sync.WaitGroup
		filing.Go(func() {
			signerParallel(b, n, func(ctx context.Context, i int) error {
				_, err := bootstrap.CertificatesV1().CertificateSigningRequests().Create(ctx, flood[i], metav1.CreateOptions{})
				return err
			})
		})
		joined := time.Now()
		names := signerFileCSRs(b, bootstrap, "join", metadataJoins)
		first, last := signerWaitIssued(b, wl.Client, names)
		filing.Wait()
		filed := time.Since(t0)
		// Counted by the controller: a list of the flood here would cost
		// this process what the benchmark measures in the controller.
		waitMetric(b, port, fmt.Sprintf(`kubelet_authenticator_signer_csr_decisions_total{cluster="%s/%s",decision="denied",reason="MachineNotFound"}`, signerNamespace, signerClusterName), float64(n))
		decided := time.Since(t0)
		time.Sleep(5 * time.Second)
		close(stop)
		sampler.Wait()
		rss, hwm := signerProcStatus(b, p.PID())
		p.Stop(10 * time.Second)
		b.Logf("flood of %d CSRs filed in %s, all denied %s after it began; %d healthy nodes issued %s after they filed (first after %s)",
			n, filed.Round(time.Millisecond), decided.Round(time.Millisecond), metadataJoins, last.Sub(joined).Round(time.Millisecond), first.Sub(joined).Round(time.Millisecond))
		b.Logf("controller idle: VmRSS %d KiB, VmHWM %d KiB; under the flood: peak VmRSS %d KiB, VmHWM %d KiB; after it: VmRSS %d KiB", idleRSS, idleHWM, peakRSS, hwm, rss)

		// A restart lists every flooding request again.
		restart := signerMeasureRSS(b, mgmt, bin, nil)

		b.ReportMetric(float64(idleRSS)/1024, "MiB/rss-idle")
		b.ReportMetric(float64(idleHWM)/1024, "MiB/hwm-idle")
		b.ReportMetric(float64(hwm)/1024, "MiB/hwm-flood")
		b.ReportMetric(float64(rss-idleRSS)/float64(n), "KiB/flood-csr")
		b.ReportMetric(float64(metadataJoins)/last.Sub(joined).Seconds(), "joins/s-during-flood")
		b.ReportMetric(float64(restart.hwm)/1024, "MiB/hwm-restart")
		signerDeleteFlood(b, wl, n)
	}
}

// waitSynced waits until the controller whose metrics listen on port
// serves the benchmark's workload cluster.
func waitSynced(b *testing.B, port int) {
	b.Helper()
	waitMetric(b, port, fmt.Sprintf(`kubelet_authenticator_signer_workload_cluster_synced{cluster="%s/%s"}`, signerNamespace, signerClusterName), 1)
}

// waitMetric waits until the metric series (name and labels as exposed)
// of the controller whose metrics listen on port reaches at least want.
func waitMetric(b *testing.B, port int, series string, want float64) {
	b.Helper()
	harness.WaitFor(b, 10*time.Minute, func() (bool, error) {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
		if err != nil {
			return false, nil
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return false, nil
		}
		for line := range strings.Lines(string(body)) {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), series+" "); ok {
				f, err := strconv.ParseFloat(v, 64)
				return err == nil && f >= want, nil
			}
		}
		return false, nil
	})
}

// signerDeleteFlood removes the flooding CSRs' finalizers and deletes every
// CSR of wl.
func signerDeleteFlood(b *testing.B, wl *harness.ControlPlane, n int) {
	b.Helper()
	api := wl.Client.CertificatesV1().CertificateSigningRequests()
	signerParallel(b, n, func(ctx context.Context, i int) error {
		_, err := api.Patch(ctx, fmt.Sprintf("flood-%05d", i), "application/merge-patch+json", []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
		return err
	})
	signerDeleteCSRs(b, wl.Client)
}
