package capi

import (
	"context"
	"fmt"
	"maps"
	"slices"

	apimeta "k8s.io/apimachinery/pkg/api/meta"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/controller"
)

// Reasons of requests no Machine accounts for.
const (
	// ReasonMachineNotFound: no Machine of the Cluster has the provider ID or
	// claims the node name.
	ReasonMachineNotFound = "MachineNotFound"
	// ReasonNodeNameMismatch: the Machine with the provider ID does not claim
	// the node name (its name, a Hostname or InternalDNS address, or its
	// nodeRef once set).
	ReasonNodeNameMismatch = "NodeNameMismatch"
	// ReasonMachineProviderIDMismatch: the Machine that claims the node name
	// has another provider ID.
	ReasonMachineProviderIDMismatch = "MachineProviderIDMismatch"
	// ReasonDuplicateProviderID: more than one Machine has the provider ID.
	ReasonDuplicateProviderID = "DuplicateProviderID"
	// ReasonMachineDeleting: the Machine is being deleted.
	ReasonMachineDeleting = "MachineDeleting"
)

// IndexProviderID is the field index of Machines by spec.providerID.
const IndexProviderID = "spec.providerID"

// ProviderIDIndexer indexes a Machine by its spec.providerID.
func ProviderIDIndexer(obj client.Object) []string {
	m, ok := obj.(*clusterv1.Machine)
	if !ok || m.Spec.ProviderID == "" {
		return nil
	}
	return []string{m.Spec.ProviderID}
}

// NotReadyError reports a Machine that exists but may not be matched yet:
// its bootstrap data is not ready, or it has no provider ID yet. The CSR is
// retried, not denied.
type NotReadyError struct {
	Machine string
	Detail  string
}

func (e *NotReadyError) Error() string { return "Machine " + e.Machine + " " + e.Detail }

