package harness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"
)

// ClusterAPIModule and ClusterAPIVersion name the Cluster API release whose
// CRDs (core/config/crd/bases) StartManagement installs.
const (
	ClusterAPIModule  = "sigs.k8s.io/cluster-api"
	ClusterAPIVersion = "v1.14.2"
)

// crdEstablishTimeout bounds the wait for the Cluster API CRDs to be served.
const crdEstablishTimeout = 60 * time.Second

// Management is a Cluster API management cluster: a control plane that serves
// the real Cluster API CRDs.
type Management struct {
	*ControlPlane
	// Client is a controller-runtime client (admin) whose scheme knows the
	// client-go types and Cluster API core v1beta2. It shadows
	// ControlPlane.Client, the clientset, which stays reachable as
	// m.ControlPlane.Client.
	Client client.Client

	// infra creates DockerMachines once the cluster serves them
	// (ServeInfrastructure).
	infra dynamic.Interface
}

// Scheme returns a new scheme with the client-go types and Cluster API core v1beta2.
func Scheme() (*runtime.Scheme, error) {
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, fmt.Errorf("unable to add client-go types to scheme: %w", err)
	}
	if err := clusterv1.AddToScheme(scheme); err != nil {
		return nil, fmt.Errorf("unable to add Cluster API types to scheme: %w", err)
	}
	return scheme, nil
}

// StartManagement starts a control plane named "management", installs every
// Cluster API core CRD of ClusterAPIVersion (Cluster, Machine, MachineSet,
// MachineDeployment, MachinePool, ...) and this project's own (deploy/crd),
// and returns once they are established.
func StartManagement(tb testing.TB, opts ...Option) *Management {
	tb.Helper()
	crds, err := clusterAPICRDs()
	if err != nil {
		tb.Fatal(err)
	}
	own, err := OwnCRDs()
	if err != nil {
		tb.Fatal(err)
	}
	crds = append(slices.Clip(crds), own...)
	cp := StartControlPlane(tb, "management", opts...)
	if err := installCRDs(cp, crds); err != nil {
		tb.Fatalf("control plane %s: %v", cp.Name, err)
	}
	scheme, err := Scheme()
	if err != nil {
		tb.Fatal(err)
	}
	c, err := client.New(cp.AdminConfig, client.Options{Scheme: scheme})
	if err != nil {
		tb.Fatalf("unable to create controller-runtime client: %v", err)
	}
	return &Management{ControlPlane: cp, Client: c}
}

var capiCRDs struct {
	sync.Mutex
	crds []*apiextensionsv1.CustomResourceDefinition
}

// clusterAPICRDs reads (once per test binary) the Cluster API core CRDs from
// the module cache.
func clusterAPICRDs() ([]*apiextensionsv1.CustomResourceDefinition, error) {
	capiCRDs.Lock()
	defer capiCRDs.Unlock()
	if capiCRDs.crds != nil {
		return capiCRDs.crds, nil
	}
	dir, err := ModuleDir(ClusterAPIModule, ClusterAPIVersion)
	if err != nil {
		return nil, err
	}
	files, err := filepath.Glob(filepath.Join(dir, "core", "config", "crd", "bases", "*.yaml"))
	if err != nil {
		return nil, fmt.Errorf("unable to list Cluster API CRDs: %w", err)
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no CRDs in %s/core/config/crd/bases", dir)
	}
	var crds []*apiextensionsv1.CustomResourceDefinition
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("unable to read CRD: %w", err)
		}
		for _, doc := range bytes.Split(b, []byte("\n---")) {
			if len(bytes.TrimSpace(bytes.TrimPrefix(bytes.TrimSpace(doc), []byte("---")))) == 0 {
				continue
			}
			crd := &apiextensionsv1.CustomResourceDefinition{}
			if err := yaml.UnmarshalStrict(doc, crd); err != nil {
				return nil, fmt.Errorf("unable to decode CRD in %s: %w", file, err)
			}
			crds = append(crds, crd)
		}
	}
	capiCRDs.crds = crds
	return crds, nil
}

// OwnCRDs reads this project's CRDs: the resources deploy/crd's
// kustomization lists, which every installation applies.
func OwnCRDs() ([]*apiextensionsv1.CustomResourceDefinition, error) {
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(root, "deploy", "crd")
	b, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		return nil, fmt.Errorf("unable to read the project's CRDs: %w", err)
	}
	var k struct {
		Resources []string `json:"resources"`
	}
	if err := yaml.Unmarshal(b, &k); err != nil || len(k.Resources) == 0 {
		return nil, fmt.Errorf("%s/kustomization.yaml lists no resources (%w)", dir, err)
	}
	files := make([]string, len(k.Resources))
	for i, r := range k.Resources {
		files[i] = filepath.Join(dir, r)
	}
	return readCRDFiles(files)
}

