package capi

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"

	"sigs.k8s.io/kubelet-authenticator/signer/controller"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
)

// TestDecisionEvents: every decision is the Cluster's last decision in its
// status; a denial or failure is also a Warning Event naming the request,
// the decision, its reason and message, on the Machine the request matched
// or on the Cluster when it matched none; an approval is no Event (the
// request's Approved condition says it).
func TestDecisionEvents(t *testing.T) {
	m := &engine.Machine{Namespace: "ns", Name: "m-1", UID: "uid-m"}
	for _, tc := range []struct {
		name              string
		machine           *engine.Machine
		decision, reason  string
		wantEvent, wantOn string // wantEvent "" when no Event
	}{
		{name: "approval", machine: m, decision: controller.DecisionApproved, reason: "AutoApproved"},
		{name: "approval matching no Machine", decision: controller.DecisionApproved, reason: "AutoApproved"},
		{name: "denial", machine: m, decision: controller.DecisionDenied, reason: "MachineNotFound",
			wantEvent: "Warning MachineNotFound Kubelet client CSR csr-1 in workload cluster ns/c denied: why", wantOn: "Machine ns/m-1"},
		{name: "denial matching no Machine", decision: controller.DecisionDenied, reason: "MachineNotFound",
			wantEvent: "Warning MachineNotFound Kubelet client CSR csr-1 in workload cluster ns/c denied: why", wantOn: "Cluster ns/c"},
		{name: "failure", machine: m, decision: controller.DecisionFailed, reason: "SigningFailed",
			wantEvent: "Warning SigningFailed Kubelet client CSR csr-1 in workload cluster ns/c failed: why", wantOn: "Machine ns/m-1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := &refRecorder{FakeRecorder: record.NewFakeRecorder(10)}
			st := &state{}
			e := &machineEvents{rec: rec, st: st, cluster: types.NamespacedName{Namespace: "ns", Name: "c"}, uid: "uid-c"}
			e.Decided("csr-1", tc.machine, tc.decision, tc.reason, "why")

			last := st.snapshot().LastDecision
			if last.CSR != "csr-1" || last.Outcome != tc.decision || last.Reason != tc.reason || last.Message != "why" {
				t.Errorf("last decision %+v, want csr-1 %s %s: why", last, tc.decision, tc.reason)
			}
			if tc.machine != nil && last.Machine != tc.machine.Name {
				t.Errorf("last decision's Machine %q, want %q", last.Machine, tc.machine.Name)
			}
			var got []string
			for len(rec.Events) > 0 {
				got = append(got, <-rec.Events)
			}
			on := strings.Join(rec.refs, ", ")
			if tc.wantEvent == "" {
				if len(got) > 0 {
					t.Errorf("Events %q, want none", got)
				}
				return
			}
			if len(got) != 1 || got[0] != tc.wantEvent || on != tc.wantOn {
				t.Errorf("Events %q on %s, want one %q on %s", got, on, tc.wantEvent, tc.wantOn)
			}
		})
	}
}

// refRecorder is a FakeRecorder that also keeps the kind and name of each
// Event's object.
type refRecorder struct {
	*record.FakeRecorder
	refs []string
}

func (r *refRecorder) Eventf(obj runtime.Object, typ, reason, format string, args ...any) {
	if ref, ok := obj.(*corev1.ObjectReference); ok {
		r.refs = append(r.refs, ref.Kind+" "+ref.Namespace+"/"+ref.Name)
	}
	r.FakeRecorder.Eventf(obj, typ, reason, format, args...)
}
