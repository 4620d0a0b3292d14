package capi

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/signer/scoped"
)

// TestShortLifetimeReportedOnce: a workload API server that grants tokens
// too short-lived to use is the cluster's error, reported in its status at
// every refusal but by one Warning Event, not one per retry; once a token
// is good again, a new refusal is reported again. Other failures are
// reported each time.
func TestShortLifetimeReportedOnce(t *testing.T) {
	events := record.NewFakeRecorder(100)
	st := &state{}
	obs := &identityObserver{r: &ClusterReconciler{Events: events}, logger: klog.Background(), cluster: &clusterv1.Cluster{}, st: st}
	short := &scoped.Error{Step: scoped.StepToken, Err: fmt.Errorf("%w: lives 2s", scoped.ErrShortLifetime)}
	for range 5 {
		obs.Failed(scoped.StepToken, short, time.Minute)
	}
	if n := len(events.Events); n != 1 {
		t.Errorf("5 refused tokens recorded %d Events, want 1", n)
	}
	if got := st.snapshot().IdentityError; got != short.Error() {
		t.Errorf("status says %q, want %q", got, short.Error())
	}
	obs.Renewed(time.Now().Add(time.Hour), false, false)
	obs.Failed(scoped.StepToken, short, time.Minute)
	obs.Failed(scoped.StepInstall, errors.New("apply failed"), time.Minute)
	obs.Failed(scoped.StepInstall, errors.New("apply failed"), time.Minute)
	if n := len(events.Events); n != 4 {
		t.Errorf("%d Events in all, want 4: a refusal after a good token, and every other failure", n)
	}
}