// installCRDs creates crds and waits until all are established.
func installCRDs(cp *ControlPlane, crds []*apiextensionsv1.CustomResourceDefinition) error {
	ctx := context.Background()
	c, err := apiextensionsclient.NewForConfig(cp.AdminConfig)
	if err != nil {
		return fmt.Errorf("unable to create apiextensions client: %w", err)
	}
	for _, crd := range crds {
		if _, err := c.ApiextensionsV1().CustomResourceDefinitions().Create(ctx, crd.DeepCopy(), metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("unable to create CRD %s: %w", crd.Name, err)
		}
	}
	var lastEstablished time.Time
	err = poll(ctx, crdEstablishTimeout, func() (bool, error) {
		list, err := c.ApiextensionsV1().CustomResourceDefinitions().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		established := map[string]bool{}
		for _, crd := range list.Items {
			for _, cond := range crd.Status.Conditions {
				if cond.Type == apiextensionsv1.Established && cond.Status == apiextensionsv1.ConditionTrue {
					established[crd.Name] = true
					if cond.LastTransitionTime.After(lastEstablished) {
						lastEstablished = cond.LastTransitionTime.Time
					}
				}
			}
		}
		var waiting []string
		for _, crd := range crds {
			if !established[crd.Name] {
				waiting = append(waiting, crd.Name)
			}
		}
		if len(waiting) > 0 {
			return false, fmt.Errorf("CRDs not established: %s", strings.Join(waiting, ", "))
		}
		return true, nil
	})
	if err != nil {
		return err
	}
	if err := warmUp(ctx, cp, crds); err != nil {
		return err
	}
	// kube-apiserver holds every create of a custom resource whose CRD was
	// established less than 2 s ago (by its condition's second-granular
	// lastTransitionTime) for 2 s; wait that out here, once.
	time.Sleep(time.Until(lastEstablished.Add(crdJustCreated)))
	return nil
}

// crdJustCreated is how long after a CRD is established kube-apiserver
// delays creates of its objects (apiextensions-apiserver crdHandler), plus a margin.
const crdJustCreated = 2*time.Second + 100*time.Millisecond

