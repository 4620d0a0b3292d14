package bench

import (
	"context"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// dockerMachines is the infrastructure kind the harness's Machines
// reference (spec.infrastructureRef: DockerMachine <machine name>).
var dockerMachines = schema.GroupVersionResource{Group: "infrastructure.cluster.x-k8s.io", Version: "v1beta1", Resource: "dockermachines"}

// serveInfrastructure makes the management cluster serve the
// infrastructure kind the benchmark's Machines reference, and creates one
// (empty) DockerMachine per name in ns, as an infrastructure provider
// would. A real management cluster always serves its provider's kinds:
// without them, every decision the controller takes looks the group up in
// discovery again (a RESTMapper miss), which a real fleet never pays.
// Call it before the controller starts.
func serveInfrastructure(b *testing.B, mgmt *harness.Management, ns string, names []string) {
	b.Helper()
	ctx := context.Background()
	ext, err := apiextensionsclient.NewForConfig(mgmt.AdminConfig)
	if err != nil {
		b.Fatal(err)
	}
	preserve := true
	crd := &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: dockerMachines.Resource + "." + dockerMachines.Group},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: dockerMachines.Group,
			Names: apiextensionsv1.CustomResourceDefinitionNames{Plural: dockerMachines.Resource, Singular: "dockermachine", Kind: "DockerMachine", ListKind: "DockerMachineList"},
			Scope: apiextensionsv1.NamespaceScoped,
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{
				Name: dockerMachines.Version, Served: true, Storage: true,
				Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
					Type: "object", XPreserveUnknownFields: &preserve,
				}},
			}},
		},
	}
	if _, err := ext.ApiextensionsV1().CustomResourceDefinitions().Create(ctx, crd, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		b.Fatal(err)
	}
	harness.WaitFor(b, time.Minute, func() (bool, error) {
		c, err := ext.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, crd.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, cond := range c.Status.Conditions {
			if cond.Type == apiextensionsv1.Established && cond.Status == apiextensionsv1.ConditionTrue {
				return true, nil
			}
		}
		return false, nil
	})
	cfg := rest.CopyConfig(mgmt.AdminConfig)
	cfg.QPS, cfg.Burst = 2000, 4000
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		b.Fatal(err)
	}
	signerParallel(b, len(names), func(ctx context.Context, i int) error {
		u := &unstructured.Unstructured{}
		u.SetAPIVersion(dockerMachines.GroupVersion().String())
		u.SetKind("DockerMachine")
		u.SetNamespace(ns)
		u.SetName(names[i])
		_, err := dyn.Resource(dockerMachines).Namespace(ns).Create(ctx, u, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return nil
		}
		return err
	})
}
