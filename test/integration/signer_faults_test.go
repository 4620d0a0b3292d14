package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// faultWave is how many nodes per Cluster join during each fault of
// TestSignerFaults; make bench-signer asks for more.
var faultWave = flag.Int("fault-wave", 2, "nodes per Cluster joining during each fault of TestSignerFaults")

// TestSignerFaults joins a fleet (three workload clusters, nodes joining
// several at a time) through three sharded replicas while, in turn, the
// replica serving a Cluster is killed (twice, a fresh replica started
// after the first), the management kube-apiserver is restarted, a
// workload kube-apiserver is restarted, a workload cluster is cut off
// from the replicas (a proxy dropping every connection) then restored,
// its watches are expired (its etcd compacted while the proxy refuses
// connections: its API server, which reads etcd without a watch cache,
// answers the replicas' watches 410 Gone once they reach it again), its
// traffic is delayed (a second each way), and a Cluster opts out, its
// joins filed meanwhile and the Machine of one deleted, then opts in
// again. Each fault hits a wave of joins in flight, among them TPM nodes
// (two rounds: the challenge, then its answer; each node's first answer
// filed a second time, under another name, by its bootstrap token) in
// the Cluster the fault is about, and during the management API server's
// restart two nodes of two Clusters sharing one TPM. What happened is
// read from the workload API servers' requests and audit logs and the
// management cluster's trust-on-first-use records, not from the
// controller: every node with a Machine gets a certificate, approved once
// and issued once (one certificate stored per request, the one its node
// holds; a replica that took over re-signs a request whose certificate
// write was cut, never one whose write was stored); no challenge is
// accepted twice (checkTPMJoins); of the two nodes sharing a TPM one
// joins, the other is denied IdentityClaimedByOtherMachine, and each
// joined TPM's identity is recorded once, for its own Machine; every
// impostor, and the node whose Machine was deleted while its request was
// pending, is denied, with a reason and a message, never signed; the
// replicas watched from a
// compacted resource version and listed again; once the faults stop each
// Cluster is served by exactly one live replica, which runs no other
// Cluster's controller; and the process's goroutines and live heap are
// back to their idle figures. The replica leading when the management
// API server restarts exits (controller-runtime's manager ends when it
// loses its Lease) and a fresh one replaces it. The time each fault
// takes to recover from (until every join of its wave is decided) is
// bounded and logged; docs/performance.md quotes it.
//
// A killed replica reaches the management cluster no more (its Leases
// expire), while a write to a workload cluster it had already sent may
// still land, as after SIGKILL.
func TestSignerFaults(t *testing.T) {
	harness.Binaries(t)
	start := time.Now()
	const (
		ns    = "faults"
		lease = 3 * time.Second
		// A killed replica's Clusters move once its claims expire and
		// are taken (TestSignerShards), then its joins are decided.
		killRecovery = 2*lease + 3*time.Second
		// Once an API server answers again, the replicas reconnect and
		// reclaim well before a Cluster's backoff after a bound exceeded
		// (30s), which a restart must not be taken for.
		restartRecovery = 15 * time.Second
		// After an expired watch client-go's reflector lists again after
		// its backoff (0.8 s doubling to 30 s, jittered, reset after two
		// quiet minutes), grown by the connections refused meanwhile.
		expireRecovery = 20 * time.Second
	)
	wave := *faultWave // nodes per Cluster joining during each fault
	names := []string{"c0", "c1", "c2"}
	// Each wave: the Clusters whose joins its fault hits, whether they
	// include an impostor and an orphan, and the Cluster whose TPM nodes
	// join during it: the one the fault is about (the killed replica's,
	// the restarted or cut off API server's, the one opted out).
	type waveSpec struct {
		name               string
		in                 []string
		impostors, orphans bool
		tpm                string
	}
	specs := []waveSpec{
		{name: "calm", in: names, tpm: "c0"},
		{name: "kill1", in: names, impostors: true, tpm: "c0"},
		{name: "kill2", in: names, tpm: "c1"},
		{name: "mgmt", in: names, tpm: "c1"},
		{name: "wl", in: names, tpm: "c2"},
		{name: "cut", in: names, tpm: "c1"},
		// The faults of one cluster hit its joins only.
		{name: "expire", in: []string{"c1"}, tpm: "c1"},
		{name: "delay", in: []string{"c1"}, tpm: "c1"},
		{name: "optout", in: []string{"c0"}, orphans: true, tpm: "c0"},
	}
	// TPM nodes join in two rounds (the challenge, then its answer), each
	// on its own swtpm; the management API server's restart has two more,
	// in c0 and c2, sharing one TPM (a device moved between Machines):
	// their Clusters' replicas race to record its identity.
	tpmPer := (wave + 1) / 2
	tpmCount := len(specs)*tpmPer + 1
	// Manufactured while the control planes start.
	startTPMs := harness.ProvisionSwtpms(t, tpmCount)
	mgmt := harness.StartManagement(t)
	envs := map[string]*signerEnv{}
	bootstrapKubeconfigs := map[string]string{}
	for _, n := range names {
		opts := []harness.Option{harness.WithAuditLog()}
		if n == "c1" {
			// Watches read etcd directly: once etcd is compacted past a
			// watch's resource version, the API server answers 410.
			opts = append(opts, harness.WithAPIServerArgs("--watch-cache=false"))
		}
		wl := harness.StartControlPlane(t, n, opts...)
		mgmt.AddWorkloadCluster(t, ns, n, wl, map[string]string{
			capi.AnnotationEnabled:             "true",
			capi.AnnotationAuthorizedAttestors: "insecure,tpm",
		})
		// One bootstrap token per cluster, as kubeadm's join token: its
		// nodes, and whoever copies their answers, file as one user.
		bootstrapKubeconfigs[n] = wl.BootstrapKubeconfig(t, wl.CreateBootstrapToken(t))
		cfg, err := clientcmd.BuildConfigFromFlags("", bootstrapKubeconfigs[n])
		if err != nil {
			t.Fatal(err)
		}
		envs[n] = &signerEnv{mgmt: mgmt, wl: wl, bootstrap: kubernetes.NewForConfigOrDie(cfg)}
	}
	t.Logf("control planes ready in %s", time.Since(start).Round(time.Millisecond))
	tpms := startTPMs()
	manufacturer := tpms[0].Bundle
	t.Logf("%d swtpm TPMs manufactured and started, %s after start", tpmCount, time.Since(start).Round(time.Millisecond))
	// The replicas reach c1 through a proxy that can cut it off.
	c1, err := url.Parse(envs["c1"].wl.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := harness.StartTCPProxy(t, c1.Host)
	certPEM, keyPEM := envs["c1"].wl.IssueClientCert(t, "proxied-admin", "system:masters")
	setKubeconfig(t, mgmt, ns, "c1", envs["c1"].wl.KubeconfigFor("https://"+proxy.Addr(), clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}))

	replicas := map[string]*replica{}
	live := []string{}
	startOne := func(id string) {
		replicas[id] = startReplica(t, mgmt, id, func(o *app.Options) {
			o.ShardLeaseDuration = lease
			o.ProbePeriod = time.Second
			o.MaxClientCertificateLifetime = 24 * time.Hour
			o.TPM.ManufacturerCAs = []string{manufacturer} // one manufacturer made them all
		})
		live = append(live, id)
	}
	for _, id := range []string{"replica-a", "replica-b", "replica-c"} {
		startOne(id)
	}
	owners := waitServed(t, mgmt, ns, names, live, 60*time.Second)
	t.Logf("Clusters served by %v, %s after start", owners, time.Since(start).Round(time.Millisecond))

	// Every node's Machine exists before the faults start, as Cluster API
	// creates it before the machine boots; the CSRs are built now too.
	type node struct {
		cluster, name, providerID string
		csr                       *certificatesv1.CertificateSigningRequest
		impostor                  bool // no Machine when decided: must be denied
		orphan                    bool // its Machine is deleted while its CSR is pending
		tpm                       *tpmNode
	}
	var nodes []*node
	var tpmNodes []*tpmNode
	// newTPMNode makes a TPM node on the next swtpm, or on twin's.
	newTPMNode := func(c, label string, twin *tpmNode) *node {
		n := &node{cluster: c, name: c + "-" + label, providerID: fmt.Sprintf("test:///%s/%s", c, label)}
		m := mgmt.CreateMachine(t, ns, c, n.name, n.providerID, true)
		var dev *harness.Swtpm
		if twin != nil {
			dev = twin.dev
		} else {
			dev, tpms = tpms[0], tpms[1:]
		}
		n.tpm = newTPMSource(t, c, n.name, n.providerID, m.UID, dev, bootstrapKubeconfigs[c])
		if twin != nil {
			twin.twin, n.tpm.twin = n.tpm, twin
		}
		tpmNodes = append(tpmNodes, n.tpm)
		return n
	}
	// newNodes makes a wave of wave nodes per Cluster of in, and tpmPer
	// TPM nodes in Cluster tpmIn, with an impostor (never a Machine) and
	// an orphan (a Machine, deleted while its request is pending) per
	// Cluster when asked for.
	newNodes := func(label string, in []string, impostors, orphans bool, tpmIn string) []*node {
		var out []*node
		for _, c := range in {
			for i := range wave {
				n := &node{cluster: c, name: fmt.Sprintf("%s-%s-%d", c, label, i), providerID: fmt.Sprintf("test:///%s/%s/%d", c, label, i)}
				mgmt.CreateMachine(t, ns, c, n.name, n.providerID, true)
				out = append(out, n)
			}
			for i := range tpmPer {
				if c == tpmIn {
					out = append(out, newTPMNode(c, fmt.Sprintf("%s-tpm-%d", label, i), nil))
				}
			}
			if impostors {
				out = append(out, &node{cluster: c, name: fmt.Sprintf("%s-%s-impostor", c, label), providerID: fmt.Sprintf("test:///%s/%s/impostor", c, label), impostor: true})
			}
			if orphans {
				n := &node{cluster: c, name: fmt.Sprintf("%s-%s-orphan", c, label), providerID: fmt.Sprintf("test:///%s/%s/orphan", c, label), impostor: true, orphan: true}
				mgmt.CreateMachine(t, ns, c, n.name, n.providerID, true)
				out = append(out, n)
			}
		}
		for _, n := range out {
			if n.tpm != nil {
				continue // its node attestor files its own
			}
			b, _ := signertest.Request{NodeName: n.name, ProviderID: n.providerID}.Build(t)
			n.csr = signertest.CSR(n.name, b)
			n.csr.Spec.Username, n.csr.Spec.Groups = "", nil
		}
		nodes = append(nodes, out...)
		return out
	}
	waves := map[string][]*node{}
	for _, s := range specs {
		waves[s.name] = newNodes(s.name, s.in, s.impostors, s.orphans, s.tpm)
	}
	twin := newTPMNode("c0", "mgmt-twin", nil)
	waves["mgmt"] = append(waves["mgmt"], twin, newTPMNode("c2", "mgmt-twin", twin.tpm))
	nodes = append(nodes, waves["mgmt"][len(waves["mgmt"])-2:]...)
	// Each TPM node's first answer to a challenge is filed a second time
	// under another name, by its cluster's bootstrap token, as it is seen.
	replays := map[string]*answerReplayer{}
	for _, c := range names {
		replays[c] = replayAnswers(t, envs[c].wl, envs[c].bootstrap)
	}

	// join files every CSR of ns at once (retrying, as kubelet does, while
	// the API server is away) and waits until all are decided; it returns
	// the time the last was decided, and what went wrong.
	join := func(ns []*node, within time.Duration) (time.Time, []error) {
		var mu sync.Mutex
		var errs []error
		last := time.Time{}
		var wg sync.WaitGroup
		for _, n := range ns {
			wg.Go(func() {
				var decided time.Time
				var err error
				if n.tpm != nil {
					decided, err = n.tpm.join(within)
				} else {
					decided, err = joinOne(envs[n.cluster], n.csr, n.impostor, within)
				}
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, fmt.Errorf("%s: %w", n.name, err))
				}
				if decided.After(last) {
					last = decided
				}
			})
		}
		wg.Wait()
		return last, errs
	}
	joined := func(w string, errs []error) {
		t.Helper()
		for _, err := range errs {
			t.Errorf("wave %s: %v", w, err)
		}
		if len(errs) > 0 {
			t.FailNow()
		}
	}
	recovery := map[string]time.Duration{}
	// fault injects a fault, which returns when it was over (at once for
	// a kill, once the API server answered again for a restart); the joins
	// of wave w start after delay, so that they are filed while it lasts.
	// It records how long after the fault was over the last of them was
	// decided.
	fault := func(w string, delay, within time.Duration, inject func() time.Time) {
		t.Helper()
		type result struct {
			last time.Time
			errs []error
		}
		done := make(chan result, 1)
		go func() {
			time.Sleep(delay)
			last, errs := join(waves[w], 90*time.Second)
			done <- result{last, errs}
		}()
		at := time.Now()
		over := inject()
		r := <-done
		joined(w, r.errs)
		// Joins all decided while it lasted (a delay) recovered at once.
		recovery[w] = max(0, r.last.Sub(over))
		t.Logf("%s: fault over after %s, every join of its wave decided %s after it began, %s after it was over",
			w, over.Sub(at).Round(time.Millisecond), r.last.Sub(at).Round(time.Millisecond), r.last.Sub(over).Round(time.Millisecond))
		if recovery[w] > within {
			t.Errorf("%s: joins recovered %s after the fault was over, want under %s", w, recovery[w].Round(time.Millisecond), within)
		}
	}

	calm := time.Now()
	last, errs := join(waves["calm"], 30*time.Second)
	joined("calm", errs)
	recovery["calm"] = last.Sub(calm)
	t.Logf("calm: a wave of %d joins decided in %s", len(waves["calm"]), recovery["calm"].Round(time.Millisecond))

	// kill stops the replica serving cluster abruptly: its Leases are left
	// to expire, as after SIGKILL.
	kill := func(cluster string) func() time.Time {
		return func() time.Time {
			time.Sleep(100 * time.Millisecond) // its joins are in flight
			at := time.Now()
			victim := replicas[owners[cluster]]
			victim.kill(t)
			live = slices.DeleteFunc(live, func(id string) bool { return id == victim.id })
			t.Logf("killed %s, which served %s", victim.id, cluster)
			return at
		}
	}
	fault("kill1", 0, killRecovery, kill("c0"))
	owners = waitServed(t, mgmt, ns, names, live, 30*time.Second)
	startOne("replica-d")
	owners = waitServed(t, mgmt, ns, names, live, 30*time.Second)
	t.Logf("Clusters served by %v", owners)
	fault("kill2", 0, killRecovery, kill("c1"))
	owners = waitServed(t, mgmt, ns, names, live, 30*time.Second)

	// restart restarts cp's kube-apiserver; the fault is over when it
	// answers again (not yet ready: the harness waits for that).
	restart := func(cp *harness.ControlPlane) func() time.Time {
		return func() time.Time {
			back := answersAgain(cp)
			cp.RestartAPIServer(t)
			return <-back
		}
	}
	// A replica leads (its leader-only work runs) when the management API
	// server goes away; after a kill, another is elected once the killed
	// one's leader Lease expires.
	if err := pollFor(45*time.Second, func() bool { return leaderRenewed(t, mgmt, 3*time.Second) }); err != nil {
		t.Fatalf("no replica leads: %v", err)
	}
	fault("mgmt", lease, restartRecovery, restart(mgmt.ControlPlane))
	// The replica holding the leader Lease (its leader-only work: the
	// trust-on-first-use cleaner, ...) could not renew it past its renew
	// deadline (10 s): controller-runtime ends its manager, and the
	// process exits, to be restarted by its Deployment. Any other end is
	// a fault not survived.
	for _, id := range slices.Clone(live) {
		if done, err := replicas[id].exited(); done {
			if err == nil || err.Error() != "leader election lost" {
				t.Errorf("replica %s ended during the management API server's restart: %v", id, err)
			}
			t.Logf("replica %s exited (%v), as a leader does when the management API server is away past its renew deadline; a fresh one replaces it", id, err)
			live = slices.DeleteFunc(live, func(l string) bool { return l == id })
			startOne(id + "-restarted")
		}
	}
	owners = waitServed(t, mgmt, ns, names, live, 30*time.Second)
	// The replicas are the last ones: what the process holds now is its
	// idle figure, to which it returns once the faults stop.
	idleG, idleStacks := settledGoroutines(t, 0)
	idleHeap := liveHeap()

	fault("wl", lease, restartRecovery, restart(envs["c2"].wl))

	// c1's etcd compacted while the replicas cannot reach c1 (connections
	// refused, so that their watches resume from the resource version
	// they had, as client-go does then): once they reach it again, the
	// API server answers their watches 410 Gone, and the joins filed in
	// the meantime are seen only by listing again.
	var compacted int64
	var restored, compactedAt time.Time
	fault("expire", 500*time.Millisecond, expireRecovery, func() time.Time {
		proxy.Refuse()
		time.Sleep(lease) // the wave is filed meanwhile
		compacted = envs["c1"].wl.CompactEtcd(t)
		compactedAt = time.Now()
		proxy.Restore()
		restored = time.Now()
		return restored
	})
	// A connection accepted as the proxy closed may outlive its refusal:
	// the expired watch is looked for from the compaction on, not from
	// the restore.
	expectExpiredWatches(t, envs["c1"].wl, "node-attestation-controller", compacted, compactedAt)

	// c1 cut off from the replicas: every connection to its API server
	// dropped, and every new one, for twice the Lease duration.
	fault("cut", 0, restartRecovery, func() time.Time {
		time.Sleep(100 * time.Millisecond) // its joins are in flight
		proxy.Cut()
		time.Sleep(2 * lease)
		proxy.Restore()
		return time.Now()
	})

	// c1 slow: every byte between the replicas and its API server held
	// a second each way, for twice the Lease duration; its joins are
	// decided, slowly, while it lasts.
	fault("delay", 0, restartRecovery, func() time.Time {
		proxy.Delay(time.Second)
		time.Sleep(2 * lease)
		proxy.Delay(0)
		return time.Now()
	})
	owners = waitServed(t, mgmt, ns, names, live, 30*time.Second)

	// c0 opts out: its replica stops and releases it. Its joins are
	// filed and wait; the Machine of one is deleted while its request is
	// pending. c0 opts in again: the joins with a Machine are issued, the
	// orphan is denied (no Machine), never signed.
	setEnabled(t, mgmt, ns, "c0", false)
	if err := pollFor(30*time.Second, func() bool { return claimHolder(t, mgmt, ns, "c0") == "" }); err != nil {
		t.Fatalf("c0 opted out, still claimed by %s", claimHolder(t, mgmt, ns, "c0"))
	}
	fault("optout", 0, restartRecovery, func() time.Time {
		for _, n := range waves["optout"] {
			if err := pollFor(30*time.Second, func() bool {
				if n.tpm != nil {
					return len(tpmRequestsOf(t, envs["c0"].wl, n.name)) > 0
				}
				_, err := envs["c0"].wl.Client.CertificatesV1().CertificateSigningRequests().Get(context.Background(), n.name, metav1.GetOptions{})
				return err == nil
			}); err != nil {
				t.Errorf("%s not filed: %v", n.name, err)
			}
		}
		time.Sleep(time.Second) // no replica decides it
		for _, n := range waves["optout"] {
			if n.tpm != nil {
				// Not challenged either.
				for _, r := range tpmRequestsOf(t, envs["c0"].wl, n.name) {
					if _, ok := r.Annotations[attestor.AnnotationChallenge]; ok || len(r.Status.Conditions) != 0 {
						t.Errorf("%s: request %s challenged or decided while its Cluster was opted out: %+v", n.name, r.Name, r.Status.Conditions)
					}
				}
				continue
			}
			if c := envs["c0"].get(t, n.name).Status.Conditions; len(c) != 0 {
				t.Errorf("%s decided while its Cluster was opted out: %+v", n.name, c)
			}
			if n.orphan {
				if err := mgmt.Client.Delete(context.Background(), &clusterv1.Machine{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: n.name}}); err != nil {
					t.Fatal(err)
				}
			}
		}
		time.Sleep(time.Second) // the replicas' caches see the deletion
		setEnabled(t, mgmt, ns, "c0", true)
		return time.Now()
	})
	// The answers are all filed: no more copies (and the copier's
	// goroutines gone before the leak check).
	for _, r := range replays {
		r.stop()
	}

	// After the faults: each Cluster served by exactly one live replica,
	// which its claim names too.
	owners = waitServed(t, mgmt, ns, names, live, 30*time.Second)
	t.Logf("after the faults, Clusters served by %v", owners)
	for _, id := range live {
		if done, err := replicas[id].exited(); done {
			t.Errorf("replica %s ended during the faults: %v", id, err)
		}
	}
	// Each replica runs the controllers of the Clusters it serves, no
	// other: none left running after a Cluster moved away.
	if err := pollFor(10*time.Second, func() bool { return servesClaimed(t, owners, live) }); err != nil {
		for _, id := range live {
			v, _ := replicaGauge(t, "kubelet_authenticator_signer_shard_clusters_served", id)
			t.Errorf("replica %s runs the controllers of %v Clusters; Clusters served: %v", id, v, owners)
		}
	}
	g, stacks := settledGoroutines(t, idleG+faultsLeakGoroutines)
	heap := liveHeap()
	t.Logf("idle before the faults that kill no replica: %d goroutines, %.1f MiB live heap; after them: %d (%+d), %.1f MiB (%+.1f MiB)",
		idleG, float64(idleHeap)/(1<<20), g, g-idleG, float64(heap)/(1<<20), (float64(heap)-float64(idleHeap))/(1<<20))
	if g > idleG+faultsLeakGoroutines {
		t.Errorf("%d goroutines after the faults, %d before: leaked; the stacks that grew:\n%s", g, idleG, grownStacks(idleStacks, stacks, 5))
	}
	if heap > idleHeap+faultsLeakHeapBytes {
		t.Errorf("%.1f MiB live heap after the faults, %.1f MiB before: leaked", float64(heap)/(1<<20), float64(idleHeap)/(1<<20))
	}

	// Every node with a Machine has its certificate, checked in full.
	for _, n := range nodes {
		if !n.impostor && n.tpm == nil {
			envs[n.cluster].expectIssued(t, n.name, n.name, n.providerID, 24*time.Hour)
		}
	}
	// The API servers' records: each request approved once and issued
	// once, each impostor denied once with a reason.
	allWrites := map[string]map[string]*csrWrites{}
	for _, c := range names {
		writes := csrWritesOf(t, envs[c].wl)
		allWrites[c] = writes
		for _, n := range nodes {
			if n.cluster != c || n.tpm != nil {
				continue
			}
			w := writes[n.name]
			if w == nil {
				t.Errorf("%s: no write to CSR %s in the audit log", c, n.name)
				continue
			}
			if n.impostor {
				// Denied (joinOne saw it): never approved nor issued.
				if w.denied > 1 || w.approvals != 0 || len(w.certificates) != 0 {
					t.Errorf("impostor %s: %d denials stored, %d approvals and %d certificates sent; want at most 1, 0, 0: %v", n.name, w.denied, w.approvals, len(w.certificates), w.log)
				}
				if d := condition(envs[c].get(t, n.name), certificatesv1.CertificateDenied); d == nil || d.Reason != attestor.ReasonMachineNotFound || d.Message == "" {
					t.Errorf("impostor %s: denied %+v, want reason %s and a message", n.name, d, attestor.ReasonMachineNotFound)
				}
				continue
			}
			// Approved once: a write whose answer was lost and another
			// stored after it, conditional on the version read, cannot
			// both have been stored. The one stored may be one whose
			// answer was lost (the replica that sent it killed): the
			// request then holds an approval with no 2xx write.
			held := 0
			for _, c := range envs[c].get(t, n.name).Status.Conditions {
				if c.Type == certificatesv1.CertificateApproved {
					held++
				}
			}
			if held != 1 || w.approved > 1 || (w.approved == 0 && w.approvals == 0) || len(w.denials) != 0 {
				t.Errorf("%s: %d approvals held, %d stored and %d sent, denial sent %d times; want 1, at most 1 stored, and no denial: %v",
					n.name, held, w.approved, w.approvals, len(w.denials), w.log)
			}
			// Issued once: one certificate stored, the one it holds. A
			// certificate whose write was cut (its answer lost, then
			// another stored conditional on the version read) was never
			// stored: kube-apiserver refuses to replace a CSR's
			// certificate, so a second one could only be stored after
			// a lost write that was not.
			// (A lost answer may hide a write that was stored: the
			// certificate held is then one sent, with no 2xx write.)
			if held := envs[c].get(t, n.name).Status.Certificate; w.stored > 1 || !w.certificates[string(held)] {
				t.Errorf("%s: %d certificates sent to the API server, %d stored; want at most 1 stored, the one it holds: %v", n.name, len(w.certificates), w.stored, w.log)
			} else if len(w.certificates) > 1 {
				t.Logf("%s: %d certificates sent, 1 stored (a write whose answer was lost, signed again by the replica that took over): %v",
					n.name, len(w.certificates), w.log)
			}
		}
		for name, w := range writes {
			for _, d := range w.denials {
				if d.Reason == "" || d.Message == "" {
					t.Errorf("%s: CSR %s denied without a reason or message: %+v", c, name, d)
				}
			}
		}
	}

	// The TPM nodes: no challenge accepted twice, every one joined (one
	// of the twins), trust on first use without a conflict.
	tst := checkTPMJoins(t, mgmt, metav1.NamespaceSystem, envs, allWrites, tpmNodes, replays)
	t.Logf("TPM nodes: %d (two of them twins on one TPM: %s joined), %d challenges written (%d first-round requests challenged twice), %d answers filed, %d of them copies; "+
		"%d challenges answered twice, each accepted once: %d copies approved in place of the node's answer, %d node answers denied %s and filed anew",
		len(tpmNodes), tst.twinJoined, tst.challenges, tst.rechallenged, tst.answers, tst.copies, tst.answeredTwice, tst.copiesApproved, tst.refiled, attestor.ReasonChallengeUsed)

	keys := make([]string, 0, len(recovery))
	for k := range recovery {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var sum []string
	for _, k := range keys {
		sum = append(sum, fmt.Sprintf("%s=%s", k, recovery[k].Round(100*time.Millisecond)))
	}
	t.Logf("recovery (last join of the wave decided, after the fault): %s; %d nodes, %s in all", strings.Join(sum, " "), len(nodes), time.Since(start).Round(time.Second))
}