// warmUp lists every served version of every CRD once, all at the same time.
// The first request for a custom resource waits about a second for
// kube-apiserver to set up its storage; this way tests do not pay it once per kind.
func warmUp(ctx context.Context, cp *ControlPlane, crds []*apiextensionsv1.CustomResourceDefinition) error {
	cfg := rest.CopyConfig(cp.AdminConfig)
	cfg.WarningHandler = rest.NoWarnings{} // deprecated versions are listed on purpose
	dc, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("unable to create dynamic client: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, crdEstablishTimeout)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, len(crds)*2)
	for _, crd := range crds {
		for _, v := range crd.Spec.Versions {
			if !v.Served {
				continue
			}
			gvr := schema.GroupVersionResource{Group: crd.Spec.Group, Version: v.Name, Resource: crd.Spec.Names.Plural}
			wg.Go(func() {
				err := poll(ctx, crdEstablishTimeout, func() (bool, error) {
					_, err := dc.Resource(gvr).List(ctx, metav1.ListOptions{Limit: 1})
					return err == nil, err
				})
				if err != nil {
					errs <- fmt.Errorf("unable to list %s: %w", gvr, err)
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}

// AddWorkloadCluster creates, in namespace ns (creating it), a v1beta2
// Cluster name with the given annotations and spec.controlPlaneEndpoint
// pointing at wl, and the Secrets Cluster API keeps for it: <name>-kubeconfig
// (key "value": an admin kubeconfig for wl.URL) and <name>-ca (tls.crt and
// tls.key: wl's CA), both of type cluster.x-k8s.io/secret, labelled
// cluster.x-k8s.io/cluster-name=<name> and owned by the Cluster.
func (m *Management) AddWorkloadCluster(tb testing.TB, ns, name string, wl *ControlPlane, annotations map[string]string) *clusterv1.Cluster {
	tb.Helper()
	u, err := url.Parse(wl.URL)
	if err != nil {
		tb.Fatalf("unable to parse workload cluster URL: %v", err)
	}
	port, err := strconv.ParseInt(u.Port(), 10, 32)
	if err != nil {
		tb.Fatalf("unable to parse workload cluster port: %v", err)
	}
	cluster := &clusterv1.Cluster{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Annotations: annotations},
		Spec: clusterv1.ClusterSpec{
			ControlPlaneEndpoint: clusterv1.APIEndpoint{Host: u.Hostname(), Port: int32(port)},
		},
	}
	return m.CreateWorkloadCluster(tb, cluster, wl)
}

// CreateWorkloadCluster creates cluster (its namespace too, if missing) as
// given, for example with an infrastructureRef and no controlPlaneEndpoint
// when real Cluster API controllers fill it in, and then the Secrets Cluster
// API keeps for it, as AddWorkloadCluster does.
func (m *Management) CreateWorkloadCluster(tb testing.TB, cluster *clusterv1.Cluster, wl *ControlPlane) *clusterv1.Cluster {
	tb.Helper()
	ctx := context.Background()
	ns, name := cluster.Namespace, cluster.Name
	if err := ensureNamespace(ctx, m.ControlPlane.Client, ns); err != nil {
		tb.Fatal(err)
	}
	if err := m.Client.Create(ctx, cluster); err != nil {
		tb.Fatalf("unable to create Cluster %s/%s: %v", ns, name, err)
	}

	owner := metav1.OwnerReference{
		APIVersion: clusterv1.GroupVersion.String(),
		Kind:       "Cluster",
		Name:       cluster.Name,
		UID:        cluster.UID,
	}
	// Cluster API's kubeconfig: cluster <name>, user <name>-admin, context <name>-admin@<name>.
	admin := clientcmdapi.AuthInfo{ClientCertificateData: wl.adminCertPEM, ClientKeyData: wl.adminKeyPEM}
	kubeconfig := buildKubeconfig(name, wl.URL, wl.CACertPEM, name+"-admin", admin)
	for _, s := range []*corev1.Secret{
		clusterSecret(ns, name, name+"-kubeconfig", owner, map[string][]byte{"value": kubeconfig}),
		clusterSecret(ns, name, name+"-ca", owner, map[string][]byte{
			corev1.TLSCertKey:       wl.CACertPEM,
			corev1.TLSPrivateKeyKey: wl.CAKeyPEM,
		}),
	} {
		if err := m.Client.Create(ctx, s); err != nil {
			tb.Fatalf("unable to create Secret %s/%s: %v", ns, s.Name, err)
		}
	}
	return cluster
}

func clusterSecret(ns, cluster, name string, owner metav1.OwnerReference, data map[string][]byte) *corev1.Secret {
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:            name,
			Namespace:       ns,
			Labels:          map[string]string{clusterv1.ClusterNameLabel: cluster},
			OwnerReferences: []metav1.OwnerReference{owner},
		},
		Type: clusterv1.ClusterSecretType,
		Data: data,
	}
}

// CreateMachine creates a v1beta2 Machine name in ns for cluster (label
// cluster.x-k8s.io/cluster-name, spec.clusterName, spec.providerID,
// spec.bootstrap.dataSecretName <name>-bootstrap, spec.infrastructureRef a
// DockerMachine name), then sets through the status subresource
// status.initialization.bootstrapDataSecretCreated = bootstrapReady, the
// BootstrapConfigReady condition to match, and status.addresses (one
// Hostname entry per hostname).
func (m *Management) CreateMachine(tb testing.TB, ns, cluster, name, providerID string, bootstrapReady bool, hostnames ...string) *clusterv1.Machine {
	tb.Helper()
	ctx := context.Background()
	dataSecretName := name + "-bootstrap"
	machine := &clusterv1.Machine{
		ObjectMeta: metav1.ObjectMeta{
			Name:      name,
			Namespace: ns,
			Labels:    map[string]string{clusterv1.ClusterNameLabel: cluster},
		},
		Spec: clusterv1.MachineSpec{
			ClusterName: cluster,
			ProviderID:  providerID,
			Bootstrap:   clusterv1.Bootstrap{DataSecretName: &dataSecretName},
			InfrastructureRef: clusterv1.ContractVersionedObjectReference{
				APIGroup: clusterv1.GroupVersionInfrastructure.Group,
				Kind:     "DockerMachine",
				Name:     name,
			},
		},
	}
	if err := m.Client.Create(ctx, machine); err != nil {
		tb.Fatalf("unable to create Machine %s/%s: %v", ns, name, err)
	}
	if err := m.createInfrastructure(ctx, ns, name); err != nil {
		tb.Fatal(err)
	}

	ready := bootstrapReady
	machine.Status.Initialization.BootstrapDataSecretCreated = &ready
	condition := metav1.Condition{
		Type:               clusterv1.MachineBootstrapConfigReadyCondition,
		Status:             metav1.ConditionTrue,
		Reason:             clusterv1.MachineBootstrapDataSecretProvidedReason,
		LastTransitionTime: metav1.Now(),
		ObservedGeneration: machine.Generation,
	}
	if !bootstrapReady {
		condition.Status = metav1.ConditionFalse
		condition.Reason = clusterv1.MachineBootstrapConfigNotReadyReason
	}
	machine.Status.Conditions = []metav1.Condition{condition}
	machine.Status.Addresses = nil
	for _, h := range hostnames {
		machine.Status.Addresses = append(machine.Status.Addresses, clusterv1.MachineAddress{Type: clusterv1.MachineHostName, Address: h})
	}
	if err := m.Client.Status().Update(ctx, machine); err != nil {
		tb.Fatalf("unable to update status of Machine %s/%s: %v", ns, name, err)
	}
	return machine
}