func deny(reason, format string, args ...any) error {
	return &checks.Failure{Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// Match picks, among machines (Machines of one Cluster), the one a node
// name and provider ID belong to. It returns a *checks.Failure when none
// does, and a *NotReadyError when the right Machine exists but is not ready
// to be matched yet.
func Match(machines []clusterv1.Machine, nodeName, providerID string) (*clusterv1.Machine, error) {
	var byID []*clusterv1.Machine
	for i := range machines {
		if machines[i].Spec.ProviderID == providerID {
			byID = append(byID, &machines[i])
		}
	}
	switch len(byID) {
	case 0:
		return nil, noMachineWithProviderID(machines, nodeName, providerID)
	case 1:
	default:
		names := make([]string, len(byID))
		for i, m := range byID {
			names[i] = m.Name
		}
		return nil, deny(ReasonDuplicateProviderID, "Machines %q all have provider ID %q; remove the stale ones", names, providerID)
	}
	m := byID[0]
	if !m.DeletionTimestamp.IsZero() {
		return nil, deny(ReasonMachineDeleting, "Machine %s with provider ID %q is being deleted", m.Name, providerID)
	}
	if !claims(m, nodeName) {
		if m.Status.NodeRef.IsDefined() {
			return nil, deny(ReasonNodeNameMismatch, "Machine %s with provider ID %q is node %q, not %q", m.Name, providerID, m.Status.NodeRef.Name, nodeName)
		}
		return nil, deny(ReasonNodeNameMismatch, "Machine %s with provider ID %q does not claim node name %q (it claims %q)", m.Name, providerID, nodeName, claimedNames(m))
	}
	if !BootstrapReady(m) {
		return nil, &NotReadyError{Machine: m.Name, Detail: "is not bootstrapped yet (no bootstrapDataSecretCreated, BootstrapConfigReady not True)"}
	}
	return m, nil
}

// noMachineWithProviderID explains why no Machine has providerID: another
// Machine claims the node name (with another provider ID, or none yet), or
// none does.
func noMachineWithProviderID(machines []clusterv1.Machine, nodeName, providerID string) error {
	for i := range machines {
		m := &machines[i]
		if !claims(m, nodeName) || !m.DeletionTimestamp.IsZero() {
			continue
		}
		if m.Spec.ProviderID == "" {
			return &NotReadyError{Machine: m.Name, Detail: "claims node name " + nodeName + " but has no provider ID yet"}
		}
		return deny(ReasonMachineProviderIDMismatch, "node %q is Machine %s, whose provider ID is %q, not %q", nodeName, m.Name, m.Spec.ProviderID, providerID)
	}
	return deny(ReasonMachineNotFound, "no Machine of the Cluster has provider ID %q or claims node name %q", providerID, nodeName)
}

// claims reports whether m may be node nodeName: once it has a nodeRef,
// only that name; before, its own name or a Hostname or InternalDNS address.
func claims(m *clusterv1.Machine, nodeName string) bool {
	if m.Status.NodeRef.IsDefined() {
		return m.Status.NodeRef.Name == nodeName
	}
	return slices.Contains(claimedNames(m), nodeName)
}

func claimedNames(m *clusterv1.Machine) []string {
	names := []string{m.Name}
	for _, a := range m.Status.Addresses {
		if a.Type == clusterv1.MachineHostName || a.Type == clusterv1.MachineInternalDNS {
			names = append(names, a.Address)
		}
	}
	return names
}

// BootstrapReady reports whether the Machine's bootstrap data exists:
// status.initialization.bootstrapDataSecretCreated, or the
// BootstrapConfigReady condition.
func BootstrapReady(m *clusterv1.Machine) bool {
	if b := m.Status.Initialization.BootstrapDataSecretCreated; b != nil && *b {
		return true
	}
	return apimeta.IsStatusConditionTrue(m.Status.Conditions, clusterv1.MachineBootstrapConfigReadyCondition)
}

// Matcher matches the nodes of one Cluster to its Machines. It implements
// controller.MachineMatcher.
type Matcher struct {
	// Cache is the manager's cached client, with Machines indexed by
	// IndexProviderID.
	Cache client.Reader
	// Live reads from the API server. It is asked before a request is denied
	// for want of a Machine, so that a Machine the cache has not seen yet
	// does not deny a good node.
	Live client.Reader
	// Namespace and Cluster name the Cluster.
	Namespace, Cluster string
}

// MatchMachine implements controller.MachineMatcher.
func (m *Matcher) MatchMachine(ctx context.Context, nodeName, providerID string) (*controller.Machine, error) {
	var list clusterv1.MachineList
	if err := m.Cache.List(ctx, &list, client.InNamespace(m.Namespace),
		client.MatchingFields{IndexProviderID: providerID},
		client.MatchingLabels{clusterv1.ClusterNameLabel: m.Cluster}); err != nil {
		return nil, fmt.Errorf("unable to list Machines: %w", err)
	}
	machine, err := Match(m.ofCluster(list.Items), nodeName, providerID)
	if err != nil && len(checks.Failures(err)) > 0 {
		// About to deny: decide on what the API server says, not the cache.
		var live clusterv1.MachineList
		if lerr := m.Live.List(ctx, &live, client.InNamespace(m.Namespace),
			client.MatchingLabels{clusterv1.ClusterNameLabel: m.Cluster}); lerr != nil {
			return nil, fmt.Errorf("unable to list Machines: %w", lerr)
		}
		machine, err = Match(m.ofCluster(live.Items), nodeName, providerID)
	}
	if err != nil {
		return nil, err
	}
	return &controller.Machine{
		Namespace:   machine.Namespace,
		Name:        machine.Name,
		UID:         machine.UID,
		ProviderID:  machine.Spec.ProviderID,
		Annotations: maps.Clone(machine.Annotations),
	}, nil
}

func (m *Matcher) ofCluster(in []clusterv1.Machine) []clusterv1.Machine {
	return slices.DeleteFunc(in, func(x clusterv1.Machine) bool { return x.Spec.ClusterName != m.Cluster })
}
