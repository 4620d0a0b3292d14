package capi

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/signer/controller"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
)

// machineEvents records a workload cluster's CSR decisions: the last one
// in the Cluster's status (fleet.go, written by status.go), and each
// denial and failure as a Warning Event in the management cluster, on the
// Machine the request matched, or on the Cluster when it matched none,
// with the decision's reason. It implements controller.Recorder. The
// EventRecorder's broadcaster rate-limits and aggregates them per object
// (see NewEventBroadcaster in package app).
//
// An approval is no Event: the request's Approved condition carries its
// reason and message, the controller logs it, the Cluster's status shows
// the last one and the decisions metric counts them. An Event per join
// would be a management API write per node, sent at the Event client's
// pace (10 a second for every Cluster together) for minutes after a
// fleet joins, and ahead of the denials a person must act on, which wait
// in the same queue and are dropped with the rest when it is full.
type machineEvents struct {
	rec     record.EventRecorder // nil: no Events
	st      *state
	cluster types.NamespacedName
	uid     types.UID
}

// Decided implements controller.Recorder.
func (e *machineEvents) Decided(csr string, m *engine.Machine, decision, reason, message string) {
	last := Decision{Time: time.Now(), CSR: csr, Outcome: decision, Reason: reason, Message: message}
	if m != nil {
		last.Machine = m.Name
	}
	e.st.update(func(s *ClusterStatus) { s.LastDecision = last })
	if e.rec == nil || decision == controller.DecisionApproved {
		return
	}
	ref := &corev1.ObjectReference{
		APIVersion: clusterv1.GroupVersion.String(),
		Kind:       "Cluster",
		Namespace:  e.cluster.Namespace,
		Name:       e.cluster.Name,
		UID:        e.uid,
	}
	if m != nil && m.Name != "" {
		ref = &corev1.ObjectReference{
			APIVersion: clusterv1.GroupVersion.String(),
			Kind:       "Machine",
			Namespace:  m.Namespace,
			Name:       m.Name,
			UID:        m.UID,
		}
	}
	e.rec.Eventf(ref, corev1.EventTypeWarning, reason, "Kubelet client CSR %s in workload cluster %s %s: %s", csr, e.cluster, decision, message)
}

// decisionEvents returns the Recorder of cluster's CSR controller, which
// keeps the last decision in st.
func (r *ClusterReconciler) decisionEvents(cluster *clusterv1.Cluster, st *state) controller.Recorder {
	return &machineEvents{rec: r.Events, st: st, cluster: types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name}, uid: cluster.UID}
}
