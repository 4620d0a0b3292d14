package app

import (
	"reflect"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
)

// TestAttestorConfigSectionsMatchTable keeps the controller's
// AttestorConfig schema and the provider table in step: every provider
// configured by the file has a section of its verifier configuration type,
// and every section belongs to a provider.
func TestAttestorConfigSectionsMatchTable(t *testing.T) {
	typ := reflect.TypeOf(AttestorConfig{})
	sections := map[string]reflect.Type{}
	for i := 0; i < typ.NumField(); i++ {
		f := typ.Field(i)
		if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); name != "apiVersion" && name != "kind" {
			sections[name] = f.Type
		}
	}
	for _, d := range providers.All() {
		if d.VerifierSection == "" {
			continue
		}
		want := reflect.TypeOf(d.NewVerifierConfig())
		if got, ok := sections[d.VerifierSection]; !ok || got != want {
			t.Errorf("%s: AttestorConfig section %q is %v, the table says %v", d.Name, d.VerifierSection, got, want)
		}
		delete(sections, d.VerifierSection)
	}
	for name := range sections {
		t.Errorf("AttestorConfig section %q belongs to no provider", name)
	}
}
