package capi

import (
	"context"
	"fmt"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
)

func withUID(uid types.UID) machineOpt { return func(m *clusterv1.Machine) { m.UID = uid } }

// A deleted Machine's node names are revoked: its nodeRef once its node
// joined, else every name a certificate could have been issued for, also a
// name another Machine of the Cluster claims; the certificates of a Machine
// that claims the name stay accepted (claimants), the deleted Machine's
// never.
func TestNamesToRevoke(t *testing.T) {
	host := withAddress(clusterv1.MachineHostName, "ip-10-0-0-1")
	dns := withAddress(clusterv1.MachineInternalDNS, "ip-10-0-0-1.ec2.internal")
	tests := []struct {
		name    string
		deleted clusterv1.Machine
		others  []clusterv1.Machine
		want    []string
		// claimed are the node names whose certificates issued to
		// Machine u1 stay accepted.
		claimed []string
	}{
		{name: "joined: its node", deleted: machine("m-0", "p", withUID("u0"), host, withNodeRef("ip-10-0-0-1")), want: []string{"ip-10-0-0-1"}},
		{name: "never joined: every name it claims", deleted: machine("m-0", "p", withUID("u0"), host, dns),
			want: []string{"ip-10-0-0-1", "ip-10-0-0-1.ec2.internal", "m-0"}},
		{name: "the deleted Machine itself in the list", deleted: machine("m-0", "p", withUID("u0")), others: []clusterv1.Machine{machine("m-0", "p", withUID("u0"))},
			want: []string{"m-0"}},
		{name: "a name another Machine's node has", deleted: machine("m-0", "p", withUID("u0"), host),
			others: []clusterv1.Machine{machine("m-1", "q", withUID("u1"), withNodeRef("ip-10-0-0-1"))}, want: []string{"ip-10-0-0-1", "m-0"}, claimed: []string{"ip-10-0-0-1"}},
		{name: "a name another Machine claims before joining", deleted: machine("m-0", "p", withUID("u0"), host),
			others: []clusterv1.Machine{machine("m-1", "q", withUID("u1"), host)}, want: []string{"ip-10-0-0-1", "m-0"}, claimed: []string{"ip-10-0-0-1"}},
		{name: "a new Machine of the same name", deleted: machine("m-0", "p", withUID("u0")),
			others: []clusterv1.Machine{machine("m-0", "q", withUID("u1"))}, want: []string{"m-0"}, claimed: []string{"m-0"}},
		{name: "a Hostname that is no node name", deleted: machine("m-0", "p", withUID("u0"), withAddress(clusterv1.MachineHostName, "Not_A_Node")),
			want: []string{"m-0"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := namesToRevoke(&tt.deleted)
			if !slices.Equal(got, tt.want) {
				t.Errorf("namesToRevoke = %q, want %q", got, tt.want)
			}
			c := claimants(&tt.deleted, append(slices.Clone(tt.others), tt.deleted))
			for _, n := range got {
				if c(n, tt.deleted.UID) {
					t.Errorf("the deleted Machine's certificates for %s stay accepted", n)
				}
				if want := slices.Contains(tt.claimed, n); c(n, "u1") != want {
					t.Errorf("Machine u1's certificates for %s accepted = %t, want %t", n, !want, want)
				}
			}
		})
	}
}

// A deleted Machine's pending revocation is kept in the controller's
// namespace until it is enforced: it is found again by a process that never
// saw the deletion, only for its own Cluster, and goes once forgotten. A
// record whose Cluster no longer exists is removed.
func TestPendingRevocations(t *testing.T) {
	ctx := context.Background()
	scheme := runtime.NewScheme()
	if err := clusterv1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := corev1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	other := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "other"}}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(other).Build()
	nn := types.NamespacedName{Namespace: "ns", Name: "c"}
	gone := machine("m-0", "p", withUID("u0"), withAddress(clusterv1.MachineHostName, "ip-10-0-0-1"))
	gone.Labels = map[string]string{clusterv1.ClusterNameLabel: "c", "tenant": "label"}
	ofOther := machine("m-1", "q", withUID("u1"))
	ofOther.Labels = map[string]string{clusterv1.ClusterNameLabel: "other"}
	ofGone := machine("m-2", "r", withUID("u2"))
	ofGone.Labels = map[string]string{clusterv1.ClusterNameLabel: "deleted"}

	writer := &ClusterReconciler{Client: c, APIReader: c, Namespace: "ka-system"}
	writer.init()
	for _, w := range []struct {
		cluster types.NamespacedName
		m       *clusterv1.Machine
	}{{nn, &gone}, {types.NamespacedName{Namespace: "ns", Name: "other"}, &ofOther}, {types.NamespacedName{Namespace: "ns", Name: "deleted"}, &ofGone}} {
		if err := writer.recordPending(ctx, w.cluster, deletedMachine(w.m)); err != nil {
			t.Fatal(err)
		}
	}

	r := &ClusterReconciler{Client: c, APIReader: c, Namespace: "ka-system"}
	r.init()
	pending, err := r.pendingRevocations(ctx, klog.Background(), nn)
	if err != nil {
		t.Fatal(err)
	}
	if len(pending) != 1 || pending[0].UID != "u0" || !slices.Equal(namesToRevoke(pending[0]), []string{"ip-10-0-0-1", "m-0"}) {
		t.Fatalf("pending = %+v, want Machine m-0 with its names", pending)
	}
	var list corev1.ConfigMapList
	if err := c.List(ctx, &list, client.InNamespace("ka-system")); err != nil {
		t.Fatal(err)
	}
	if len(list.Items) != 2 {
		t.Errorf("%d records left, want 2: the deleted Cluster's is removed", len(list.Items))
	}
	if err := r.forgetPending(ctx, nn, pending[0]); err != nil {
		t.Fatal(err)
	}
	if pending, err := r.pendingRevocations(ctx, klog.Background(), nn); err != nil || len(pending) != 0 {
		t.Fatalf("after it was enforced: pending = %+v, %v", pending, err)
	}
}

