//go:build testattestors

package config

import (
	"os"
	"os/exec"
	"reflect"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor/null"
	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
)

// TestTestSectionsEnterAsExtensions: in a test build the null attestor's
// section is decoded, strictly, into its own configuration type through
// the provider table.
func TestTestSectionsEnterAsExtensions(t *testing.T) {
	d, ok := providers.Lookup(null.Name)
	if !ok || !d.TestOnly {
		t.Fatalf("test build has no test-only null provider: %+v", d)
	}
	c, err := Load(writeConfig(t, "attestor: \"null\"\nnullAttestor:\n  versions: [v2, v1]\n  stable: id-1\n"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.ProviderSection(d)
	if err != nil {
		t.Fatal(err)
	}
	if got := s.(*null.Config); !reflect.DeepEqual(*got, null.Config{Versions: []string{"v2", "v1"}, Stable: "id-1"}) {
		t.Errorf("nullAttestor = %+v", *got)
	}
	c, err = Load(writeConfig(t, "attestor: \"null\"\nnullAttestor:\n  version: [v1]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.ProviderSection(d); err == nil || !strings.Contains(err.Error(), `unknown field "version"`) {
		t.Errorf("misspelt nullAttestor field: %v", err)
	}
	c.NodeName, c.CacheDir = "n1", "/var/lib/ka"
	c.Default()
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), `null: nullAttestor: json: unknown field "version"`) {
		t.Errorf("Validate of a misspelt nullAttestor field: %v", err)
	}
}

// TestReleaseBuildRefusesTestSections runs the release build's schema
// test (schema_release_test.go) in a build without test tags, so a tagged
// test run covers it too.
func TestReleaseBuildRefusesTestSections(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the package without tags")
	}
	cmd := exec.Command("go", "test", "-count=1", "-run", "^TestReleaseSchemaRefusesTestSections$", "-v", ".")
	cmd.Env = append(os.Environ(), "GOFLAGS=")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestReleaseSchemaRefusesTestSections") {
		t.Fatalf("release build: %v\n%s", err, out)
	}
}
