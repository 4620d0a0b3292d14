package integration

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/shard"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// replica is one controller replica run in-process; its connection to the
// management API server can be cut: requests hang, as they do across a
// partition, until they time out or the replica is killed.
type replica struct {
	id     string
	cut    atomic.Bool
	killed chan struct{}
	cancel context.CancelFunc
	done   chan error
}

// errCut is what a cut replica's requests to the management cluster get.
var errCut = errors.New("connection cut by the test")

type cutTransport struct {
	r    *replica
	next http.RoundTripper
}

func (c cutTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if c.r.cut.Load() {
		select {
		case <-req.Context().Done():
		case <-c.r.killed:
		}
		return nil, errCut
	}
	return c.next.RoundTrip(req)
}

// startReplica runs a sharded controller replica named id.
func startReplica(t *testing.T, mgmt *harness.Management, id string, adjust func(*app.Options)) *replica {
	t.Helper()
	r := &replica{id: id, killed: make(chan struct{}), done: make(chan error, 1)}
	o := app.NewOptions()
	o.UnauthorizedListPeriod = unauthorizedListPeriod
	o.RESTConfig = rest.CopyConfig(mgmt.AdminConfig)
	o.RESTConfig.Wrap(func(rt http.RoundTripper) http.RoundTripper { return cutTransport{r: r, next: rt} })
	o.LeaderElectionNamespace = metav1.NamespaceSystem
	o.MetricsBindAddress, o.HealthProbeBindAddress = "0", "0"
	o.SkipControllerNameValidation = true
	o.ClusterRecheckPeriod = 10 * time.Second
	o.Sharding, o.ShardIdentity = true, id
	if adjust != nil {
		adjust(o)
	}
	if err := o.Complete(); err != nil {
		t.Fatal(err)
	}
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	_, tctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(tctx)
	r.cancel = cancel
	go func() { r.done <- o.Run(ctx) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// stop stops the replica as SIGTERM does: it releases its Clusters.
func (r *replica) stop(t *testing.T) {
	t.Helper()
	r.cancel()
	select {
	case err := <-r.done:
		// controller-runtime's manager may end with "leader election
		// lost" when its context ends while it leads: it released the
		// Lease because it was told to stop, which is what stop asks.
		if err != nil && !r.cut.Load() && err.Error() != "leader election lost" {
			t.Errorf("replica %s: %v", r.id, err)
		}
		r.done <- err // stopped: later calls return at once
	case <-time.After(30 * time.Second):
		t.Errorf("replica %s did not stop within 30s", r.id)
	}
}

// exited reports whether the replica's Run returned, and with what.
func (r *replica) exited() (bool, error) {
	select {
	case err := <-r.done:
		r.done <- err // for stop
		return true, err
	default:
		return false, nil
	}
}

// kill stops the replica as a crash does: nothing it writes reaches the
// management cluster any more, so its Leases are left to expire.
func (r *replica) kill(t *testing.T) {
	t.Helper()
	r.cut.Store(true)
	close(r.killed)
	r.stop(t)
}

// label sets the --watch-filter label on Cluster ns/name.
func label(t *testing.T, mgmt *harness.Management, ns, name, value string) {
	t.Helper()
	c := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"metadata":{"labels":{%q:%q}}}`, capi.LabelWatchFilter, value))
	if err := mgmt.Client.Patch(context.Background(), c, patch); err != nil {
		t.Fatal(err)
	}
}

// attestationIn reads the status of ClusterAttestation ns/name.
func attestationIn(t *testing.T, mgmt *harness.Management, ns, name string) (v1alpha1.ClusterAttestationStatus, bool) {
	t.Helper()
	var st v1alpha1.ClusterAttestationStatus
	obj := &unstructured.Unstructured{}
	obj.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
	if err := mgmt.Client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, obj); err != nil {
		return st, false
	}
	if m, ok := obj.Object["status"].(map[string]any); ok {
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(m, &st); err != nil {
			t.Fatal(err)
		}
	}
	return st, true
}

func ready(st v1alpha1.ClusterAttestationStatus) bool {
	return slices.ContainsFunc(st.Conditions, func(c metav1.Condition) bool {
		return c.Type == capi.ConditionReady && c.Status == metav1.ConditionTrue
	})
}

// claimHolder is who holds the claim of Cluster ns/name, "" when none.
func claimHolder(t *testing.T, mgmt *harness.Management, ns, name string) string {
	t.Helper()
	var l coordinationv1.Lease
	key := client.ObjectKey{Namespace: metav1.NamespaceSystem, Name: shard.ClaimName(app.DefaultLeaderElectionID, ns+"/"+name)}
	if err := mgmt.Client.Get(context.Background(), key, &l); err != nil {
		return ""
	}
	return ptr.Deref(l.Spec.HolderIdentity, "")
}

// replicaGauge is the value of metric name with label replica=id.
func replicaGauge(t *testing.T, name, id string) (float64, bool) {
	t.Helper()
	return labelledValue(t, name, "replica", id)
}

// servesClaimed reports whether each replica of live runs the controllers
// of exactly the Clusters owners says it serves (its clusters-served
// gauge), none left running after a Cluster moved away.
func servesClaimed(t *testing.T, owners map[string]string, live []string) bool {
	t.Helper()
	for _, id := range live {
		want := 0
		for _, o := range owners {
			if o == id {
				want++
			}
		}
		if v, _ := replicaGauge(t, "kubelet_authenticator_signer_shard_clusters_served", id); int(v) != want {
			return false
		}
	}
	return true
}

// waitServed waits until every Cluster ns/name of names is served by one of
// live, its status and its claim naming the same replica, and returns who
// serves each.
func waitServed(t *testing.T, mgmt *harness.Management, ns string, names, live []string, within time.Duration) map[string]string {
	t.Helper()
	var got map[string]string
	var lacking string
	if err := pollFor(within, func() bool {
		got, lacking = map[string]string{}, ""
		for _, n := range names {
			st, ok := attestationIn(t, mgmt, ns, n)
			holder := claimHolder(t, mgmt, ns, n)
			switch {
			case !ok:
				lacking = n + ": no ClusterAttestation"
			case !slices.Contains(live, st.ServedBy):
				lacking = fmt.Sprintf("%s: servedBy %q", n, st.ServedBy)
			case holder != st.ServedBy:
				lacking = fmt.Sprintf("%s: servedBy %q, claim held by %q", n, st.ServedBy, holder)
			case !ready(st):
				lacking = n + ": not Ready"
			}
			if lacking != "" {
				return false
			}
			got[n] = st.ServedBy
		}
		return true
	}); err != nil {
		t.Fatalf("Clusters not served by %v within %s: %s", live, within, lacking)
	}
	return got
}
