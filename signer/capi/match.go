package capi

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"sync"
	"time"

	"golang.org/x/time/rate"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/utils/clock"

	apimeta "k8s.io/apimachinery/pkg/api/meta"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
)

// infrastructureGroup is the API group of Cluster API infrastructure
// providers' objects, the only group a Machine's infrastructureRef is
// followed into.
const infrastructureGroup = "infrastructure.cluster.x-k8s.io"

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
	return attestor.Deny(reason, format, args...)
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
		return nil, deny(attestor.ReasonDuplicateProviderID, "Machines %q all have provider ID %q; remove the stale ones", names, providerID)
	}
	m := byID[0]
	if !m.DeletionTimestamp.IsZero() {
		return nil, deny(attestor.ReasonMachineDeleting, "Machine %s with provider ID %q is being deleted", m.Name, providerID)
	}
	if !claims(m, nodeName) {
		if m.Status.NodeRef.IsDefined() {
			return nil, deny(attestor.ReasonNodeNameMismatch, "Machine %s with provider ID %q is node %q, not %q", m.Name, providerID, m.Status.NodeRef.Name, nodeName)
		}
		return nil, deny(attestor.ReasonNodeNameMismatch, "Machine %s with provider ID %q does not claim node name %q (it claims %q)", m.Name, providerID, nodeName,
			claimedNames(m))
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
		return deny(attestor.ReasonMachineProviderIDMismatch, "node %q is Machine %s, whose provider ID is %q, not %q", nodeName, m.Name, m.Spec.ProviderID,
			providerID)
	}
	return deny(attestor.ReasonMachineNotFound, "no Machine of the Cluster has provider ID %q or claims node name %q", providerID, nodeName)
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

// Budget of a Matcher's live reads (DefaultLiveReadInterval,
// DefaultLiveReadBurst).
const (
	// DefaultLiveReadInterval is how often, in the long run, one Cluster's
	// requests may read the management API server live (a Machine list,
	// an infrastructure object) before they are denied for want of a
	// Machine; DefaultLiveReadBurst how many such reads may come at once.
	DefaultLiveReadInterval = 10 * time.Second
	DefaultLiveReadBurst    = 5
)

// ErrLiveReadLimited is wrapped by the transient error of a match that the
// cache alone would deny while the Cluster's live reads are over their
// budget: the request is retried, never denied for the budget, and a
// Machine the cache catches up with is found there.
var ErrLiveReadLimited = errors.New("the Cluster's live reads of the management cluster are over budget; retried from the cache")

// Matcher matches the nodes of one Cluster to its Machines. It implements
// engine.Machines.
type Matcher struct {
	// Cache is the manager's cached client, with Machines indexed by
	// IndexProviderID.
	Cache client.Reader
	// Live reads from the API server. It is asked before a request is denied
	// for want of a Machine, so that a Machine the cache has not seen yet
	// does not deny a good node. Live is the management client every
	// Cluster shares, and a bootstrap-token holder files requests for
	// Machines that do not exist at will: its reads are budgeted per
	// Cluster (LiveReads), and a request over the budget is retried (the
	// cache may have caught up by then), not denied.
	Live client.Reader
	// LiveReads is the budget of live reads; nil means one read per
	// DefaultLiveReadInterval, DefaultLiveReadBurst at once.
	LiveReads *rate.Limiter
	// Clock; nil means the real clock.
	Clock clock.PassiveClock
	// Namespace and Cluster name the Cluster.
	Namespace, Cluster string
	// Mapper resolves an infrastructure reference's group and kind to the
	// version the management cluster serves; nil reads no infrastructure
	// object.
	Mapper apimeta.RESTMapper

	once sync.Once
}

// live returns the live reader when the budget allows a read now, else an
// error wrapping ErrLiveReadLimited.
func (m *Matcher) live() (client.Reader, error) {
	m.once.Do(func() {
		if m.LiveReads == nil {
			m.LiveReads = rate.NewLimiter(rate.Every(DefaultLiveReadInterval), DefaultLiveReadBurst)
		}
		if m.Clock == nil {
			m.Clock = clock.RealClock{}
		}
	})
	if !m.LiveReads.AllowN(m.Clock.Now(), 1) {
		return nil, ErrLiveReadLimited
	}
	return m.Live, nil
}

// MatchMachine implements engine.Machines.
func (m *Matcher) MatchMachine(ctx context.Context, nodeName, providerID string) (*engine.Machine, error) {
	var list clusterv1.MachineList
	if err := m.Cache.List(ctx, &list, client.InNamespace(m.Namespace),
		client.MatchingFields{IndexProviderID: providerID},
		client.MatchingLabels{clusterv1.ClusterNameLabel: m.Cluster}); err != nil {
		return nil, fmt.Errorf("unable to list Machines: %w", err)
	}
	machine, err := Match(m.ofCluster(list.Items), nodeName, providerID)
	if err != nil && len(attestor.Denials(err)) > 0 {
		// About to deny: decide on what the API server says, not the cache.
		lr, lerr := m.live()
		if lerr != nil {
			return nil, fmt.Errorf("unable to confirm that no Machine has provider ID %q: %w", providerID, lerr)
		}
		var live clusterv1.MachineList
		if lerr := lr.List(ctx, &live, client.InNamespace(m.Namespace),
			client.MatchingLabels{clusterv1.ClusterNameLabel: m.Cluster}); lerr != nil {
			return nil, fmt.Errorf("unable to list Machines: %w", lerr)
		}
		machine, err = Match(m.ofCluster(live.Items), nodeName, providerID)
	}
	if err != nil {
		return nil, err
	}
	out := toMachine(machine)
	if err := m.withInfrastructure(ctx, machine, out); err != nil {
		return nil, err
	}
	return out, nil
}