// A Machine the record of issued certificates names and that is gone is a
// deletion no informer saw: found, unless it is pending already, lives in
// another namespace than the Cluster's, or a Machine of its name is there
// (created again, with another UID, as clusterctl move does). The API
// server is asked about at most maxUnseenChecks Machines a round, only
// those the cache does not hold.
func TestUnseenDeletions(t *testing.T) {
	ctx := context.Background()
	scheme := runtime.NewScheme()
	if err := clusterv1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	live := machine("live", "p", withUID("l"))
	moved := machine("moved", "q", withUID("moved-new"))
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(&live, &moved).Build()
	reader := &countingReader{Reader: c}
	r := &ClusterReconciler{Client: c, APIReader: reader}
	r.init()
	nn := types.NamespacedName{Namespace: "ns", Name: "c"}
	issued := func(ns, name string, uid types.UID, node string) revoke.Credential {
		return revoke.Credential{Node: node, Machine: revoke.Machine{Namespace: ns, Name: name, UID: uid}}
	}
	s := &revoke.State{Issued: []revoke.Credential{
		issued("ns", "live", "l", "node-live"),
		issued("ns", "moved", "moved-old", "node-moved"),
		issued("ns", "gone", "g", "node-gone"),
		issued("ns", "gone", "g", "node-gone"), // a renewal
		issued("elsewhere", "gone-too", "x", "node-x"),
		issued("ns", "pending", "p", "node-p"),
	}}
	pending := []*clusterv1.Machine{{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "pending", UID: "p"}}}
	got, err := r.unseenDeletions(ctx, nn, s, pending)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Name != "gone" || got[0].UID != "g" || got[0].Namespace != "ns" || got[0].Labels[clusterv1.ClusterNameLabel] != "c" {
		t.Fatalf("unseen deletions = %+v, want Machine ns/gone of Cluster c alone", got)
	}
	if reader.gets != 1 {
		t.Errorf("%d Machines read from the API server, want 1 (the one the cache does not hold)", reader.gets)
	}

	// A record naming many Machines that are gone: a bounded number of
	// reads a round.
	s.Issued = nil
	for i := range 3 * maxUnseenChecks {
		s.Issued = append(s.Issued, issued("ns", fmt.Sprintf("gone-%02d", i), types.UID(fmt.Sprintf("g%02d", i)), fmt.Sprintf("node-%02d", i)))
	}
	reader.gets = 0
	got, err = r.unseenDeletions(ctx, nn, s, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != maxUnseenChecks || reader.gets != maxUnseenChecks {
		t.Errorf("%d found with %d reads, want %d of each", len(got), reader.gets, maxUnseenChecks)
	}
}

// Cluster API's pause of a Cluster (its spec or its annotation) holds
// revocation: clusterctl move deletes the Machines of a paused Cluster
// that live on in another management cluster.
func TestPaused(t *testing.T) {
	yes, no := true, false
	for _, c := range []struct {
		name        string
		spec        *bool
		annotations map[string]string
		want        bool
	}{
		{"not paused", nil, nil, false},
		{"spec.paused false", &no, map[string]string{"other": "x"}, false},
		{"spec.paused", &yes, nil, true},
		{"annotated", nil, map[string]string{clusterv1.PausedAnnotation: ""}, true},
	} {
		cluster := &clusterv1.Cluster{}
		cluster.Spec.Paused, cluster.Annotations = c.spec, c.annotations
		if got := paused(cluster); got != c.want {
			t.Errorf("%s: paused = %t, want %t", c.name, got, c.want)
		}
	}
}
