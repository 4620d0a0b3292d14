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
// in the Cluster's status (fleet.go, written by status.go), and each as an
// Event in the management cluster, on the Machine the request matched, or
// on the Cluster when it matched none. Approvals are Normal, denials and
// failures Warning; the reason is the decision's. It implements
// controller.Recorder. The EventRecorder's broadcaster rate-limits and
// aggregates them per object (see NewEventBroadcaster in package app).
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
	if e.rec == nil {
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
	typ := corev1.EventTypeWarning
	if decision == controller.DecisionApproved {
		typ = corev1.EventTypeNormal
	}
	e.rec.Eventf(ref, typ, reason, "Kubelet client CSR %s in workload cluster %s %s: %s", csr, e.cluster, decision, message)
}

// decisionEvents returns the Recorder of cluster's CSR controller, which
// keeps the last decision in st.
func (r *ClusterReconciler) decisionEvents(cluster *clusterv1.Cluster, st *state) controller.Recorder {
	return &machineEvents{rec: r.Events, st: st, cluster: types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name}, uid: cluster.UID}
}
