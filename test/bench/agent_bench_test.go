package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// agentRSSTarget is the agent's steady-state resident set the project aims
// to stay under.
const agentRSSTarget = 30 // MiB

// BenchmarkAgentRSS runs the node agent as released (`kubelet-authenticator
// agent`, no build tags) against the real controller: it obtains its
// certificate through the bootstrap token and projects a ClusterTrustBundle
// to disk, then idles as it does between renewals. After it settles, its
// resident set is sampled once a second for agentRSSSamples seconds; it
// reports the median VmRSS and the peak (VmHWM), beside agentRSSTarget.
func BenchmarkAgentRSS(b *testing.B) {
	env := scenario.Start(b, scenario.Options{})
	ctx := context.Background()
	ca, err := harness.NewCA("bench-bundle")
	if err != nil {
		b.Fatal(err)
	}
	if _, err := env.Workload.Client.CertificatesV1beta1().ClusterTrustBundles().Create(ctx, &certificatesv1beta1.ClusterTrustBundle{
		ObjectMeta: metav1.ObjectMeta{Name: "root"},
		Spec:       certificatesv1beta1.ClusterTrustBundleSpec{TrustBundle: string(ca.CertPEM)},
	}, metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
	bundle := filepath.Join(b.TempDir(), "root", "ca.crt")
	n := env.NewNode(b, "agent-1", "test:///fleet/agent-1", "insecure",
		fmt.Sprintf("agent:\n  metricsBindAddress: 127.0.0.1:%d\ntrustBundles:\n- name: root\n  path: %s\n", harness.FreePort(b), bundle))
	env.Machine(b, n)
	agent := buildRelease(b, "../../cmd/kubelet-authenticator")

	const agentRSSSamples = 10
	for b.Loop() {
		p := harness.StartProcess(b, "kubelet-authenticator agent", filepath.Join(b.TempDir(), "agent.log"), agent, "agent", "--config="+n.ConfigPath)
		harness.WaitFor(b, 2*time.Minute, func() (bool, error) {
			_, errB := os.Stat(bundle)
			_, errC := os.Stat(filepath.Join(n.CacheDir, cache.CurrentFile))
			return errB == nil && errC == nil, nil
		})
		time.Sleep(10 * time.Second) // settle: the first GC cycles after start-up
		var rss sample
		var hwm int64
		for range agentRSSSamples {
			r, h := signerProcStatus(b, p.PID())
			rss.wall = append(rss.wall, time.Duration(r)) // KiB, sorted as durations
			hwm = max(hwm, h)
			time.Sleep(time.Second)
		}
		p.Stop(10 * time.Second)
		med := float64(rss.median()) / 1024
		b.ReportMetric(med, "MiB/rss")
		b.ReportMetric(float64(hwm)/1024, "MiB/hwm")
		b.ReportMetric(agentRSSTarget, "MiB/target")
		fmt.Printf("agent steady state: VmRSS median %.1f MiB (target %d MiB: %.2fx), VmHWM %.1f MiB\n",
			med, agentRSSTarget, med/agentRSSTarget, float64(hwm)/1024)
	}
}
