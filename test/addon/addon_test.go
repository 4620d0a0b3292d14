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

	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
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

// standaloneValues are the helm flags of a standalone install, as
// docs/standalone.md gives them: standalone mode uses no ClusterAttestation,
// so its CRD is skipped.
var standaloneValues = []string{"--set", "mode=standalone", "--skip-crds"}

// chart renders the Helm chart into namespace with the given helm flags
// (--set ...). It renders the chart's crds/ too, as helm install installs
// them, unless the flags say --skip-crds.
func chart(t *testing.T, tl tools, namespace string, flags ...string) ([]byte, objects) {
	t.Helper()
	args := []string{"template", "kubelet-authenticator", filepath.Join(repoRoot(t), "deploy", "helm", "kubelet-authenticator"), "--namespace", namespace}
	if !slices.Contains(flags, "--skip-crds") {
		args = append(args, "--include-crds")
	}
	args = append(args, slices.DeleteFunc(slices.Clone(flags), func(f string) bool { return f == "--skip-crds" })...)
	y := run(t, nil, nil, tl.helm, args...)
	return y, decode(t, "helm template", y)
}

func write(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// controllerArgs parses args with the controller's own flags (those of its
// subcommand when args start with one, as standalone mode's do) and returns
// the value of each flag.
func controllerArgs(t *testing.T, args []string) func(string) string {
	t.Helper()
	cmd, rest, err := app.NewCommand().Find(args)
	if err != nil {
		t.Fatalf("container args %q: %v", args, err)
	}
	fs := cmd.Flags()
	if err := fs.Parse(rest); err != nil || fs.NArg() > 0 {
		t.Fatalf("container args %q: %v (arguments %q)", args, err, fs.Args())
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
// adds its labels), and with mode: standalone those of deploy/standalone
// (same arguments, same RBAC rules, no Cluster API rule, no admission
// policy or CRD of Cluster API mode), so that the ways to install cannot
// drift; and the Deployment's arguments are the controller's flags (of
// its standalone command in standalone mode).
func TestChartAndComponentsAgree(t *testing.T) {
	tl := getTools(t)
	for _, c := range []struct {
		mode string
		// what, and what to change with the chart's templates.
		what, change string
		reference    func(t *testing.T) objects
		values       []string
	}{
		{"capi", "deploy/release (clusterctl)", "deploy/controller", func(t *testing.T) objects {
			_, comps := newRepository(t, tl).components(t)
			return comps
		}, nil},
		{"standalone", "deploy/standalone", "deploy/standalone", func(t *testing.T) objects {
			return decode(t, "kustomize deploy/standalone", run(t, nil, nil, tl.kubectl, "kustomize", filepath.Join(repoRoot(t), "deploy", "standalone")))
		}, standaloneValues},
	} {
		t.Run(c.mode, func(t *testing.T) {
			reference := c.reference(t)
			_, charted := chart(t, tl, namespace, c.values...)
			seen := map[string]bool{}
			for _, r := range reference {
				if r.GetKind() == "Namespace" {
					continue // Helm installs into a namespace it is given
				}
				key := objectKey(r)
				seen[key] = true
				h := charted.find(r.GetKind(), r.GetName())
				if h == nil || objectKey(h) != key {
					t.Errorf("the chart does not render %s", key)
					continue
				}
				if diff := differences(content(r), content(h)); len(diff) > 0 {
					t.Errorf("%s differs between %s and the chart (change deploy/helm/kubelet-authenticator/templates with %s):\n%s", key, c.what, c.change, strings.Join(diff, "\n"))
				}
			}
			for _, h := range charted {
				if key := objectKey(h); !seen[key] {
					t.Errorf("the chart renders %s, which %s does not install", key, c.what)
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
		})
	}
}

// clusterScoped are the cluster-scoped kinds the manifests hold. clusterctl
// v1.14 knows only some (not the admission policies) and gives the others
// the provider's namespace, which the API server ignores.
var clusterScoped = []string{"Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "CustomResourceDefinition"}

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
			out = append(out, fmt.Sprintf("  %s: reference %v, chart %v", path, a, b))
		}
	}
	walk("", a, b)
	slices.Sort(out)
	return out
}

// TestChartValues renders the chart's options and checks that each does
// what values.yaml says: the ServiceMonitor scrapes the Service's metrics
// port over HTTPS with a token (plain HTTP with metrics.insecure, which the
// controller is told); attestorConfig becomes a valid AttestorConfig that
// --attestor-config reads from its mount; metrics.certSecretName is the
// directory --metrics-cert-dir names; metrics.readers are bound to the
// metrics-reader ClusterRole; the standalone values become the standalone
// command's flags and the names its Role grants; a combination that cannot
// work fails helm template with the value to change.
func TestChartValues(t *testing.T) {
	tl := getTools(t)
	const ns = "ka"

	type container struct {
		Args         []string `json:"args"`
		VolumeMounts []struct {
			Name      string `json:"name"`
			MountPath string `json:"mountPath"`
		} `json:"volumeMounts"`
	}
	type deploymentSpec struct {
		Spec struct {
			Template struct {
				Spec struct {
					Containers []container `json:"containers"`
					Volumes    []struct {
						Name      string `json:"name"`
						ConfigMap *struct {
							Name string `json:"name"`
						} `json:"configMap"`
						Secret *struct {
							SecretName string `json:"secretName"`
						} `json:"secret"`
					} `json:"volumes"`
				} `json:"spec"`
			} `json:"template"`
		} `json:"spec"`
	}
	mountOf := func(c container, volume string) string {
		for _, m := range c.VolumeMounts {
			if m.Name == volume {
				return m.MountPath
			}
		}
		return ""
	}
	type serviceMonitor struct {
		Spec struct {
			Selector struct {
				MatchLabels map[string]string `json:"matchLabels"`
			} `json:"selector"`
			NamespaceSelector struct {
				MatchNames []string `json:"matchNames"`
			} `json:"namespaceSelector"`
			Endpoints []struct {
				Port            string         `json:"port"`
				Path            string         `json:"path"`
				Scheme          string         `json:"scheme"`
				BearerTokenFile string         `json:"bearerTokenFile"`
				TLSConfig       map[string]any `json:"tlsConfig"`
			} `json:"endpoints"`
		} `json:"spec"`
	}
	type service struct {
		Metadata struct {
			Labels map[string]string `json:"labels"`
		} `json:"metadata"`
		Spec struct {
			Ports []struct {
				Name string `json:"name"`
			} `json:"ports"`
		} `json:"spec"`
	}

	t.Run("no ServiceMonitor by default", func(t *testing.T) {
		_, objs := chart(t, tl, ns)
		if objs.find("ServiceMonitor", deployment) != nil {
			t.Error("the chart renders a ServiceMonitor by default")
		}
	})

	for _, insecure := range []bool{false, true} {
		t.Run(fmt.Sprintf("ServiceMonitor, metrics.insecure=%v", insecure), func(t *testing.T) {
			_, objs := chart(t, tl, ns, "--set", "serviceMonitor.enabled=true", "--set", fmt.Sprintf("metrics.insecure=%v", insecure))
			var sm serviceMonitor
			objs.get(t, "ServiceMonitor", deployment, &sm)
			var svc service
			objs.get(t, "Service", "node-attestation-controller-metrics", &svc)
			for k, v := range sm.Spec.Selector.MatchLabels {
				if svc.Metadata.Labels[k] != v {
					t.Errorf("the ServiceMonitor selects %s=%s, the Service has %q", k, v, svc.Metadata.Labels[k])
				}
			}
			if !slices.Equal(sm.Spec.NamespaceSelector.MatchNames, []string{ns}) {
				t.Errorf("the ServiceMonitor looks in namespaces %v, want %s", sm.Spec.NamespaceSelector.MatchNames, ns)
			}
			if len(sm.Spec.Endpoints) != 1 || len(svc.Spec.Ports) != 1 {
				t.Fatalf("ServiceMonitor endpoints %+v, Service ports %+v", sm.Spec.Endpoints, svc.Spec.Ports)
			}
			ep := sm.Spec.Endpoints[0]
			if ep.Port != svc.Spec.Ports[0].Name || ep.Path != "/metrics" {
				t.Errorf("the ServiceMonitor scrapes port %q path %q, the Service's port is %q", ep.Port, ep.Path, svc.Spec.Ports[0].Name)
			}
			var d deploymentSpec
			objs.get(t, "Deployment", deployment, &d)
			flag := controllerArgs(t, d.Spec.Template.Spec.Containers[0].Args)
			if got := flag("insecure-diagnostics"); got != fmt.Sprint(insecure) {
				t.Errorf("--insecure-diagnostics=%s with metrics.insecure=%v", got, insecure)
			}
			switch {
			case insecure && ep.Scheme != "http":
				t.Errorf("scheme %q over plain HTTP", ep.Scheme)
			case !insecure && (ep.Scheme != "https" || ep.BearerTokenFile == "" || ep.TLSConfig == nil):
				t.Errorf("endpoint %+v: want https with Prometheus' token", ep)
			}
		})
	}

	t.Run("attestorConfig", func(t *testing.T) {
		_, objs := chart(t, tl, ns, "--set-json", `attestorConfig={"aws":{"accounts":["111122223333"],"allowedRoles":["nodes.cluster-api-provider-aws.sigs.k8s.io"]}}`)
		var d deploymentSpec
		objs.get(t, "Deployment", deployment, &d)
		c := d.Spec.Template.Spec.Containers[0]
		path := controllerArgs(t, c.Args)("attestor-config")
		var cmName string
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.ConfigMap != nil && path != "" && filepath.Dir(path) == mountOf(c, v.Name) {
				cmName = v.ConfigMap.Name
			}
		}
		var cm struct {
			Data map[string]string `json:"data"`
		}
		if cmName == "" {
			t.Fatalf("--attestor-config=%q is not in a mounted ConfigMap", path)
		}
		objs.get(t, "ConfigMap", cmName, &cm)
		file := filepath.Join(t.TempDir(), "attestor-config.yaml")
		write(t, file, []byte(cm.Data[filepath.Base(path)]))
		ac, err := app.LoadAttestorConfig(file)
		if err == nil {
			err = ac.Validate()
		}
		if err != nil {
			t.Errorf("the chart's AttestorConfig: %v\n%s", err, cm.Data[filepath.Base(path)])
		}
	})

	t.Run("metrics certificate and readers", func(t *testing.T) {
		_, objs := chart(t, tl, ns, "--set", "metrics.certSecretName=metrics-tls",
			"--set", "metrics.readers[0].kind=ServiceAccount,metrics.readers[0].name=prometheus,metrics.readers[0].namespace=monitoring")
		var d deploymentSpec
		objs.get(t, "Deployment", deployment, &d)
		c := d.Spec.Template.Spec.Containers[0]
		dir := controllerArgs(t, c.Args)("metrics-cert-dir")
		found := false
		for _, v := range d.Spec.Template.Spec.Volumes {
			found = found || (v.Secret != nil && v.Secret.SecretName == "metrics-tls" && mountOf(c, v.Name) == dir)
		}
		if dir == "" || !found {
			t.Errorf("--metrics-cert-dir=%q is not where the Secret metrics-tls is mounted", dir)
		}
		var crb struct {
			RoleRef struct {
				Name string `json:"name"`
			} `json:"roleRef"`
			Subjects []map[string]string `json:"subjects"`
		}
		objs.get(t, "ClusterRoleBinding", "kubelet-authenticator:node-attestation-controller-metrics-reader", &crb)
		want := []map[string]string{{"kind": "ServiceAccount", "name": "prometheus", "namespace": "monitoring"}}
		if crb.RoleRef.Name != "kubelet-authenticator:node-attestation-controller-metrics-reader" || !reflect.DeepEqual(crb.Subjects, want) {
			t.Errorf("metrics reader binding %+v", crb)
		}
	})

	t.Run("standalone", func(t *testing.T) {
		// A TPM boot-state policy, as tpm-boot-policy writes one.
		policyFile := filepath.Join(t.TempDir(), "tpm-policy.yaml")
		policy := fmt.Sprintf("apiVersion: %s\nkind: %s\nrequireSecureBoot: true\n", tpm.PolicyAPIVersion, tpm.PolicyKind)
		write(t, policyFile, []byte(policy))
		_, objs := chart(t, tl, ns, append(append([]string(nil), standaloneValues...),
			"--set", "standalone.caSecret=kubeadm-ca,standalone.servingCASecret=kubelet-serving-ca,standalone.allowlistConfigMap=nodes",
			"--set", "standalone.authorizedAttestors={tpm,aws}",
			"--set-json", `attestorConfig={"aws":{"accounts":["111122223333"],"allowedRoles":["nodes"]}}`,
			"--set", "standalone.lockdown=true,standalone.approveKubeletServing=true,standalone.revocationPeriod=1m",
			"--set-file", "standalone.attestorPolicies.tpm="+policyFile)...)
		var d deploymentSpec
		objs.get(t, "Deployment", deployment, &d)
		args := d.Spec.Template.Spec.Containers[0].Args
		if len(args) == 0 || args[0] != "standalone" {
			t.Fatalf("args %q do not run the standalone command", args)
		}
		flag := controllerArgs(t, args)
		for name, want := range map[string]string{
			"ca-secret":               ns + "/kubeadm-ca",
			"serving-ca-secret":       ns + "/kubelet-serving-ca",
			"allowlist-configmap":     ns + "/nodes",
			"authorized-attestors":    "[tpm,aws]",
			"lockdown":                "true",
			"approve-kubelet-serving": "true",
			"revocation-period":       "1m0s",
			"attestor-config":         "/etc/node-attestation-controller/attestor-config.yaml",
			"attestor-policy":         "[tpm=/etc/node-attestation-controller-policies/tpm.yaml]",
		} {
			if got := flag(name); got != want {
				t.Errorf("--%s=%s, want %s", name, got, want)
			}
		}
		// The policy is the document given, where --attestor-policy reads it.
		c := d.Spec.Template.Spec.Containers[0]
		var policyCM string
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.ConfigMap != nil && mountOf(c, v.Name) == "/etc/node-attestation-controller-policies" {
				policyCM = v.ConfigMap.Name
			}
		}
		var cm struct {
			Data map[string]string `json:"data"`
		}
		if policyCM == "" {
			t.Fatal("no ConfigMap is mounted where --attestor-policy reads")
		}
		objs.get(t, "ConfigMap", policyCM, &cm)
		if got := cm.Data["tpm.yaml"]; got != policy {
			t.Errorf("the mounted policy is %q, want %q", got, policy)
		} else if _, err := tpm.ParsePolicy([]byte(got)); err != nil {
			t.Errorf("the mounted policy: %v", err)
		}
		var role struct {
			Rules []struct {
				Resources     []string `json:"resources"`
				ResourceNames []string `json:"resourceNames"`
			} `json:"rules"`
		}
		objs.get(t, "Role", "node-attestation-controller-standalone", &role)
		granted := false
		for _, r := range role.Rules {
			granted = granted || (slices.Equal(r.Resources, []string{"secrets"}) &&
				slices.Contains(r.ResourceNames, "kubeadm-ca") && slices.Contains(r.ResourceNames, "kubelet-serving-ca"))
		}
		if !granted {
			t.Errorf("the Role does not grant the Secrets the values name: %+v", role.Rules)
		}
		for _, u := range objs {
			if u.GetKind() == "CustomResourceDefinition" || u.GetKind() == "ValidatingAdmissionPolicy" || u.GetName() == "kubelet-authenticator:node-attestation-controller" {
				t.Errorf("standalone mode renders Cluster API mode's %s %s", u.GetKind(), u.GetName())
			}
		}
	})

	t.Run("sharding", func(t *testing.T) {
		argsOf := func(objs objects) []string {
			var d deploymentSpec
			objs.get(t, "Deployment", deployment, &d)
			return d.Spec.Template.Spec.Containers[0].Args
		}
		_, objs := chart(t, tl, ns)
		if args := argsOf(objs); slices.ContainsFunc(args, func(a string) bool {
			return strings.HasPrefix(a, "--sharding") || strings.HasPrefix(a, "--watch-filter")
		}) {
			t.Errorf("the default chart passes %v; want one leader, every Cluster", args)
		}
		if objs.find("Role", "node-attestation-controller-shards") != nil {
			t.Error("the default chart grants the shard Leases")
		}

		_, objs = chart(t, tl, ns, "--set", "sharding.enabled=true,sharding.leaseDuration=20s,watchFilter=fleet-a")
		args := argsOf(objs)
		for _, want := range []string{"--sharding=true", "--shard-lease-duration=20s", "--watch-filter=fleet-a", "--leader-elect=true"} {
			if !slices.Contains(args, want) {
				t.Errorf("sharded chart: args %v lack %s", args, want)
			}
		}
		// The Leases sharding needs, as the kustomize example grants them.
		raw, err := os.ReadFile(filepath.Join(repoRoot(t), "deploy", "examples", "sharding", "shard-rbac.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		example := decode(t, "deploy/examples/sharding/shard-rbac.yaml", raw)
		for _, kind := range []string{"Role", "RoleBinding"} {
			want, got := example.find(kind, "node-attestation-controller-shards"), objs.find(kind, "node-attestation-controller-shards")
			if want == nil || got == nil {
				t.Fatalf("%s node-attestation-controller-shards: example %v, chart %v", kind, want != nil, got != nil)
			}
			for _, field := range []string{"rules", "roleRef"} {
				if !reflect.DeepEqual(want.Object[field], got.Object[field]) {
					t.Errorf("%s %s: chart %v, example %v", kind, field, got.Object[field], want.Object[field])
				}
			}
		}
	})

	t.Run("combinations that cannot work", func(t *testing.T) {
		for _, c := range []struct {
			name  string
			flags []string
			// want is what the message must say: the value to change.
			want string
		}{
			{"unknown mode", []string{"--set", "mode=clusterapi"}, "/mode"},
			{"a name with a namespace", []string{"--set", "mode=standalone,standalone.caSecret=kube-system/ca"}, "standalone.caSecret"},
			{"the serving CA in the client CA's Secret", []string{"--set", "mode=standalone,standalone.servingCASecret=cluster-ca"}, "standalone.servingCASecret must differ from standalone.caSecret"},
			{"a cloud attestor without configuration", []string{"--set", "mode=standalone,standalone.authorizedAttestors={tpm,gcp}"}, "attestorConfig.gcp"},
			{"no attestor", []string{"--set", "mode=standalone,standalone.authorizedAttestors=null"}, "authorizedAttestors"},
			{"an unknown attestor", []string{"--set", "mode=standalone,standalone.authorizedAttestors={tmp}"}, "/standalone/authorizedAttestors/0"},
			{"a misspelt standalone value", []string{"--set", "mode=standalone,standalone.lockdwon=true"}, "lockdwon"},
			{"lockdown in Cluster API mode", []string{"--set", "standalone.lockdown=true"}, "apply only with mode: standalone"},
			{"a policy in Cluster API mode", []string{"--set", "standalone.attestorPolicies.tpm=x"}, "apply only with mode: standalone"},
			{"a policy of an attestor not authorized", []string{"--set", "mode=standalone,standalone.attestorPolicies.aws=x"}, "standalone.attestorPolicies.aws"},
			{"sharding in standalone mode", []string{"--set", "mode=standalone,sharding.enabled=true"}, "apply only with mode: capi"},
			{"a watch filter that is no label value", []string{"--set", "watchFilter=a/b"}, "/watchFilter"},
		} {
			t.Run(c.name, func(t *testing.T) {
				args := append([]string{"template", "kubelet-authenticator", filepath.Join(repoRoot(t), "deploy", "helm", "kubelet-authenticator"), "--namespace", ns}, c.flags...)
				out, err := exec.Command(tl.helm, args...).CombinedOutput()
				if err == nil {
					t.Fatalf("helm template %s renders; want it refused", strings.Join(c.flags, " "))
				}
				if !strings.Contains(string(out), c.want) {
					t.Errorf("helm template %s fails without naming %q:\n%s", strings.Join(c.flags, " "), c.want, out)
				}
			})
		}
	})
}
