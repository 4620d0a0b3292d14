package capi

import (
	"slices"
	"testing"

	"k8s.io/apimachinery/pkg/types"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
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
