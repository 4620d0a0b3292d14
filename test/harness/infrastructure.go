package harness

import (
	"context"
	"fmt"
	"testing"

	"golang.org/x/sync/errgroup"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
)

// DockerMachines is the infrastructure kind CreateMachine's Machines
// reference (spec.infrastructureRef: DockerMachine <machine name>).
var DockerMachines = schema.GroupVersionResource{Group: "infrastructure.cluster.x-k8s.io", Version: "v1beta1", Resource: "dockermachines"}

// infraCreators is how many DockerMachines ServeInfrastructure creates at
// once.
const infraCreators = 16

// ServeInfrastructure makes the management cluster serve the
// infrastructure kind the harness's Machines reference, as a real
// management cluster serves its provider's kinds, and creates one (empty)
// DockerMachine in ns for each of names; from then on CreateMachine
// creates each new Machine's DockerMachine too, as an infrastructure
// provider would. Without it the kind is not served and the controller
// reads no infrastructure object.
func (m *Management) ServeInfrastructure(tb testing.TB, ns string, names ...string) {
	tb.Helper()
	ctx := context.Background()
	if m.infra == nil {
		preserve := true
		crd := &apiextensionsv1.CustomResourceDefinition{
			ObjectMeta: metav1.ObjectMeta{Name: DockerMachines.Resource + "." + DockerMachines.Group},
			Spec: apiextensionsv1.CustomResourceDefinitionSpec{
				Group: DockerMachines.Group,
				Names: apiextensionsv1.CustomResourceDefinitionNames{Plural: DockerMachines.Resource, Singular: "dockermachine", Kind: "DockerMachine",
					ListKind: "DockerMachineList"},
				Scope: apiextensionsv1.NamespaceScoped,
				Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{
					Name: DockerMachines.Version, Served: true, Storage: true,
					Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
						Type: "object", XPreserveUnknownFields: &preserve,
					}},
				}},
			},
		}
		if err := installCRDs(m.ControlPlane, []*apiextensionsv1.CustomResourceDefinition{crd}); err != nil {
			tb.Fatal(err)
		}
		cfg := rest.CopyConfig(m.AdminConfig)
		cfg.QPS, cfg.Burst = 2000, 4000
		dyn, err := dynamic.NewForConfig(cfg)
		if err != nil {
			tb.Fatal(err)
		}
		m.infra = dyn
	}
	g, ctx := errgroup.WithContext(ctx)
	g.SetLimit(infraCreators)
	for _, name := range names {
		g.Go(func() error { return m.createInfrastructure(ctx, ns, name) })
	}
	if err := g.Wait(); err != nil {
		tb.Fatal(err)
	}
}

// createInfrastructure creates DockerMachine ns/name, once the management
// cluster serves the kind (ServeInfrastructure).
func (m *Management) createInfrastructure(ctx context.Context, ns, name string) error {
	if m.infra == nil {
		return nil
	}
	u := &unstructured.Unstructured{}
	u.SetAPIVersion(DockerMachines.GroupVersion().String())
	u.SetKind("DockerMachine")
	u.SetNamespace(ns)
	u.SetName(name)
	_, err := m.infra.Resource(DockerMachines).Namespace(ns).Create(ctx, u, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("unable to create DockerMachine %s/%s: %w", ns, name, err)
	}
	return nil
}