// withInfrastructure adds the endorsement key pinned on the Machine's
// infrastructure object (where an infrastructure provider that registers
// its machines' TPMs publishes it) to what the verifier sees. The Machine
// and its infrastructure object may both pin it; when they disagree, the
// request is denied: the signer cannot tell which one is right.
//
// The object's metadata is read from the cache, as the Machine itself is
// (its own pin included): a decision costs the management API server no
// request. Only its absence is confirmed live before it denies, so that an
// object the cache has not seen yet does not deny a good node.
func (m *Matcher) withInfrastructure(ctx context.Context, machine *clusterv1.Machine, out *engine.Machine) error {
	ref := machine.Spec.InfrastructureRef
	if m.Mapper == nil || ref.Name == "" || ref.Kind == "" || ref.APIGroup != infrastructureGroup {
		// The reference is the tenant's to write: only an infrastructure
		// provider's object is read, never another kind it names.
		return nil
	}
	mapping, err := m.Mapper.RESTMapping(schema.GroupKind{Group: ref.APIGroup, Kind: ref.Kind})
	if apimeta.IsNoMatchError(err) {
		// The management cluster serves no such kind: nothing can pin a
		// key there.
		return nil
	}
	if err != nil {
		return fmt.Errorf("unable to resolve infrastructure kind %s.%s of Machine %s: %w", ref.Kind, ref.APIGroup, machine.Name, err)
	}
	infra := &metav1.PartialObjectMetadata{}
	infra.SetGroupVersionKind(mapping.GroupVersionKind)
	key := client.ObjectKey{Namespace: machine.Namespace, Name: ref.Name}
	err = m.Cache.Get(ctx, key, infra)
	if apierrors.IsNotFound(err) {
		lr, lerr := m.live()
		if lerr != nil {
			return fmt.Errorf("unable to confirm that %s %s of Machine %s does not exist: %w", ref.Kind, ref.Name, machine.Name, lerr)
		}
		err = lr.Get(ctx, key, infra)
	}
	if apierrors.IsNotFound(err) {
		return deny(attestor.ReasonMachineNotFound, "Machine %s references %s %s, which does not exist; a Machine without its infrastructure does not join",
			machine.Name, ref.Kind, ref.Name)
	}
	if err != nil {
		return fmt.Errorf("unable to read infrastructure object %s %s of Machine %s: %w", ref.Kind, ref.Name, machine.Name, err)
	}
	pinned, ok := infra.GetAnnotations()[attestor.AnnotationEndorsementKey]
	if !ok {
		return nil
	}
	if own, ok := out.Annotations[attestor.AnnotationEndorsementKey]; ok && own != pinned {
		return deny(attestor.ReasonEndorsementKeyConflict, "Machine %s and its %s %s pin different endorsement keys (%s); fix the one that is wrong", machine.Name,
			ref.Kind, ref.Name, attestor.AnnotationEndorsementKey)
	}
	if out.Annotations == nil {
		out.Annotations = map[string]string{}
	}
	out.Annotations[attestor.AnnotationEndorsementKey] = pinned
	return nil
}

// ForNode implements engine.Machines: the one Machine that is node
// nodeName, asking the API server before reporting none.
func (m *Matcher) ForNode(ctx context.Context, nodeName string) (*engine.Machine, error) {
	find := func(r client.Reader) (*engine.Machine, error) {
		var list clusterv1.MachineList
		if err := r.List(ctx, &list, client.InNamespace(m.Namespace), client.MatchingLabels{clusterv1.ClusterNameLabel: m.Cluster}); err != nil {
			return nil, fmt.Errorf("unable to list Machines: %w", err)
		}
		var found []*clusterv1.Machine
		items := m.ofCluster(list.Items)
		for i := range items {
			if claims(&items[i], nodeName) {
				found = append(found, &items[i])
			}
		}
		switch {
		case len(found) == 0:
			return nil, deny(attestor.ReasonMachineNotFound, "no Machine of the Cluster is node %q", nodeName)
		case len(found) > 1:
			return nil, deny(attestor.ReasonDuplicateProviderID, "%d Machines claim node name %q; remove the stale ones", len(found), nodeName)
		case !found[0].DeletionTimestamp.IsZero():
			return nil, deny(attestor.ReasonMachineDeleting, "Machine %s of node %q is being deleted", found[0].Name, nodeName)
		}
		return toMachine(found[0]), nil
	}
	out, err := find(m.Cache)
	if err != nil && len(attestor.Denials(err)) > 0 {
		lr, lerr := m.live()
		if lerr != nil {
			return nil, fmt.Errorf("unable to confirm that no Machine is node %q: %w", nodeName, lerr)
		}
		out, err = find(lr)
	}
	return out, err
}

// toMachine is what the engine needs to know about a Machine.
func toMachine(m *clusterv1.Machine) *engine.Machine {
	out := &engine.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID, ProviderID: m.Spec.ProviderID, Annotations: maps.Clone(m.Annotations),
		Joined: m.Status.NodeRef.IsDefined()}
	for _, a := range m.Status.Addresses {
		switch a.Type {
		case clusterv1.MachineHostName, clusterv1.MachineInternalDNS, clusterv1.MachineExternalDNS:
			out.DNSNames = append(out.DNSNames, a.Address)
		case clusterv1.MachineInternalIP, clusterv1.MachineExternalIP:
			if ip := net.ParseIP(a.Address); ip != nil {
				out.IPs = append(out.IPs, ip)
			}
		}
	}
	return out
}

func (m *Matcher) ofCluster(in []clusterv1.Machine) []clusterv1.Machine {
	return slices.DeleteFunc(in, func(x clusterv1.Machine) bool { return x.Spec.ClusterName != m.Cluster })
}
