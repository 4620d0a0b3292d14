package workload

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"testing/fstest"

	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"
)

// TestLoad: the manifests the controller installs load, hold one
// ServiceAccount that every binding names, and are every manifest of the
// directory (a file kustomize does not list would be installed by neither).
func TestLoad(t *testing.T) {
	m, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	want := types.NamespacedName{Namespace: "kube-system", Name: "kubelet-authenticator-node-attestation-controller"}
	if m.ServiceAccount != want {
		t.Errorf("ServiceAccount = %s, want %s", m.ServiceAccount, want)
	}
	var kinds []string
	for _, o := range m.Objects {
		kinds = append(kinds, o.GetKind())
	}
	for _, k := range []string{"ServiceAccount", "ClusterRole", "ClusterRoleBinding"} {
		if !slices.Contains(kinds, k) {
			t.Errorf("deploy/workload has no %s (has %v)", k, kinds)
		}
	}

	raw, err := os.ReadFile(kustomizationFile)
	if err != nil {
		t.Fatal(err)
	}
	var k kustomization
	if err := yaml.Unmarshal(raw, &k); err != nil {
		t.Fatal(err)
	}
	onDisk, err := filepath.Glob("*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range onDisk {
		if f != kustomizationFile && !slices.Contains(k.Resources, f) {
			t.Errorf("deploy/workload/%s is not among the kustomization's resources: neither kustomize nor the controller would install it", f)
		}
	}
}

// TestLoadRefuses: what the controller would not install as written is
// refused, every problem at once.
func TestLoadRefuses(t *testing.T) {
	const sa = "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: c, namespace: kube-system}\n"
	const role = "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: r}\n"
	const binding = "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: b}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: r}\n"
	kust := func(files ...string) *fstest.MapFile {
		return &fstest.MapFile{Data: []byte("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [" + strings.Join(files, ", ") + "]\n")}
	}
	good := binding + "subjects: [{kind: ServiceAccount, name: c, namespace: kube-system}]\n"
	if _, err := load(fstest.MapFS{kustomizationFile: kust("a.yaml"), "a.yaml": {Data: []byte(sa + "---\n" + role + "---\n" + good)}}); err != nil {
		t.Fatalf("a good set is refused: %v", err)
	}
	for name, tc := range map[string]struct {
		fs   fstest.MapFS
		want string
	}{
		"binding of another subject": {fstest.MapFS{kustomizationFile: kust("a.yaml"), "a.yaml": {Data: []byte(sa + "---\n" + binding + "subjects: [{kind: User, name: x, apiGroup: rbac.authorization.k8s.io}]\n")}},
			`ClusterRoleBinding "b" does not bind ServiceAccount kube-system/c`},
		"another kind": {fstest.MapFS{kustomizationFile: kust("a.yaml"), "a.yaml": {Data: []byte(sa + "---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d, namespace: x}\n")}},
			"not apps/v1, Kind=Deployment"},
		"no ServiceAccount":   {fstest.MapFS{kustomizationFile: kust("a.yaml"), "a.yaml": {Data: []byte(role)}}, "holds 0 ServiceAccounts"},
		"two ServiceAccounts": {fstest.MapFS{kustomizationFile: kust("a.yaml", "b.yaml"), "a.yaml": {Data: []byte(sa)}, "b.yaml": {Data: []byte(sa)}}, "holds 2 ServiceAccounts"},
		"namespaced without namespace": {fstest.MapFS{kustomizationFile: kust("a.yaml"), "a.yaml": {Data: []byte("apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: c}\n")}},
			"has no namespace"},
		"kustomize feature": {fstest.MapFS{kustomizationFile: {Data: []byte("kind: Kustomization\nresources: [a.yaml]\nnamePrefix: x-\n")}, "a.yaml": {Data: []byte(sa)}},
			"only apiVersion, kind and resources are read"},
		"file outside": {fstest.MapFS{kustomizationFile: kust("../controller/rbac.yaml")}, "is not a file of deploy/workload"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := load(tc.fs)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("load = %v, want an error saying %q", err, tc.want)
			}
		})
	}
}
