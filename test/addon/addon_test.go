// Package addon tests that node-attestation-controller installs the way a
// Cluster API user installs an add-on: the real clusterctl reads the
// release artifacts of deploy/release (metadata.yaml, addon-components.yaml)
// from a local provider repository, lists and substitutes their variables;
// the real helm renders deploy/helm/kubelet-authenticator; both are applied
// server-side to a real management kube-apiserver; chart and components
// agree object for object; and the controller, run from what they
// install, logs JSON when told to and serves /metrics over HTTPS only to a
// token allowed to read it.
package addon

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

const (
	// namespace is where the components and the chart install the controller.
	namespace  = "kubelet-authenticator-system"
	deployment = "node-attestation-controller"
	// provider is the add-on provider's name in clusterctl's configuration.
	provider = "kubelet-authenticator"
	// version is the release the local repository serves; the series must
	// be one metadata.yaml lists.
	version = "v0.1.0"
)

// variables are the clusterctl variables the components declare, each with
// a default, so that `clusterctl init --addon` works with none set.
var variables = []string{
	"KUBELET_AUTHENTICATOR_ATTESTOR_CONFIG_ARG",
	"KUBELET_AUTHENTICATOR_LOGGING_FORMAT",
	"KUBELET_AUTHENTICATOR_LOG_LEVEL",
	"KUBELET_AUTHENTICATOR_MAX_CLIENT_CERTIFICATE_LIFETIME",
}

// objects are rendered manifests.
type objects []*unstructured.Unstructured

func decode(t *testing.T, what string, y []byte) objects {
	t.Helper()
	var out objects
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(y), 4096)
	for {
		var u unstructured.Unstructured
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return out
			}
			t.Fatalf("%s: %v\n%s", what, err, y)
		}
		if len(u.Object) > 0 {
			out = append(out, &u)
		}
	}
}

// find returns the object of kind and name, or nil.
func (o objects) find(kind, name string) *unstructured.Unstructured {
	for _, u := range o {
		if u.GetKind() == kind && u.GetName() == name {
			return u
		}
	}
	return nil
}

// get converts the object of kind and name into out.
func (o objects) get(t *testing.T, kind, name string, out any) {
	t.Helper()
	u := o.find(kind, name)
	if u == nil {
		t.Fatalf("no %s %s", kind, name)
	}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, out); err != nil {
		t.Fatalf("%s %s: %v", kind, name, err)
	}
}

// tools are the real programs the tests run.
type tools struct {
	kubectl, clusterctl, helm string
}

var toolDirs struct {
	sync.Mutex
	dirs map[string]string
}

// toolDir returns the directory the environment variable env names, or
// else the last line printed by the install script (which builds the tool
// once into a cache outside the repository). It fails, never skips, when
// the tool is unavailable.
func toolDir(t *testing.T, env, script string) string {
	t.Helper()
	toolDirs.Lock()
	defer toolDirs.Unlock()
	if d := toolDirs.dirs[env]; d != "" {
		return d
	}
	dir := os.Getenv(env)
	if dir == "" {
		root := repoRoot(t)
		cmd := exec.Command("bash", filepath.Join(root, "test", "tools", script))
		cmd.Dir = root
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("set %s or run test/tools/%s: %v\n%s", env, script, err, stderr.String())
		}
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		dir = strings.TrimSpace(lines[len(lines)-1])
	}
	if toolDirs.dirs == nil {
		toolDirs.dirs = map[string]string{}
	}
	toolDirs.dirs[env] = dir
	return dir
}

func getTools(t *testing.T) tools {
	t.Helper()
	tl := tools{
		kubectl:    filepath.Join(harness.Binaries(t), "kubectl"),
		clusterctl: filepath.Join(toolDir(t, "KA_CAPI_BIN", "install-capi.sh"), "clusterctl"),
		helm:       filepath.Join(toolDir(t, "KA_HELM_BIN", "install-helm.sh"), "helm"),
	}
	for _, p := range []string{tl.kubectl, tl.clusterctl, tl.helm} {
		if fi, err := os.Stat(p); err != nil || fi.Mode()&0o111 == 0 {
			t.Fatalf("%s is not an executable: %v", p, err)
		}
	}
	return tl
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// run runs a program and returns its stdout; env is added to the
// process's environment.
func run(t *testing.T, env []string, stdin []byte, name string, args ...string) []byte {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), env...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(name), strings.Join(args, " "), err, stderr.String())
	}
	return out
}

