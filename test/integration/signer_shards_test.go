package integration

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestSignerShards runs three replicas sharing three labelled Clusters:
// each Cluster is served by exactly one replica, which its status names
// and its claim Lease holds; nodes join in every Cluster. A replica is cut
// off from the management API server, and stops serving before the others
// take its claims; it is killed, its Clusters have moved within its Lease
// duration, nodes join again, and a Machine deleted then has its node
// revoked. A second stops gracefully: its Clusters move at once.
// A Cluster without the --watch-filter label is served by none.
func TestSignerShards(t *testing.T) {
	harness.Binaries(t)
	start := time.Now()
	mgmt := harness.StartManagement(t)
	const (
		ns     = "shards"
		filter = "shards-test"
		lease  = 3 * time.Second
	)
	names := []string{"c0", "c1", "c2"}
	envs := map[string]*signerEnv{}
	for _, n := range names {
		wl := harness.StartControlPlane(t, n)
		mgmt.AddWorkloadCluster(t, ns, n, wl, map[string]string{
			capi.AnnotationEnabled:             "true",
			capi.AnnotationAuthorizedAttestors: "insecure",
		})
		label(t, mgmt, ns, n, filter)
		envs[n] = &signerEnv{mgmt: mgmt, wl: wl, bootstrap: wl.BootstrapClient(t)}
	}
	// Not labelled: left to another controller by --watch-filter. It
	// points at c0's API server, where it would fight c0's signer.
	mgmt.AddWorkloadCluster(t, ns, "unlabelled", envs["c0"].wl, map[string]string{
		capi.AnnotationEnabled:             "true",
		capi.AnnotationAuthorizedAttestors: "insecure",
	})
	t.Logf("control planes ready in %s", time.Since(start).Round(time.Millisecond))

	ids := []string{"replica-a", "replica-b", "replica-c"}
	replicas := map[string]*replica{}
	for _, id := range ids {
		replicas[id] = startReplica(t, mgmt, id, func(o *app.Options) {
			o.ShardLeaseDuration = lease
			o.WatchFilter = filter
			o.ProbePeriod = time.Second
		})
	}

	csrs := 0
	join := func(t *testing.T, cluster string) string {
		t.Helper()
		csrs++
		node, pid := fmt.Sprintf("%s-node-%d", cluster, csrs), fmt.Sprintf("test:///%s/%d", cluster, csrs)
		mgmt.CreateMachine(t, ns, cluster, node, pid, true)
		b, _ := signertest.Request{NodeName: node, ProviderID: pid}.Build(t)
		envs[cluster].file(t, signertest.CSR(node, b))
		envs[cluster].expectIssued(t, node, node, pid, 24*time.Hour)
		return node
	}
	// servedBy waits until every labelled Cluster is served by one of live.
	servedBy := func(t *testing.T, live []string, within time.Duration) map[string]string {
		t.Helper()
		return waitServed(t, mgmt, ns, names, live, within)
	}
	// Every replica runs the controllers of exactly the Clusters it
	// claims, no more: the per-replica gauges add up.
	checkServed := func(t *testing.T, owners map[string]string, live []string) {
		t.Helper()
		if err := pollFor(10*time.Second, func() bool {
			if !servesClaimed(t, owners, live) {
				return false
			}
			for _, id := range live {
				if v, _ := replicaGauge(t, "kubelet_authenticator_signer_shard_members", id); int(v) != len(live) {
					return false
				}
			}
			return true
		}); err != nil {
			t.Errorf("the replicas' gauges do not match the claims %v", owners)
		}
	}

	owners := servedBy(t, ids, 60*time.Second)
	t.Logf("Clusters served by %v, %s after start", owners, time.Since(start).Round(time.Millisecond))
	checkServed(t, owners, ids)
	first := map[string]string{}
	for _, n := range names {
		first[n] = join(t, n)
	}
	if _, ok := attestationIn(t, mgmt, ns, "unlabelled"); ok {
		t.Error("the Cluster without the --watch-filter label has a ClusterAttestation: a replica serves it")
	}
	if h := claimHolder(t, mgmt, ns, "unlabelled"); h != "" {
		t.Errorf("the Cluster without the --watch-filter label is claimed by %s", h)
	}

	// claimsMoved waits until every Cluster's claim is held by one of
	// live, and returns how long that took since t0.
	claimsMoved := func(t *testing.T, live []string, t0 time.Time, within time.Duration) time.Duration {
		t.Helper()
		if err := pollFor(within, func() bool {
			for _, n := range names {
				if !slices.Contains(live, claimHolder(t, mgmt, ns, n)) {
					return false
				}
			}
			return true
		}); err != nil {
			t.Fatalf("claims not held by %v within %s", live, within)
		}
		return time.Since(t0)
	}

	// Cut the replica serving c0 off from the management API server (its
	// requests hang): it stops its controllers before the others may take
	// its claims (two
	// thirds of the Lease duration after its last renewal, against a full
	// duration after they saw it), then it is killed. Its Clusters move
	// within its Lease duration (and the periods in which the others see
	// it renewed and see it expire) and nodes join again.
	victim := replicas[owners["c0"]]
	killed := time.Now()
	victim.cut.Store(true)
	stopped := make(chan time.Duration, 1)
	go func() {
		var d time.Duration
		if pollFor(3*lease, func() bool {
			v, _ := replicaGauge(t, "kubelet_authenticator_signer_shard_clusters_served", victim.id)
			return v == 0
		}) == nil {
			d = time.Since(killed)
		}
		stopped <- d
	}()
	live := slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return id == victim.id })
	moved := claimsMoved(t, live, killed, 3*lease)
	stoppedServing := <-stopped
	if stoppedServing == 0 || stoppedServing > moved {
		t.Errorf("the cut-off replica stopped serving after %s, its Clusters were claimed by others after %s", stoppedServing, moved)
	}
	victim.kill(t)
	if limit := lease + 2*lease/3 + time.Second; moved > limit {
		t.Errorf("Clusters of the killed replica moved in %s, want under %s", moved.Round(time.Millisecond), limit)
	}
	owners = servedBy(t, live, 30*time.Second)
	t.Logf("cut off and killed %s: it stopped serving after %s, claims moved after %s, Clusters served by %v after %s",
		victim.id, stoppedServing.Round(time.Millisecond), moved.Round(time.Millisecond), owners, time.Since(killed).Round(time.Millisecond))
	checkServed(t, owners, live)
	for _, n := range names {
		join(t, n)
	}
	// A Machine whose node joined through the killed replica is deleted:
	// the replica serving its Cluster now revokes the node's name.
	if err := mgmt.Client.Delete(context.Background(), &clusterv1.Machine{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: first["c0"]}}); err != nil {
		t.Fatal(err)
	}
	if err := pollFor(20*time.Second, func() bool { return envs["c0"].revocationState(t).Find(first["c0"]) != nil }); err != nil {
		t.Errorf("the node of a deleted Machine is not revoked after its Cluster moved: %v", err)
	}

	// Stop a second one gracefully: it releases its claims and leaves the
	// ring, and its Clusters move at once to the last replica.
	leaving := replicas[live[0]]
	stoppedAt := time.Now()
	leaving.stop(t)
	last := live[1:]
	moved = claimsMoved(t, last, stoppedAt, lease)
	owners = servedBy(t, last, 30*time.Second)
	t.Logf("stopped %s: claims moved after %s, Clusters served by %v after %s", leaving.id, moved.Round(time.Millisecond), owners, time.Since(stoppedAt).Round(time.Millisecond))
	if moved > lease/2 {
		t.Errorf("Clusters of the stopped replica moved in %s, want under %s", moved.Round(time.Millisecond), lease/2)
	}
	checkServed(t, owners, last)
	for _, n := range names {
		join(t, n)
	}
}
