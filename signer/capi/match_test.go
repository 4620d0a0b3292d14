package capi

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clocktesting "k8s.io/utils/clock/testing"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

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
		{name: "ExternalDNS does not count", machines: []clusterv1.Machine{machine("m-0", pid, withAddress(clusterv1.MachineExternalDNS, "public.example"))}, node: "public.example", reason: attestor.ReasonNodeNameMismatch},
		{name: "by nodeRef", machines: []clusterv1.Machine{machine("m-0", pid, withNodeRef("node-a"))}, node: "node-a", want: "m-0"},
		{name: "nodeRef wins over the Machine name", machines: []clusterv1.Machine{machine("m-0", pid, withNodeRef("node-a"))}, node: "m-0", reason: attestor.ReasonNodeNameMismatch},
		{name: "BootstrapConfigReady condition", machines: []clusterv1.Machine{machine("m-0", pid, bootstrapCondition)}, node: "m-0", want: "m-0"},

		{name: "another node's name", machines: []clusterv1.Machine{machine("m-0", pid), machine("cp-0", "aws:///x/i-9")}, node: "cp-0", reason: attestor.ReasonNodeNameMismatch},
		{name: "no Machine at all", machines: []clusterv1.Machine{machine("m-1", "aws:///x/i-2")}, node: "ghost", reason: attestor.ReasonMachineNotFound},
		{name: "name of a Machine with another provider ID", machines: []clusterv1.Machine{machine("m-0", "aws:///x/i-2")}, node: "m-0", reason: attestor.ReasonMachineProviderIDMismatch},
		{name: "two Machines with the provider ID", machines: []clusterv1.Machine{machine("m-0", pid), machine("m-1", pid)}, node: "m-0", reason: attestor.ReasonDuplicateProviderID},
		{name: "Machine being deleted", machines: []clusterv1.Machine{machine("m-0", pid, deleting)}, node: "m-0", reason: attestor.ReasonMachineDeleting},

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

func TestEnabled(t *testing.T) {
	c := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{AnnotationEnabled: "true"}}}
	if !Enabled(c) {
		t.Error("not enabled")
	}
	c.Annotations[AnnotationEnabled] = "True"
	if Enabled(c) {
		t.Error(`"True" enabled the Cluster; only "true" does`)
	}
}

// countingReader counts the lists and the reads of one object it serves.
type countingReader struct {
	client.Reader
	mu    sync.Mutex
	lists int
	gets  int
}

func (r *countingReader) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	r.mu.Lock()
	r.gets++
	r.mu.Unlock()
	return r.Reader.Get(ctx, key, obj, opts...)
}

func (r *countingReader) List(ctx context.Context, list client.ObjectList, opts ...client.ListOption) error {
	r.mu.Lock()
	r.lists++
	r.mu.Unlock()
	return r.Reader.List(ctx, list, opts...)
}

// TestLiveReadBudget: requests for Machines that do not exist make the
// matcher re-list Machines live (through the management client every
// Cluster shares) before it denies; a bootstrap-token holder filing 100
// of them costs at most the Cluster's burst of live lists, then one per
// DefaultLiveReadInterval. A request over the budget is retried, never
// denied for it: a fresh Machine the cache has not seen yet is found once
// the budget allows a live read, or as soon as the cache has it.
func TestLiveReadBudget(t *testing.T) {
	scheme := runtime.NewScheme()
	if err := clusterv1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	labeled := func(m clusterv1.Machine) *clusterv1.Machine {
		m.Labels = map[string]string{clusterv1.ClusterNameLabel: "c"}
		return &m
	}
	build := func(objs ...client.Object) client.WithWatch {
		return fake.NewClientBuilder().WithScheme(scheme).WithObjects(objs...).
			WithIndex(&clusterv1.Machine{}, IndexProviderID, ProviderIDIndexer).Build()
	}
	fresh := labeled(machine("fresh", "test:///fresh"))
	cache := build()
	live := &countingReader{Reader: build(fresh)}
	fc := clocktesting.NewFakePassiveClock(time.Now())
	m := &Matcher{Cache: cache, Live: live, Namespace: "ns", Cluster: "c", Clock: fc}
	ctx := context.Background()

	const flood = 100
	denied, limited := 0, 0
	for i := range flood {
		_, err := m.MatchMachine(ctx, fmt.Sprintf("forged-%d", i), fmt.Sprintf("test:///forged-%d", i))
		switch r, _, ok := attestor.Denial(err); {
		case ok && r == attestor.ReasonMachineNotFound:
			denied++
		case errors.Is(err, ErrLiveReadLimited) && len(attestor.Denials(err)) == 0:
			limited++
		default:
			t.Fatalf("request %d for an unknown Machine: %v, want denied %s or retried for the budget", i, err, attestor.ReasonMachineNotFound)
		}
	}
	t.Logf("%d requests for unknown Machines: %d live lists, %d denied, %d retried", flood, live.lists, denied, limited)
	if live.lists > DefaultLiveReadBurst || denied != live.lists {
		t.Fatalf("%d requests for unknown Machines made %d live lists (%d denied), want at most %d", flood, live.lists, denied, DefaultLiveReadBurst)
	}

	// A good node whose Machine the cache has not seen yet, while the
	// budget is spent: retried, not denied; found once a live read is
	// allowed again.
	if _, err := m.MatchMachine(ctx, "fresh", "test:///fresh"); !errors.Is(err, ErrLiveReadLimited) || len(attestor.Denials(err)) > 0 {
		t.Fatalf("a fresh Machine over the budget: %v, want retried for the budget", err)
	}
	if _, err := m.ForNode(ctx, "fresh"); !errors.Is(err, ErrLiveReadLimited) || len(attestor.Denials(err)) > 0 {
		t.Fatalf("ForNode of a fresh Machine over the budget: %v, want retried for the budget", err)
	}
	fc.SetTime(fc.Now().Add(DefaultLiveReadInterval))
	got, err := m.MatchMachine(ctx, "fresh", "test:///fresh")
	if err != nil || got.Name != "fresh" {
		t.Fatalf("the fresh Machine after %s: %v, %v; want it found live", DefaultLiveReadInterval, got, err)
	}

	// The cache catches up: found there, with no live read, budget or not.
	before := live.lists
	if err := cache.Create(ctx, labeled(machine("cached", "test:///cached"))); err != nil {
		t.Fatal(err)
	}
	if got, err := m.MatchMachine(ctx, "cached", "test:///cached"); err != nil || got.Name != "cached" {
		t.Fatalf("a Machine in the cache over the budget: %v, %v; want it found", got, err)
	}
	if live.lists != before {
		t.Errorf("a Machine in the cache cost %d live lists", live.lists-before)
	}
}
