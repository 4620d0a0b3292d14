package bench

import (
	"flag"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

var (
	shardClusters = flag.Int("shard-clusters", 5000, "BenchmarkSignerShardedClusters: opted-in Clusters")
	shardReplicas = flag.Int("shard-replicas", 2, "BenchmarkSignerShardedClusters: replicas started with --sharding")
	shardServers  = flag.Int("shard-servers", 10, "BenchmarkSignerShardedClusters: workload API servers the Clusters point at, round robin")
)

// BenchmarkSignerShardedClusters measures a fleet of opted-in Clusters
// shared by replicas started with --sharding (default flags otherwise):
// -shard-clusters (5,000) Clusters, all created before the replicas
// start, pointing round robin at -shard-servers workload API servers
// (10), served by -shard-replicas (2). Clusters sharing a server share
// what the controller installs there (deploy/workload's objects, applied
// by each Cluster's identity): at 2,500 Clusters a server, those applies
// to one ClusterRoleBinding time out, which no real fleet (a server per
// Cluster) meets; at 500 they do not. It reports,
// once every Cluster is synced by one replica, how long that took, each
// replica's resident set and goroutines, and what a Cluster costs a
// replica beyond one serving none.
func BenchmarkSignerShardedClusters(b *testing.B) {
	bin := scenario.Binaries(b)
	mgmt := harness.StartManagement(b)
	var servers []*harness.ControlPlane
	for i := range *shardServers {
		servers = append(servers, harness.StartControlPlane(b, fmt.Sprintf("workload-%d", i)))
	}
	ann := map[string]string{scenario.AnnotationEnabled: "true", scenario.AnnotationAttestors: "insecure"}
	for b.Loop() {
		idle := shardStart(b, mgmt, bin, "idle")
		idle.waitSynced(b, 0, time.Minute)
		time.Sleep(10 * time.Second)
		idleRSS, _ := signerProcStatus(b, idle.p.PID())
		idleGoroutines, idleGo := idle.memory(b)
		idle.p.Stop(10 * time.Second)

		start := time.Now()
		ca := newServingCA(b)
		mgmt.AddWorkloadCluster(b, signerNamespace, "wl-00000", servers[0], ann) // and the namespace
		shareServingCA(b, mgmt, signerNamespace, "wl-00000", ca)
		var wg sync.WaitGroup
		for w := range 4 {
			wg.Go(func() {
				for i := 1 + w; i < *shardClusters; i += 4 {
					name := fmt.Sprintf("wl-%05d", i)
					mgmt.AddWorkloadCluster(b, signerNamespace, name, servers[i%len(servers)], ann)
					shareServingCA(b, mgmt, signerNamespace, name, ca)
				}
			})
		}
		wg.Wait()
		b.Logf("%d Clusters created in %s", *shardClusters, time.Since(start).Round(time.Millisecond))

		t0 := time.Now()
		var replicas []*shardReplica
		for i := range *shardReplicas {
			replicas = append(replicas, shardStart(b, mgmt, bin, fmt.Sprintf("replica-%d", i)))
		}
		harness.WaitFor(b, 30*time.Minute, func() (bool, error) {
			total := 0
			for _, r := range replicas {
				total += r.synced()
			}
			return total >= *shardClusters, nil
		})
		ready := time.Since(t0)
		time.Sleep(10 * time.Second) // let the first GC cycles after the lists run
		b.ReportMetric(ready.Seconds(), "s/ready-all-clusters")
		var perCluster, perClusterGo, perClusterGoroutines float64
		for i, r := range replicas {
			served := r.synced()
			rss, _ := signerProcStatus(b, r.p.PID())
			g, goMem := r.memory(b)
			b.ReportMetric(float64(rss)/1024, fmt.Sprintf("MiB/rss-replica-%d", i))
			fmt.Printf("replica %d: %d Clusters, VmRSS %.1f MiB, Go heap and stacks %.1f MiB, %d goroutines (idle replica: %.1f MiB, %.1f MiB, %d goroutines)\n",
				i, served, float64(rss)/1024, float64(goMem)/1024, g, float64(idleRSS)/1024, float64(idleGo)/1024, idleGoroutines)
			share := float64(max(served, 1)) * float64(len(replicas))
			perCluster += float64(rss-idleRSS) / share
			perClusterGo += float64(goMem-idleGo) / share
			perClusterGoroutines += float64(g-idleGoroutines) / share
		}
		b.ReportMetric(perCluster, "KiB/cluster")
		b.ReportMetric(perClusterGo, "KiB-go/cluster")
		b.ReportMetric(perClusterGoroutines, "goroutines/cluster")
		fmt.Printf("%d Clusters on %d workload API servers, %d replicas: all synced %s after start; per Cluster %.1f KiB RSS, %.1f KiB Go heap and stacks, %.1f goroutines\n",
			*shardClusters, len(servers), len(replicas), ready.Round(time.Millisecond), perCluster, perClusterGo, perClusterGoroutines)
		for _, r := range replicas {
			r.p.Stop(10 * time.Second)
		}
	}
}

type shardReplica struct {
	p        *harness.Process
	port     int
	profiler string
}

// shardStart starts a replica with --sharding, named id.
func shardStart(b *testing.B, mgmt *harness.Management, bin, id string) *shardReplica {
	b.Helper()
	r := &shardReplica{port: harness.FreePort(b)}
	r.profiler = fmt.Sprintf("127.0.0.1:%d", harness.FreePort(b))
	args := append(signerControllerArgs(mgmt, fmt.Sprintf("127.0.0.1:%d", r.port)), "--sharding", "--shard-lease-duration=30s",
		"--profiler-address="+r.profiler)
	r.p = harness.StartProcess(b, id, filepath.Join(b.TempDir(), id+".log"), filepath.Join(bin, "node-attestation-controller"), args...)
	return r
}

func (r *shardReplica) metrics() string {
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", r.port))
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return string(body)
}

// synced counts the Clusters the replica has synced.
func (r *shardReplica) synced() int {
	n := 0
	for _, l := range strings.Split(r.metrics(), "\n") {
		if strings.HasPrefix(l, "kubelet_authenticator_signer_workload_cluster_synced{") && strings.HasSuffix(l, " 1") {
			n++
		}
	}
	return n
}

// waitSynced waits for the metrics endpoint to answer with n Clusters
// synced.
func (r *shardReplica) waitSynced(b *testing.B, n int, timeout time.Duration) {
	b.Helper()
	harness.WaitFor(b, timeout, func() (bool, error) {
		return strings.Contains(r.metrics(), "go_goroutines ") && r.synced() >= n, nil
	})
}

// memory returns the replica's goroutines and the KiB its Go heap and
// stacks hold after a collection (signerGoMemory).
func (r *shardReplica) memory(b *testing.B) (goroutines int, kib int64) {
	b.Helper()
	return signerGoMemory(b, r.profiler, r.metrics)
}
