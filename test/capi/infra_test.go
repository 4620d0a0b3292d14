package capi

import (
	"context"
	"fmt"
	"net/url"
	"strconv"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
)

// The test infrastructure provider's API (testdata/infrastructure-crds.yaml).
const (
	infraGroup   = "infrastructure.cluster.x-k8s.io"
	infraVersion = "v1alpha1"
	// vmFinalizer keeps a TestMachine until its "VM" (the node's processes)
	// is gone, as a cloud provider keeps an InfraMachine until its instance
	// is terminated.
	vmFinalizer = "test.infrastructure.cluster.x-k8s.io/vm"
	// providerIDScheme is the provider ID format of this platform: the one
	// kubemark's hollow kubelet reports for its Node (kubemark://<node name>),
	// with which Cluster API matches the Node to the Machine.
	providerIDScheme = "kubemark://"
)

var (
	testClusters = schema.GroupVersionResource{Group: infraGroup, Version: infraVersion, Resource: "testclusters"}
	testMachines = schema.GroupVersionResource{Group: infraGroup, Version: infraVersion, Resource: "testmachines"}
	testTemplate = schema.GroupVersionResource{Group: infraGroup, Version: infraVersion, Resource: "testmachinetemplates"}
)

// provider is the test's infrastructure provider. It follows the v1beta2
// InfraCluster and InfraMachine contracts of Cluster API v1.14:
//   - a TestCluster gets spec.controlPlaneEndpoint (the workload API server)
//     and status.initialization.provisioned;
//   - a TestMachine owned by a Machine whose bootstrap data exists gets a
//     "VM": spec.providerID, status.addresses (its host name) and
//     status.initialization.provisioned; the node then boots (fleet.boot);
//   - a deleted TestMachine's VM is stopped before its finalizer goes.
type provider struct {
	dyn        dynamic.Interface
	mgmt       client.Client
	ns         string
	workload   string // workload API server URL
	stopVM     func(name string)
	mu         sync.Mutex
	created    map[string]vm // TestMachine name → VM waiting to boot or booted
	lastErr    error
	reconciles int
}

// vm is what the platform knows of a machine it created.
type vm struct {
	// Name is the machine's host name (its local_hostname metadata), the
	// TestMachine's name.
	Name string
	// Machine is the owning Machine's name; ControlPlane says it carries the
	// control-plane label.
	Machine      string
	ControlPlane bool
	// BootstrapSecret names the Secret holding the machine's user data.
	BootstrapSecret string
}

// run reconciles every 300 ms until ctx ends.
func (p *provider) run(ctx context.Context) {
	tick := time.NewTicker(300 * time.Millisecond)
	defer tick.Stop()
	for {
		err := p.reconcile(ctx)
		p.mu.Lock()
		p.lastErr = err
		p.reconciles++
		p.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

func (p *provider) reconcile(ctx context.Context) error {
	if err := p.reconcileClusters(ctx); err != nil {
		return err
	}
	return p.reconcileMachines(ctx)
}

func (p *provider) reconcileClusters(ctx context.Context) error {
	list, err := p.dyn.Resource(testClusters).Namespace(p.ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	u, err := url.Parse(p.workload)
	if err != nil {
		return err
	}
	port, err := strconv.ParseInt(u.Port(), 10, 64)
	if err != nil {
		return err
	}
	for i := range list.Items {
		tc := &list.Items[i]
		if done, _, _ := unstructured.NestedBool(tc.Object, "status", "initialization", "provisioned"); done {
			continue
		}
		if _, ok, _ := unstructured.NestedMap(tc.Object, "spec", "controlPlaneEndpoint"); !ok {
			if err := unstructured.SetNestedMap(tc.Object, map[string]any{"host": u.Hostname(), "port": port}, "spec", "controlPlaneEndpoint"); err != nil {
				return err
			}
			if tc, err = p.dyn.Resource(testClusters).Namespace(p.ns).Update(ctx, tc, metav1.UpdateOptions{}); err != nil {
				return err
			}
		}
		if err := unstructured.SetNestedField(tc.Object, true, "status", "initialization", "provisioned"); err != nil {
			return err
		}
		if _, err := p.dyn.Resource(testClusters).Namespace(p.ns).UpdateStatus(ctx, tc, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	return nil
}

func (p *provider) reconcileMachines(ctx context.Context) error {
	res := p.dyn.Resource(testMachines).Namespace(p.ns)
	list, err := res.List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	for i := range list.Items {
		tm := &list.Items[i]
		name := tm.GetName()
		if tm.GetDeletionTimestamp() != nil {
			// Terminate the instance, then let the object go.
			p.stopVM(name)
			p.mu.Lock()
			delete(p.created, name)
			p.mu.Unlock()
			if controllerutil.RemoveFinalizer(tm, vmFinalizer) {
				if _, err := res.Update(ctx, tm, metav1.UpdateOptions{}); err != nil && !apierrors.IsNotFound(err) {
					return err
				}
			}
			continue
		}
		if controllerutil.AddFinalizer(tm, vmFinalizer) {
			if tm, err = res.Update(ctx, tm, metav1.UpdateOptions{}); err != nil {
				return err
			}
		}
		if done, _, _ := unstructured.NestedBool(tm.Object, "status", "initialization", "provisioned"); done {
			continue
		}
		// A cloud provider creates the instance once the Machine's
		// bootstrap data (the instance's user data) exists.
		var owner string
		for _, ref := range tm.GetOwnerReferences() {
			if ref.Kind == "Machine" {
				owner = ref.Name
			}
		}
		if owner == "" {
			continue
		}
		var m clusterv1.Machine
		if err := p.mgmt.Get(ctx, client.ObjectKey{Namespace: p.ns, Name: owner}, &m); err != nil {
			if apierrors.IsNotFound(err) {
				continue
			}
			return err
		}
		if m.Spec.Bootstrap.DataSecretName == nil || *m.Spec.Bootstrap.DataSecretName == "" {
			continue
		}
		_, cp := m.Labels[clusterv1.MachineControlPlaneLabel]
		p.mu.Lock()
		if _, ok := p.created[name]; !ok {
			p.created[name] = vm{Name: name, Machine: m.Name, ControlPlane: cp, BootstrapSecret: *m.Spec.Bootstrap.DataSecretName}
		}
		p.mu.Unlock()
		if err := unstructured.SetNestedField(tm.Object, providerIDScheme+name, "spec", "providerID"); err != nil {
			return err
		}
		if tm, err = res.Update(ctx, tm, metav1.UpdateOptions{}); err != nil {
			return err
		}
		status := map[string]any{
			"initialization": map[string]any{"provisioned": true},
			"addresses":      []any{map[string]any{"type": string(clusterv1.MachineHostName), "address": name}},
		}
		if err := unstructured.SetNestedMap(tm.Object, status, "status"); err != nil {
			return err
		}
		if _, err := res.UpdateStatus(ctx, tm, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	return nil
}

// vms returns the VMs created so far.
func (p *provider) vms() []vm {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]vm, 0, len(p.created))
	for _, v := range p.created {
		out = append(out, v)
	}
	return out
}

// status says how the provider is doing, for failure messages.
func (p *provider) status() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return fmt.Sprintf("%d reconciles, last error: %v", p.reconciles, p.lastErr)
}
