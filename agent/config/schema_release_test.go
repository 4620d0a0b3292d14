//go:build !testattestors && !tpmsimulator

package config

import (
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
)

// TestReleaseSchemaRefusesTestSections: a release build's configuration
// schema does not know the test builds' sections; a node configuration
// that carries them is refused, naming the field.
func TestReleaseSchemaRefusesTestSections(t *testing.T) {
	for doc, field := range map[string]string{
		"attestor: \"null\"\nnullAttestor:\n  versions: [v1]\n":                             "nullAttestor",
		"tpm:\n  device: simulator\n  simulator:\n    seed: 1\n    manufacturerCADir: /x\n": "simulator",
	} {
		_, err := Load(writeConfig(t, doc))
		if err == nil || !strings.Contains(err.Error(), `unknown field "`+field+`"`) {
			t.Errorf("%q: err = %v, want unknown field %q", doc, err, field)
		}
	}
	if want := "aws azure gcp insecure tpm"; strings.Join(providers.Names(), " ") != want {
		t.Errorf("release providers = %v, want %s", providers.Names(), want)
	}
}