// leaderRenewed reports whether a replica holds the leader Lease and
// renewed it within the last d.
func leaderRenewed(t *testing.T, mgmt *harness.Management, d time.Duration) bool {
	t.Helper()
	var l coordinationv1.Lease
	key := client.ObjectKey{Namespace: metav1.NamespaceSystem, Name: app.DefaultLeaderElectionID}
	if err := mgmt.Client.Get(context.Background(), key, &l); err != nil {
		return false
	}
	return ptr.Deref(l.Spec.HolderIdentity, "") != "" && l.Spec.RenewTime != nil && time.Since(l.Spec.RenewTime.Time) < d
}

// setEnabled opts Cluster ns/name in or out (capi.AnnotationEnabled).
func setEnabled(t *testing.T, mgmt *harness.Management, ns, name string, on bool) {
	t.Helper()
	c := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q}}}`, capi.AnnotationEnabled, strconv.FormatBool(on)))
	if err := mgmt.Client.Patch(context.Background(), c, patch); err != nil {
		t.Fatal(err)
	}
}

// expectExpiredWatches checks, from cp's audit log, that the controller
// (its requests' user agent starts with agent) watched
// CertificateSigningRequests after since from a resource version etcd had
// compacted (at revision compacted), which the API server answers 410
// Gone, and listed them again after; and that the API server does answer
// such a watch 410.
func expectExpiredWatches(t *testing.T, cp *harness.ControlPlane, agent string, compacted int64, since time.Time) {
	t.Helper()
	var expired, relisted *harness.AuditEvent
	events := cp.AuditEvents(t)
	for i := range events {
		e := &events[i]
		r := e.ObjectRef
		if !strings.HasPrefix(e.UserAgent, agent) || r == nil || r.Resource != "certificatesigningrequests" || r.Name != "" || e.RequestReceivedTimestamp.Before(since) {
			continue
		}
		u, err := url.Parse(e.RequestURI)
		if err != nil {
			continue
		}
		switch rv, _ := strconv.ParseInt(u.Query().Get("resourceVersion"), 10, 64); {
		case e.Verb == "watch" && rv > 0 && rv+1 < compacted && expired == nil:
			expired = e
		case e.Verb == "list" && expired != nil && relisted == nil && e.RequestReceivedTimestamp.After(expired.RequestReceivedTimestamp):
			relisted = e
		}
	}
	if expired == nil {
		for _, e := range events {
			if strings.HasPrefix(e.UserAgent, agent) && e.ObjectRef != nil && e.ObjectRef.Resource == "certificatesigningrequests" && e.RequestReceivedTimestamp.After(since.Add(-10*time.Second)) {
				t.Logf("%s: %s %s %s: %d", cp.Name, e.RequestReceivedTimestamp.Format(time.StampMilli), e.Verb, e.RequestURI, e.Code())
			}
		}
		t.Fatalf("no watch of CSRs by %s from before the compaction at revision %d in the audit log of %s", agent, compacted, cp.Name)
	}
	if relisted == nil {
		t.Fatalf("%s did not list the CSRs again after its watch %s expired", agent, expired.RequestURI)
	}
	// The API server's answer to that watch, asked again.
	u, _ := url.Parse(expired.RequestURI)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, err := cp.Client.CertificatesV1().CertificateSigningRequests().Watch(ctx, metav1.ListOptions{ResourceVersion: u.Query().Get("resourceVersion")})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	ev := <-w.ResultChan()
	if st, ok := ev.Object.(*metav1.Status); !ok || st.Code != http.StatusGone {
		t.Fatalf("a watch from resource version %s, compacted at %d: %s %+v, want 410 Gone", u.Query().Get("resourceVersion"), compacted, ev.Type, ev.Object)
	}
	t.Logf("%s watched CSRs from resource version %s (etcd compacted at %d: 410 Gone) %s after the compaction, then listed them again %s after that",
		agent, u.Query().Get("resourceVersion"), compacted, expired.RequestReceivedTimestamp.Sub(since).Round(time.Millisecond),
		relisted.RequestReceivedTimestamp.Sub(expired.RequestReceivedTimestamp).Round(time.Millisecond))
}

// Tolerances of TestSignerFaults's leak check: connections, the
// goroutines forwarding them and watches being re-established come and go
// with the faults, and the figure depends on how the Clusters are spread
// over the replicas (runs end between 75 below, when one replica serves
// every Cluster at the end, and 10 above the idle figure), but a
// Cluster's controller left running is tens of goroutines.
const (
	faultsLeakGoroutines = 25
	faultsLeakHeapBytes  = 16 << 20
)

// answersAgain returns when cp's API server, about to be stopped, answers
// HTTP again after it stopped answering (ready or not).
func answersAgain(cp *harness.ControlPlane) <-chan time.Time {
	out := make(chan time.Time, 1)
	go func() {
		answers := func() bool {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			code := 0
			cp.Client.Discovery().RESTClient().Get().AbsPath("/livez").Do(ctx).StatusCode(&code)
			return code != 0 // any HTTP answer, even "not ready"
		}
		for answers() {
			time.Sleep(50 * time.Millisecond)
		}
		for !answers() {
			time.Sleep(50 * time.Millisecond)
		}
		out <- time.Now()
	}()
	return out
}

// joinOne files csr with the bootstrap token, retrying while the API
// server is away, and waits until it is issued (denied, when denied is
// true), returning when it was.
func joinOne(e *signerEnv, csr *certificatesv1.CertificateSigningRequest, denied bool, within time.Duration) (time.Time, error) {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	api := e.bootstrap.CertificatesV1().CertificateSigningRequests()
	for {
		_, err := api.Create(ctx, csr.DeepCopy(), metav1.CreateOptions{})
		if err == nil || apierrors.IsAlreadyExists(err) {
			break
		}
		select {
		case <-ctx.Done():
			return time.Time{}, fmt.Errorf("not filed within %s: %w", within, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
	for {
		got, err := e.wl.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, csr.Name, metav1.GetOptions{})
		if err == nil {
			d := condition(got, certificatesv1.CertificateDenied)
			switch {
			case d != nil && denied:
				return time.Now(), nil
			case d != nil:
				return time.Time{}, fmt.Errorf("denied: %s: %s", d.Reason, d.Message)
			case condition(got, certificatesv1.CertificateFailed) != nil:
				return time.Time{}, errors.New("failed")
			case len(got.Status.Certificate) > 0 && denied:
				return time.Time{}, errors.New("an impostor was issued a certificate")
			case len(got.Status.Certificate) > 0:
				return time.Now(), nil
			}
		}
		select {
		case <-ctx.Done():
			return time.Time{}, fmt.Errorf("not decided within %s", within)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// csrWrites is what a workload API server's audit log says was written to
// one CSR. A write answered 2xx was stored; one refused (409: written
// since; 422: invalid) was not; any other answer (a writer gone
// mid-request, a timeout) may come after the write was stored or not.
type csrWrites struct {
	approved     int                                                 // Approved conditions stored
	approvals    int                                                 // Approved conditions perhaps stored
	denied       int                                                 // Denied conditions stored
	denials      []certificatesv1.CertificateSigningRequestCondition // Denied conditions perhaps stored
	certificates map[string]bool                                     // every certificate sent, refused or not
	stored       int                                                 // certificates stored
	challenges   map[string]bool                                     // TPM challenges stored (kubelet-authenticator.x-k8s.io/challenge)
	log          []string                                            // every write: subresource, condition, answer
}

// refused reports whether the API server answered a write with code
// without storing it.
func refused(code int) bool {
	return code == http.StatusConflict || code == http.StatusUnprocessableEntity
}

// csrWrite is what a write to a CSR sets that csrWritesOf looks at.
type csrWrite struct {
	Metadata struct {
		Annotations map[string]string `json:"annotations"`
	} `json:"metadata"`
	Status struct {
		Conditions  []certificatesv1.CertificateSigningRequestCondition `json:"conditions"`
		Certificate []byte                                              `json:"certificate"`
	} `json:"status"`
}

// decodeCSRWrite reads the body of a write to a CSR: an object (an update
// or a merge patch) or a JSON patch, whose "add" and "replace" operations
// on the fields of csrWrite are taken as they would be set.
func decodeCSRWrite(raw []byte) (*csrWrite, error) {
	var w csrWrite
	if !bytes.HasPrefix(bytes.TrimSpace(raw), []byte("[")) {
		return &w, json.Unmarshal(raw, &w)
	}
	var ops []struct {
		Op    string          `json:"op"`
		Path  string          `json:"path"`
		Value json.RawMessage `json:"value"`
	}
	if err := json.Unmarshal(raw, &ops); err != nil {
		return nil, err
	}
	unescape := strings.NewReplacer("~1", "/", "~0", "~")
	for _, op := range ops {
		if op.Op != "add" && op.Op != "replace" {
			continue
		}
		var err error
		switch {
		case op.Path == "/status/conditions":
			err = json.Unmarshal(op.Value, &w.Status.Conditions)
		case op.Path == "/status/certificate":
			err = json.Unmarshal(op.Value, &w.Status.Certificate)
		case op.Path == "/metadata/annotations":
			err = json.Unmarshal(op.Value, &w.Metadata.Annotations)
		case strings.HasPrefix(op.Path, "/metadata/annotations/"):
			var v string
			if err = json.Unmarshal(op.Value, &v); err == nil {
				if w.Metadata.Annotations == nil {
					w.Metadata.Annotations = map[string]string{}
				}
				w.Metadata.Annotations[unescape.Replace(strings.TrimPrefix(op.Path, "/metadata/annotations/"))] = v
			}
		}
		if err != nil {
			return nil, fmt.Errorf("operation %s %s: %w", op.Op, op.Path, err)
		}
	}
	return &w, nil
}

// csrWritesOf reads the audit log of cp (started WithAuditLog): the writes
// of conditions and certificates to each CSR, and the answers to them.
func csrWritesOf(t *testing.T, cp *harness.ControlPlane) map[string]*csrWrites {
	t.Helper()
	out := map[string]*csrWrites{}
	for _, e := range cp.AuditEvents(t) {
		r := e.ObjectRef
		if r == nil || r.APIGroup != "certificates.k8s.io" || r.Resource != "certificatesigningrequests" || len(e.RequestObject) == 0 {
			continue
		}
		if e.Verb != "update" && e.Verb != "patch" {
			continue
		}
		body, err := decodeCSRWrite(e.RequestObject)
		if err != nil {
			t.Errorf("audit event %s: unreadable request body: %v", e.AuditID, err)
			continue
		}
		w := out[r.Name]
		if w == nil {
			w = &csrWrites{certificates: map[string]bool{}, challenges: map[string]bool{}}
			out[r.Name] = w
		}
		stored, perhaps := e.Code() >= 200 && e.Code() < 300, !refused(e.Code())
		switch r.Subresource {
		case "":
			ch, ok := body.Metadata.Annotations[attestor.AnnotationChallenge]
			if !ok {
				continue
			}
			w.log = append(w.log, fmt.Sprintf("%s challenge: %d", e.Verb, e.Code()))
			if stored {
				w.challenges[ch] = true
			}
		case "approval":
			// The write carries every condition: the last is the one added.
			n := len(body.Status.Conditions)
			if n == 0 {
				continue
			}
			c := body.Status.Conditions[n-1]
			w.log = append(w.log, fmt.Sprintf("%s %s: %d", e.Verb, c.Type, e.Code()))
			switch {
			case !perhaps:
			case c.Type == certificatesv1.CertificateApproved:
				w.approvals++
				if stored {
					w.approved++
				}
			case c.Type == certificatesv1.CertificateDenied:
				w.denials = append(w.denials, c)
				if stored {
					w.denied++
				}
			}
		case "status":
			if len(body.Status.Certificate) == 0 {
				continue
			}
			w.log = append(w.log, fmt.Sprintf("%s certificate: %d", e.Verb, e.Code()))
			w.certificates[string(body.Status.Certificate)] = true
			if stored {
				w.stored++
			}
		}
	}
	return out
}
