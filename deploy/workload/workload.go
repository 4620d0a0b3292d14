// Package workload is deploy/workload compiled into the controller: the
// controller's own identity in a workload cluster (a ServiceAccount) and the
// least-privilege RBAC bound to it. The controller installs exactly these
// objects with a workload cluster's admin kubeconfig (package signer/scoped),
// so the manifests in this directory are the one definition of what the
// controller may do in a workload cluster; add a rule here and both the
// installed identity and a hand-applied `kubectl apply -k deploy/workload`
// get it.
package workload

import (
	"bytes"
	"embed"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"slices"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

//go:embed *.yaml
var files embed.FS

// kustomizationFile lists the manifests (its resources) in order.
const kustomizationFile = "kustomization.yaml"

// kinds are the kinds the manifests may hold, with their resources: the
// controller installs nothing else in a workload cluster.
var kinds = map[schema.GroupVersionKind]schema.GroupVersionResource{
	{Version: "v1", Kind: "ServiceAccount"}:                                  {Version: "v1", Resource: "serviceaccounts"},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "ClusterRole"}: {Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "clusterroles"},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "ClusterRoleBinding"}: {Group: "rbac.authorization.k8s.io", Version: "v1",
		Resource: "clusterrolebindings"},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "Role"}:        {Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "roles"},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "RoleBinding"}: {Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "rolebindings"},
}

// Resource returns the resource of a kind the manifests may hold.
func Resource(gvk schema.GroupVersionKind) (schema.GroupVersionResource, bool) {
	r, ok := kinds[gvk]
	return r, ok
}

// namespaced are the kinds of kinds that live in a namespace.
var namespaced = []string{"ServiceAccount", "Role", "RoleBinding"}

// kustomization is the part of kustomization.yaml the controller reads;
// any other field is refused, so that what kustomize renders and what the
// controller installs cannot differ.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Resources  []string `json:"resources"`
}

// Manifests are the objects of deploy/workload.
type Manifests struct {
	// Objects are the objects in the order the kustomization lists their
	// files, each in the order of its file.
	Objects []*unstructured.Unstructured
	// ServiceAccount is the controller's identity: the one ServiceAccount
	// among Objects, which every binding among Objects names.
	ServiceAccount types.NamespacedName
}

// Load returns the manifests of deploy/workload, checked: only the kinds
// of Kinds, namespaced ones with a namespace, exactly one ServiceAccount,
// and every binding naming it.
func Load() (*Manifests, error) {
	return load(files)
}

func load(files fs.FS) (*Manifests, error) {
	raw, err := fs.ReadFile(files, kustomizationFile)
	if err != nil {
		return nil, fmt.Errorf("deploy/workload: %w", err)
	}
	var k kustomization
	if err := yaml.UnmarshalStrict(raw, &k); err != nil {
		return nil, fmt.Errorf("deploy/workload/%s: only apiVersion, kind and resources are read: %w", kustomizationFile, err)
	}
	m := &Manifests{}
	var errs []error
	var accounts []types.NamespacedName
	for _, f := range k.Resources {
		if path.Base(f) != f {
			errs = append(errs, fmt.Errorf("deploy/workload/%s: resource %q is not a file of deploy/workload", kustomizationFile, f))
			continue
		}
		b, err := fs.ReadFile(files, f)
		if err != nil {
			errs = append(errs, fmt.Errorf("deploy/workload: %w", err))
			continue
		}
		dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
		for {
			u := &unstructured.Unstructured{}
			if err := dec.Decode(&u.Object); err != nil {
				if !errors.Is(err, io.EOF) {
					errs = append(errs, fmt.Errorf("deploy/workload/%s: %w", f, err))
				}
				break
			}
			if len(u.Object) == 0 {
				continue
			}
			at := fmt.Sprintf("deploy/workload/%s: %s %q", f, u.GetKind(), u.GetName())
			if _, ok := Resource(u.GroupVersionKind()); !ok {
				errs = append(errs, fmt.Errorf("%s: the controller installs only ServiceAccounts, "+
					"(Cluster)Roles and (Cluster)RoleBindings (rbac.authorization.k8s.io/v1), not %s",
					at, u.GroupVersionKind()))
				continue
			}
			switch ns := u.GetNamespace(); {
			case u.GetName() == "":
				errs = append(errs, fmt.Errorf("%s has no name", at))
			case slices.Contains(namespaced, u.GetKind()) && ns == "":
				errs = append(errs, fmt.Errorf("%s has no namespace", at))
			case !slices.Contains(namespaced, u.GetKind()) && ns != "":
				errs = append(errs, fmt.Errorf("%s is cluster-scoped but names namespace %q", at, ns))
			}
			if u.GetKind() == "ServiceAccount" {
				accounts = append(accounts, types.NamespacedName{Namespace: u.GetNamespace(), Name: u.GetName()})
			}
			m.Objects = append(m.Objects, u)
		}
	}
	if len(accounts) != 1 {
		errs = append(errs, fmt.Errorf("deploy/workload holds %d ServiceAccounts, want exactly one (the controller's identity)", len(accounts)))
	} else {
		m.ServiceAccount = accounts[0]
		for _, u := range m.Objects {
			if u.GetKind() == "ClusterRoleBinding" || u.GetKind() == "RoleBinding" {
				if !namesServiceAccount(u, m.ServiceAccount) {
					errs = append(errs, fmt.Errorf("deploy/workload: %s %q does not bind ServiceAccount %s", u.GetKind(), u.GetName(), m.ServiceAccount))
				}
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return m, nil
}

func namesServiceAccount(binding *unstructured.Unstructured, sa types.NamespacedName) bool {
	subjects, _, _ := unstructured.NestedSlice(binding.Object, "subjects")
	for _, s := range subjects {
		s, ok := s.(map[string]any)
		if ok && s["kind"] == "ServiceAccount" && s["name"] == sa.Name && s["namespace"] == sa.Namespace {
			return true
		}
	}
	return false
}
