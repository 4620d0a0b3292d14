package trustbundle

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestProjectionAgainstAPIServer projects ClusterTrustBundles from a real
// kube-apiserver, read as a node (system:node:<name>, authorized by the Node
// authorizer), by name and by signer name plus label selector; checks that a
// consumer reading in a tight loop during 100 updates never sees a partial,
// empty or unexpected file; measures update-to-disk latency; and checks
// that a deleted bundle leaves the last good content, stale.
func TestProjectionAgainstAPIServer(t *testing.T) {
	if testing.Short() {
		t.Skip("needs kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "ctb")
	ctx := context.Background()
	ctbs := cp.Client.CertificatesV1beta1().ClusterTrustBundles()

	certPEM, keyPEM := cp.IssueClientCert(t, "system:node:node-1", attestor.NodesGroup)
	nodeCfg := cp.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM})

	gvr, err := Discover(ctx, nodeCfg)
	if err != nil {
		t.Fatal(err)
	}
	if gvr.Version != "v1beta1" {
		t.Fatalf("discovered %s; this kube-apiserver serves v1beta1", gvr)
	}

	cas := make([]string, 102)
	for i := range cas {
		cas[i] = newCAPEM(t, "ca-"+strconv.Itoa(i))
	}
	const signer = "example.com/node-trust"
	create := func(name, signerName, bundle string, lbls map[string]string) {
		t.Helper()
		_, err := ctbs.Create(ctx, &certificatesv1beta1.ClusterTrustBundle{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbls},
			Spec:       certificatesv1beta1.ClusterTrustBundleSpec{SignerName: signerName, TrustBundle: bundle},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
	}
	create("root", "", cas[0], nil)
	create("example.com:node-trust:a", signer, cas[1], map[string]string{"env": "prod"})
	create("example.com:node-trust:b", signer, cas[2]+cas[1], map[string]string{"env": "prod"})
	create("example.com:node-trust:c", signer, cas[3], map[string]string{"env": "dev"})

	dir := t.TempDir()
	counter := filepath.Join(dir, "post-update-count")
	byName := config.TrustBundleProjection{Name: "root", Path: filepath.Join(dir, "root", "ca.crt"),
		PostUpdateCommand: []string{"sh", "-c", `echo "$TRUST_BUNDLE_PATH" >> ` + counter}}
	bySigner := config.TrustBundleProjection{SignerName: signer, LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"env": "prod"}},
		Path: filepath.Join(dir, "signer", "ca.crt")}
	var log statusLog
	mctx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	m := &Manager{Config: nodeCfg, Projections: []config.TrustBundleProjection{byName, bySigner}, OnStatus: log.set}
	go func() { done <- m.Run(mctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})

	waitFor(t, "both projections", func() bool {
		return current(log.get(byName.Path)) && current(log.get(bySigner.Path))
	})
	if s := log.get(bySigner.Path); s.Certificates != 2 || !slices.Equal(s.Sources, []string{"example.com:node-trust:a", "example.com:node-trust:b"}) {
		t.Fatalf("signer projection %+v: want a and b (not c), 2 certificates", s)
	}
	if s := log.get(byName.Path); s.Resource != "certificates.k8s.io/v1beta1" || s.Certificates != 1 {
		t.Fatalf("name projection %+v", s)
	}

	// 100 updates while a consumer reads in a tight loop.
	valid := map[string]bool{}
	var validMu sync.RWMutex
	expect := func(bundle string) []byte {
		b, err := Assemble(map[string]string{"root": bundle})
		if err != nil {
			t.Fatal(err)
		}
		validMu.Lock()
		valid[string(b.PEM)] = true
		validMu.Unlock()
		return b.PEM
	}
	expect(cas[0])
	var reads, bad atomic.Int64
	var firstBad atomic.Value
	stopReading := make(chan struct{})
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		for {
			select {
			case <-stopReading:
				return
			default:
			}
			data, err := os.ReadFile(byName.Path)
			reads.Add(1)
			validMu.RLock()
			ok := err == nil && valid[string(data)]
			validMu.RUnlock()
			if !ok {
				bad.Add(1)
				firstBad.CompareAndSwap(nil, err)
			}
		}
	}()
	const updates = 100
	latencies := make([]time.Duration, 0, updates)
	obj, err := ctbs.Get(ctx, "root", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range updates {
		bundle := cas[4+i%98]
		if i%2 == 1 {
			bundle += cas[0]
		}
		want := expect(bundle)
		obj.Spec.TrustBundle = bundle
		start := time.Now()
		if obj, err = ctbs.Update(ctx, obj, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		for {
			if got, _ := os.ReadFile(byName.Path); bytes.Equal(got, want) {
				break
			}
			if time.Since(start) > 5*time.Second {
				t.Fatalf("update %d not on disk after 5s", i)
			}
			time.Sleep(200 * time.Microsecond)
		}
		latencies = append(latencies, time.Since(start))
	}
	close(stopReading)
	<-readerDone
	if bad.Load() != 0 {
		t.Fatalf("the consumer saw %d bad reads of %d (first: %v)", bad.Load(), reads.Load(), firstBad.Load())
	}
	slices.Sort(latencies)
	median, p99 := latencies[len(latencies)/2], latencies[len(latencies)*99/100]
	t.Logf("%d updates, %d consumer reads, none partial, empty or unexpected; update-to-disk latency (API write included): median %s, p99 %s, max %s",
		updates, reads.Load(), median, p99, latencies[len(latencies)-1])
	if p99 > time.Second {
		t.Errorf("p99 update-to-disk latency %s exceeds 1s", p99)
	}
	// The command runs after the file is visible: wait for the last one.
	ran := func() int { data, _ := os.ReadFile(counter); return bytes.Count(data, []byte("\n")) }
	waitFor(t, "the post-update command after the first write and every update", func() bool { return ran() == updates+1 })

	// Deleted: the last good content stays, the projection is stale.
	last, _ := os.ReadFile(byName.Path)
	if err := ctbs.Delete(ctx, "root", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "stale after deletion", func() bool { return log.get(byName.Path).Stale })
	if got, _ := os.ReadFile(byName.Path); !bytes.Equal(got, last) {
		t.Fatal("deleting the bundle changed the file")
	}
	// An unchanged re-creation is no write.
	lastUpdate := log.get(byName.Path).LastUpdate
	create("root", "", obj.Spec.TrustBundle, nil)
	waitFor(t, "current again", func() bool { return current(log.get(byName.Path)) })
	if !log.get(byName.Path).LastUpdate.Equal(lastUpdate) {
		t.Error("re-creating the same bundle rewrote the file")
	}
	// The label selector is honoured on updates too.
	c, _ := ctbs.Get(ctx, "example.com:node-trust:c", metav1.GetOptions{})
	c.Labels["env"] = "prod"
	if _, err := ctbs.Update(ctx, c, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "c selected", func() bool { return log.get(bySigner.Path).Certificates == 3 })
}

// rejectCounter is a Metrics that counts rejections by reason.
type rejectCounter struct {
	mu       sync.Mutex
	rejected map[string]int
}

func (c *rejectCounter) Updated(string, int, time.Time) {}
func (c *rejectCounter) Stale(string, bool)             {}
func (c *rejectCounter) Synced(string, time.Time)       {}
func (c *rejectCounter) Rejected(_, reason string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.rejected == nil {
		c.rejected = map[string]int{}
	}
	c.rejected[reason]++
}

func (c *rejectCounter) get(reason string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rejected[reason]
}

// TestOversizedBundlesNeverCached: the agent renews the client certificate
// in the process that watches ClusterTrustBundles, so the caps apply
// before an object is cached. Against a real kube-apiserver: a
// ClusterTrustBundle whose trust bundle alone is over
// agent.maxTrustBundleBytes, present at the first list or added later
// through the watch, never enters the informer's store nor the file; each
// version kept out is counted; the projection is stale and says why; the
// store never holds more than agent.maxTrustBundles objects; and once the
// oversized one leaves the selection, the valid ones are projected.
func TestOversizedBundlesNeverCached(t *testing.T) {
	if testing.Short() {
		t.Skip("needs kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "ctbcap")
	ctx := context.Background()
	ctbs := cp.Client.CertificatesV1beta1().ClusterTrustBundles()
	certPEM, keyPEM := cp.IssueClientCert(t, "system:node:node-1", attestor.NodesGroup)
	nodeCfg := cp.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM})
	gvr, err := Discover(ctx, nodeCfg)
	if err != nil {
		t.Fatal(err)
	}

	const signer = "example.com/capped"
	prod := map[string]string{"env": "prod"}
	cas := make([]string, 12)
	for i := range cas {
		cas[i] = newCAPEM(t, "cap-"+strconv.Itoa(i))
	}
	const maxBytes = 2000
	big := strings.Join(cas[2:6], "")
	big2 := strings.Join(cas[6:10], "")
	if len(cas[0]) > maxBytes/2 || len(big) <= maxBytes || len(big2) <= maxBytes {
		t.Fatalf("sizes: one CA %d, big %d, big2 %d bytes against a cap of %d", len(cas[0]), len(big), len(big2), maxBytes)
	}
	create := func(name, bundle string, lbls map[string]string) {
		t.Helper()
		if _, err := ctbs.Create(ctx, &certificatesv1beta1.ClusterTrustBundle{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbls},
			Spec:       certificatesv1beta1.ClusterTrustBundleSpec{SignerName: signer, TrustBundle: bundle},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	create("example.com:capped:a", cas[0], prod)
	create("example.com:capped:big", big, prod)

	dir := t.TempDir()
	pr := config.TrustBundleProjection{SignerName: signer, LabelSelector: &metav1.LabelSelector{MatchLabels: prod}, Path: filepath.Join(dir, "capped", "ca.crt")}
	var log statusLog
	metrics := &rejectCounter{}
	var seenMu sync.Mutex
	var seen []string // every object that entered the store, and its size
	maxStored := 0
	p := &Projector{Config: nodeCfg, Resource: gvr, Projection: pr, OnStatus: log.set, Metrics: metrics, MaxBytes: maxBytes, MaxBundles: 2}
	p.watching = func(inf cache.SharedIndexInformer) {
		record := func(obj any) {
			o := obj.(*clusterTrustBundle)
			seenMu.Lock()
			defer seenMu.Unlock()
			seen = append(seen, o.Name+"="+strconv.Itoa(len(o.Spec.TrustBundle)))
			maxStored = max(maxStored, len(inf.GetStore().List()))
		}
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: record, UpdateFunc: func(_, o any) { record(o) }}); err != nil {
			t.Fatal(err)
		}
	}
	pctx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- p.Run(pctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	fileHolds := func(bundle string) bool {
		data, _ := os.ReadFile(pr.Path)
		for _, c := range strings.SplitAfter(strings.TrimSpace(bundle), "-----END CERTIFICATE-----") {
			if c = strings.TrimSpace(c); c != "" && bytes.Contains(data, []byte(c)) {
				return true
			}
		}
		return false
	}
	checkNeverCached := func(what string) {
		t.Helper()
		seenMu.Lock()
		defer seenMu.Unlock()
		for _, s := range seen {
			if n, _ := strconv.Atoi(s[strings.Index(s, "=")+1:]); n > maxBytes {
				t.Fatalf("%s: an oversized ClusterTrustBundle entered the store: %s (all: %q)", what, s, seen)
			}
		}
		if maxStored > p.MaxBundles {
			t.Fatalf("%s: the store held %d objects, over the limit of %d", what, maxStored, p.MaxBundles)
		}
		if fileHolds(big) || fileHolds(big2) {
			t.Fatalf("%s: an oversized bundle's certificates are on disk", what)
		}
	}

	// At the first list: kept out, counted, the projection refused.
	waitFor(t, "the projection read", func() bool { s := log.get(pr.Path); return s.Stale && s.Reason != "not read from the API server yet" })
	checkNeverCached("first list")
	if s := log.get(pr.Path); !strings.Contains(s.Reason, "example.com:capped:big") || !strings.Contains(s.Reason, "agent.maxTrustBundleBytes") {
		t.Errorf("status %+v does not name the oversized bundle and the setting", s)
	}
	if n := metrics.get(RejectedTooLarge); n != 1 {
		t.Errorf("%d rejections counted, want 1", n)
	}
	if _, err := os.Stat(pr.Path); err == nil {
		t.Fatal("a projection with an oversized bundle in its selection was written")
	}

	// Out of the selection: the valid bundle is projected.
	obj, err := ctbs.Get(ctx, "example.com:capped:big", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	obj.Labels = map[string]string{"env": "dev"}
	if _, err := ctbs.Update(ctx, obj, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the valid bundle projected", func() bool { s := log.get(pr.Path); return current(s) && s.Certificates == 1 })
	if !fileHolds(cas[0]) {
		t.Fatal("the valid bundle is not on disk")
	}

	// Added through the watch: kept out too, the file keeps its content.
	before, _ := os.ReadFile(pr.Path)
	create("example.com:capped:big2", big2, prod)
	waitFor(t, "the second oversized bundle refused", func() bool {
		s := log.get(pr.Path)
		return s.Stale && strings.Contains(s.Reason, "example.com:capped:big2")
	})
	if n := metrics.get(RejectedTooLarge); n != 2 {
		t.Errorf("%d rejections counted, want 2", n)
	}
	if after, _ := os.ReadFile(pr.Path); !bytes.Equal(before, after) {
		t.Fatal("the file changed while an oversized bundle was selected")
	}
	checkNeverCached("watch")

	// A valid object that grows over the cap leaves the store.
	if err := ctbs.Delete(ctx, "example.com:capped:big2", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "current again", func() bool { return current(log.get(pr.Path)) })
	a, err := ctbs.Get(ctx, "example.com:capped:a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	a.Spec.TrustBundle = big
	if _, err := ctbs.Update(ctx, a, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a refused after growing", func() bool {
		s := log.get(pr.Path)
		return s.Stale && strings.Contains(s.Reason, "example.com:capped:a ")
	})
	checkNeverCached("update")
	if !fileHolds(cas[0]) {
		t.Fatal("the last good content is gone")
	}

	// The count: at most MaxBundles objects in the store; the excess is
	// counted and refused, and projected once there is room.
	if a, err = ctbs.Get(ctx, a.Name, metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	a.Spec.TrustBundle = cas[0]
	if _, err := ctbs.Update(ctx, a, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	create("example.com:capped:c", cas[10], prod)
	create("example.com:capped:d", cas[11], prod)
	waitFor(t, "over the number of objects", func() bool {
		s := log.get(pr.Path)
		return s.Stale && strings.Contains(s.Reason, "agent.maxTrustBundles")
	})
	if metrics.get(RejectedTooMany) == 0 {
		t.Error("no excess object counted")
	}
	checkNeverCached("count")
	if err := ctbs.Delete(ctx, "example.com:capped:c", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a and d projected", func() bool { s := log.get(pr.Path); return current(s) && s.Certificates == 2 })
	if !fileHolds(cas[11]) || !fileHolds(cas[0]) || fileHolds(cas[10]) {
		t.Fatal("the file does not hold exactly a and d")
	}
	checkNeverCached("end")
	seenMu.Lock()
	t.Logf("objects that entered the store: %q; rejections counted: %d too large, %d too many", seen, metrics.get(RejectedTooLarge), metrics.get(RejectedTooMany))
	seenMu.Unlock()
}
