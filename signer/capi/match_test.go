package capi

import (
	"errors"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

type machineOpt func(*clusterv1.Machine)

func machine(name, providerID string, opts ...machineOpt) clusterv1.Machine {
	yes := true
	m := clusterv1.Machine{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns"},
		Spec:       clusterv1.MachineSpec{ClusterName: "c", ProviderID: providerID},
	}
	m.Status.Initialization.BootstrapDataSecretCreated = &yes
	for _, o := range opts {
		o(&m)
	}
	return m
}

func withAddress(t clusterv1.MachineAddressType, a string) machineOpt {
	return func(m *clusterv1.Machine) {
		m.Status.Addresses = append(m.Status.Addresses, clusterv1.MachineAddress{Type: t, Address: a})
	}
}

func withNodeRef(n string) machineOpt {
	return func(m *clusterv1.Machine) { m.Status.NodeRef.Name = n }
}

func notBootstrapped(m *clusterv1.Machine) { m.Status.Initialization.BootstrapDataSecretCreated = nil }

func bootstrapCondition(m *clusterv1.Machine) {
	m.Status.Initialization.BootstrapDataSecretCreated = nil
	m.Status.Conditions = []metav1.Condition{{Type: clusterv1.MachineBootstrapConfigReadyCondition, Status: metav1.ConditionTrue}}
}

func deleting(m *clusterv1.Machine) {
	now := metav1.Now()
	m.DeletionTimestamp = &now
}

func TestMatch(t *testing.T) {
	const pid = "aws:///us-east-1a/i-1"
	tests := []struct {
		name     string
		machines []clusterv1.Machine
		node     string
		want     string // Machine name on success
		reason   string // denial reason
		notReady bool
	}{
		{name: "by Machine name", machines: []clusterv1.Machine{machine("m-0", pid), machine("m-1", "aws:///x/i-2")}, node: "m-0", want: "m-0"},
		{name: "by Hostname address", machines: []clusterv1.Machine{machine("m-0", pid, withAddress(clusterv1.MachineHostName, "ip-10-0-0-1"))}, node: "ip-10-0-0-1", want: "m-0"},
		{name: "by InternalDNS address", machines: []clusterv1.Machine{machine("m-0", pid, withAddress(clusterv1.MachineInternalDNS, "ip-10-0-0-1.ec2.internal"))}, node: "ip-10-0-0-1.ec2.internal", want: "m-0"},
		{name: "ExternalDNS does not count", machines: []clusterv1.Machine{machine("m-0", pid, withAddress(clusterv1.MachineExternalDNS, "public.example"))}, node: "public.example", reason: ReasonNodeNameMismatch},
		{name: "by nodeRef", machines: []clusterv1.Machine{machine("m-0", pid, withNodeRef("node-a"))}, node: "node-a", want: "m-0"},
		{name: "nodeRef wins over the Machine name", machines: []clusterv1.Machine{machine("m-0", pid, withNodeRef("node-a"))}, node: "m-0", reason: ReasonNodeNameMismatch},
		{name: "BootstrapConfigReady condition", machines: []clusterv1.Machine{machine("m-0", pid, bootstrapCondition)}, node: "m-0", want: "m-0"},

		{name: "another node's name", machines: []clusterv1.Machine{machine("m-0", pid), machine("cp-0", "aws:///x/i-9")}, node: "cp-0", reason: ReasonNodeNameMismatch},
		{name: "no Machine at all", machines: []clusterv1.Machine{machine("m-1", "aws:///x/i-2")}, node: "ghost", reason: ReasonMachineNotFound},
		{name: "name of a Machine with another provider ID", machines: []clusterv1.Machine{machine("m-0", "aws:///x/i-2")}, node: "m-0", reason: ReasonMachineProviderIDMismatch},
		{name: "two Machines with the provider ID", machines: []clusterv1.Machine{machine("m-0", pid), machine("m-1", pid)}, node: "m-0", reason: ReasonDuplicateProviderID},
		{name: "Machine being deleted", machines: []clusterv1.Machine{machine("m-0", pid, deleting)}, node: "m-0", reason: ReasonMachineDeleting},

		{name: "bootstrap not ready is retried", machines: []clusterv1.Machine{machine("m-0", pid, notBootstrapped)}, node: "m-0", notReady: true},
		{name: "Machine without a provider ID yet is retried", machines: []clusterv1.Machine{machine("m-0", "")}, node: "m-0", notReady: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Match(tt.machines, tt.node, pid)
			switch {
			case tt.want != "":
				if err != nil || got.Name != tt.want {
					t.Fatalf("Match() = %v, %v; want %s", got, err, tt.want)
				}
			case tt.notReady:
				var nr *NotReadyError
				if !errors.As(err, &nr) || len(attestor.Denials(err)) != 0 {
					t.Fatalf("Match() error = %v, want a NotReadyError (retry, not deny)", err)
				}
			default:
				reason, _, ok := attestor.Denial(err)
				if !ok || reason != tt.reason {
					t.Fatalf("Match() error = %v, want denial %s", err, tt.reason)
				}
			}
		})
	}
}

func TestAuthorizedAttestors(t *testing.T) {
	c := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
		AnnotationEnabled:             "true",
		AnnotationAuthorizedAttestors: " tpm, aws,,tpm ",
	}}}
	if !Enabled(c) {
		t.Error("not enabled")
	}
	if got := AuthorizedAttestors(c); len(got) != 2 || got[0] != "tpm" || got[1] != "aws" {
		t.Errorf("AuthorizedAttestors() = %q", got)
	}
	c.Annotations[AnnotationEnabled] = "True"
	if Enabled(c) {
		t.Error(`"True" enabled the Cluster; only "true" does`)
	}
}