// repository is a clusterctl local provider repository holding this
// checkout's release artifacts, as `make release-manifests` writes them,
// and the clusterctl configuration that points to it and nowhere else.
type repository struct {
	tools
	config string
	// env makes clusterctl read only local files: no version check, its
	// configuration and overrides in a temporary directory.
	env []string
}

func newRepository(t *testing.T, tl tools) *repository {
	t.Helper()
	root := repoRoot(t)
	dir := t.TempDir()
	// {basepath}/{provider-label}/{version}/{components}: the label of an
	// add-on provider is addon-<name>.
	rel := filepath.Join(dir, "repository", "addon-"+provider, version)
	if err := os.MkdirAll(rel, 0o755); err != nil {
		t.Fatal(err)
	}
	components := run(t, nil, nil, tl.kubectl, "kustomize", filepath.Join(root, "deploy", "release"))
	write(t, filepath.Join(rel, "addon-components.yaml"), components)
	metadata, err := os.ReadFile(filepath.Join(root, "deploy", "release", "metadata.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(rel, "metadata.yaml"), metadata)
	config := filepath.Join(dir, "clusterctl.yaml")
	write(t, config, fmt.Appendf(nil, "providers:\n- name: %s\n  type: AddonProvider\n  url: file://%s\n",
		provider, filepath.Join(rel, "addon-components.yaml")))
	home := filepath.Join(dir, "home")
	if err := os.Mkdir(home, 0o700); err != nil {
		t.Fatal(err)
	}
	return &repository{tools: tl, config: config, env: []string{
		"CLUSTERCTL_DISABLE_VERSIONCHECK=true",
		"HOME=" + home,
		"XDG_CONFIG_HOME=" + filepath.Join(home, ".config"),
	}}
}

// clusterctl runs clusterctl with the repository's configuration.
func (r *repository) clusterctl(t *testing.T, env []string, args ...string) []byte {
	t.Helper()
	return run(t, append(append([]string(nil), r.env...), env...), nil, r.tools.clusterctl, append(args, "--config", r.config)...)
}

// components returns what `clusterctl generate provider --addon` installs
// with the variables in env (and the defaults for the others).
func (r *repository) components(t *testing.T, env ...string) ([]byte, objects) {
	t.Helper()
	y := r.clusterctl(t, env, "generate", "provider", "--addon", provider+":"+version)
	return y, decode(t, "clusterctl generate provider", y)
}

// chart renders the Helm chart into namespace with the given --set values.
func chart(t *testing.T, tl tools, namespace string, set ...string) ([]byte, objects) {
	t.Helper()
	args := []string{"template", "kubelet-authenticator", filepath.Join(repoRoot(t), "deploy", "helm", "kubelet-authenticator"), "--namespace", namespace}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	y := run(t, nil, nil, tl.helm, args...)
	return y, decode(t, "helm template", y)
}

func write(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// controllerArgs parses args with the controller's own flags and returns
// the value of each flag.
func controllerArgs(t *testing.T, args []string) func(string) string {
	t.Helper()
	fs := app.NewCommand().Flags()
	if err := fs.Parse(args); err != nil {
		t.Fatalf("container args %q: %v", args, err)
	}
	return func(name string) string {
		f := fs.Lookup(name)
		if f == nil {
			t.Fatalf("no flag --%s", name)
		}
		return f.Value.String()
	}
}

// TestClusterctlReadsTheReleaseArtifacts: the real clusterctl reads the
// add-on provider from a local repository (metadata.yaml and the
// components), names its version, namespace, image and variables, and
// substitutes them: defaults when unset, the operator's values when set.
func TestClusterctlReadsTheReleaseArtifacts(t *testing.T) {
	tl := getTools(t)
	r := newRepository(t, tl)

	// Without a version, clusterctl picks the latest release whose series
	// metadata.yaml declares.
	desc := string(r.clusterctl(t, nil, "generate", "provider", "--addon", provider, "--describe"))
	for _, want := range []string{
		"Type:               AddonProvider",
		"Version:            " + version,
		"File:               addon-components.yaml",
		"TargetNamespace:    " + namespace,
		"registry.k8s.io/kubelet-authenticator/node-attestation-controller:",
	} {
		if !strings.Contains(desc, want) {
			t.Errorf("clusterctl generate provider --describe does not say %q:\n%s", want, desc)
		}
	}
	var listed []string
	for _, l := range strings.Split(desc, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "- KUBELET_AUTHENTICATOR_"); ok {
			listed = append(listed, "KUBELET_AUTHENTICATOR_"+v)
		}
	}
	if !slices.Equal(listed, variables) {
		t.Errorf("clusterctl lists the variables %q, want %q", listed, variables)
	}

	// generate yaml --list-variables reads the same file the same way.
	comp := filepath.Join(t.TempDir(), "addon-components.yaml")
	write(t, comp, run(t, nil, nil, tl.kubectl, "kustomize", filepath.Join(repoRoot(t), "deploy", "release")))
	list := string(r.clusterctl(t, nil, "generate", "yaml", "--from", comp, "--list-variables"))
	for _, v := range variables {
		if !strings.Contains(list, v) {
			t.Errorf("clusterctl generate yaml --list-variables does not list %s:\n%s", v, list)
		}
	}

	// Defaults: what deploy/controller sets, no cloud attestor.
	y, objs := r.components(t)
	if bytes.Contains(y, []byte("${")) {
		t.Errorf("a variable is left unsubstituted:\n%s", y)
	}
	var d struct {
		Spec struct {
			Template struct {
				Spec struct {
					Containers []struct {
						Args []string `json:"args"`
					} `json:"containers"`
					Volumes []struct {
						ConfigMap struct {
							Name     string `json:"name"`
							Optional bool   `json:"optional"`
						} `json:"configMap"`
					} `json:"volumes"`
				} `json:"spec"`
			} `json:"template"`
		} `json:"spec"`
	}
	objs.get(t, "Deployment", deployment, &d)
	flag := controllerArgs(t, d.Spec.Template.Spec.Containers[0].Args)
	for name, want := range map[string]string{
		"max-client-certificate-lifetime": "168h0m0s",
		"logging-format":                  "text",
		"v":                               "0",
		"metrics-bind-address":            app.DefaultMetricsBindAddress,
		"insecure-diagnostics":            "false",
		"attestor-config":                 "",
	} {
		if got := flag(name); got != want {
			t.Errorf("default components: --%s=%s, want %s", name, got, want)
		}
	}
	// The attestor ConfigMap is the operator's, never the provider's (an
	// upgrade would overwrite it).
	if got := d.Spec.Template.Spec.Volumes[0].ConfigMap; got.Name != "node-attestation-controller-attestors" || !got.Optional || objs.find("ConfigMap", got.Name) != nil {
		t.Errorf("default components mount ConfigMap %+v, want an optional node-attestation-controller-attestors they do not ship", got)
	}
	for _, u := range objs {
		if _, ok := u.GetLabels()["clusterctl.cluster.x-k8s.io"]; !ok {
			t.Errorf("%s %s lacks clusterctl's label: clusterctl did not process it", u.GetKind(), u.GetName())
		}
	}

	// An operator's values.
	_, objs = r.components(t,
		"KUBELET_AUTHENTICATOR_MAX_CLIENT_CERTIFICATE_LIFETIME=24h",
		"KUBELET_AUTHENTICATOR_LOGGING_FORMAT=json",
		"KUBELET_AUTHENTICATOR_LOG_LEVEL=4",
		"KUBELET_AUTHENTICATOR_ATTESTOR_CONFIG_ARG=--attestor-config=/etc/node-attestation-controller/attestor-config.yaml")
	objs.get(t, "Deployment", deployment, &d)
	flag = controllerArgs(t, d.Spec.Template.Spec.Containers[0].Args)
	for name, want := range map[string]string{
		"max-client-certificate-lifetime": "24h0m0s",
		"logging-format":                  "json",
		"v":                               "4",
		"attestor-config":                 "/etc/node-attestation-controller/attestor-config.yaml",
	} {
		if got := flag(name); got != want {
			t.Errorf("with variables set: --%s=%s, want %s", name, got, want)
		}
	}
}

// TestChartAndComponentsAgree: with its default values, the chart renders
// the very objects the clusterctl components install (metadata aside: Helm
// adds its labels), so that the two ways to install cannot drift; and the
// Deployment's arguments are the controller's flags.
func TestChartAndComponentsAgree(t *testing.T) {
	tl := getTools(t)
	r := newRepository(t, tl)
	_, comps := r.components(t)
	_, charted := chart(t, tl, namespace)

	seen := map[string]bool{}
	for _, c := range comps {
		if c.GetKind() == "Namespace" {
			continue // Helm installs into a namespace it is given
		}
		key := objectKey(c)
		seen[key] = true
		h := charted.find(c.GetKind(), c.GetName())
		if h == nil || objectKey(h) != key {
			t.Errorf("the chart does not render %s", key)
			continue
		}
		if diff := differences(content(c), content(h)); len(diff) > 0 {
			t.Errorf("%s differs between deploy/release (clusterctl) and the chart (change deploy/helm/kubelet-authenticator/templates with deploy/controller):\n%s", key, strings.Join(diff, "\n"))
		}
	}
	for _, h := range charted {
		if key := objectKey(h); !seen[key] {
			t.Errorf("the chart renders %s, which the components do not install", key)
		}
	}

	var d struct {
		Spec struct {
			Template struct {
				Spec struct {
					Containers []struct {
						Args []string `json:"args"`
					} `json:"containers"`
				} `json:"spec"`
			} `json:"template"`
		} `json:"spec"`
	}
	charted.get(t, "Deployment", deployment, &d)
	controllerArgs(t, d.Spec.Template.Spec.Containers[0].Args)
}

// clusterScoped are the cluster-scoped kinds the manifests hold. clusterctl
// v1.14 knows only some (not the admission policies) and gives the others
// the provider's namespace, which the API server ignores.
var clusterScoped = []string{"Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}

// objectKey names an object: kind, namespace if it has one, name.
func objectKey(u *unstructured.Unstructured) string {
	if slices.Contains(clusterScoped, u.GetKind()) {
		return u.GetKind() + " " + u.GetName()
	}
	return u.GetKind() + " " + u.GetNamespace() + "/" + u.GetName()
}

// content is an object without its metadata but for its key,
// without status (kustomize writes an empty one), and without the pod template's annotations (the chart's checksum of its
// attestor ConfigMap).
func content(u *unstructured.Unstructured) map[string]any {
	c := u.DeepCopy().Object
	c["metadata"] = map[string]any{"key": objectKey(u)}
	delete(c, "status")
	unstructured.RemoveNestedField(c, "spec", "template", "metadata", "annotations")
	return c
}

// differences lists the paths where a and b differ.
func differences(a, b any) []string {
	var out []string
	var walk func(path string, a, b any)
	walk = func(path string, a, b any) {
		am, aok := a.(map[string]any)
		bm, bok := b.(map[string]any)
		if aok && bok {
			keys := map[string]bool{}
			for k := range am {
				keys[k] = true
			}
			for k := range bm {
				keys[k] = true
			}
			for k := range keys {
				walk(path+"."+k, am[k], bm[k])
			}
			return
		}
		if !reflect.DeepEqual(a, b) {
			out = append(out, fmt.Sprintf("  %s: components %v, chart %v", path, a, b))
		}
	}
	walk("", a, b)
	slices.Sort(out)
	return out
}
