package images_test

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
)

// configFields lists the JSON field paths of a configuration type, dotted
// for nested objects (tpm.device).
func configFields(t reflect.Type, prefix string) []string {
	var out []string
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			continue
		}
		path := prefix + name
		out = append(out, path)
		ft := f.Type
		for ft.Kind() == reflect.Pointer || ft.Kind() == reflect.Slice {
			ft = ft.Elem()
		}
		// Types of this module's packages (a provider's node
		// configuration) are part of the schema; those of other packages
		// (metav1.LabelSelector) are documented where they come from.
		if ft.Kind() == reflect.Struct && strings.HasPrefix(ft.PkgPath(), module+"/") && ft != reflect.TypeOf(config.Duration{}) {
			out = append(out, configFields(ft, path+".")...)
		}
	}
	return out
}

const module = "sigs.k8s.io/kubelet-authenticator"

var docField = regexp.MustCompile("(?m)^\\| `([A-Za-z.]+)` \\|(.*)$")

// testBuildsOnly marks a documented section only test builds have (their
// schemas add it; a release build refuses it as unknown).
const testBuildsOnly = "builds only"

// TestNodeConfigurationReference keeps docs/node-configuration.md in step with
// the NodeConfig type: every field documented, nothing documented that is not
// a field.
func TestNodeConfigurationReference(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "docs", "node-configuration.md"))
	if err != nil {
		t.Fatal(err)
	}
	var documented, testSections []string
	for _, m := range docField.FindAllStringSubmatch(string(data), -1) {
		documented = append(documented, m[1])
		if strings.Contains(m[2], testBuildsOnly) {
			testSections = append(testSections, m[1])
		}
	}
	if len(testSections) == 0 {
		t.Errorf("docs/node-configuration.md marks no section %q", testBuildsOnly)
	}
	inTestSection := func(f string) bool {
		return slices.ContainsFunc(testSections, func(s string) bool { return f == s || strings.HasPrefix(f, s+".") })
	}
	fields := configFields(reflect.TypeOf(config.NodeConfig{}), "")
	for _, f := range fields {
		if !slices.Contains(documented, f) {
			t.Errorf("field %s of NodeConfig is not in docs/node-configuration.md", f)
		}
		if inTestSection(f) {
			t.Errorf("docs/node-configuration.md says %s is in test builds only, but the release schema has it", f)
		}
	}
	// Test-only providers' sections, where this build has them.
	for _, d := range providers.All() {
		if !d.TestOnly || d.NewNodeConfig == nil {
			continue
		}
		for _, f := range append([]string{d.NodeSection}, configFields(reflect.TypeOf(d.NewNodeConfig()).Elem(), d.NodeSection+".")...) {
			if !slices.Contains(documented, f) || !inTestSection(f) {
				t.Errorf("field %s of test-only provider %q is not in docs/node-configuration.md as %q", f, d.Name, testBuildsOnly)
			}
		}
	}
	for _, d := range documented {
		if !slices.Contains(fields, d) && !inTestSection(d) {
			t.Errorf("docs/node-configuration.md documents %s, which NodeConfig does not have", d)
		}
	}
	// Defaults the page states.
	for _, want := range []string{config.DefaultPath, config.DefaultCacheDir, config.DefaultBootstrapKubeconfig, config.DefaultRequestTimeout.String(), config.APIVersion} {
		if want == "5m0s" {
			want = "5m"
		}
		if !strings.Contains(string(data), want) {
			t.Errorf("docs/node-configuration.md does not mention %s", want)
		}
	}
	// The example parses as a NodeConfig.
	example := regexp.MustCompile("(?s)```yaml\n(.*?)```").FindStringSubmatch(string(data))
	if example == nil {
		t.Fatal("no YAML example")
	}
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte(example[1]), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := config.Load(path)
	if err != nil {
		t.Fatalf("the example does not load: %v", err)
	}
	c.Default()
	if err := c.Validate(); err != nil {
		t.Errorf("the example does not validate: %v", err)
	}
}
