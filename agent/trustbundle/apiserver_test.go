package trustbundle

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
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

	certPEM, keyPEM := cp.IssueClientCert(t, "system:node:node-1", "system:nodes")
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
