package config

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor/aws"
	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
)

func writeConfig(t *testing.T, doc string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestProviderSectionsMatchTable keeps the node configuration schema and
// the provider table in step: every release provider's node section is a
// field of NodeConfig of the provider's node configuration type, and that
// is what the agent hands its constructor.
func TestProviderSectionsMatchTable(t *testing.T) {
	c, err := Load(writeConfig(t, "tpm:\n  device: /dev/tpm0\n  pcrs: [7]\naws:\n  imdsEndpoint: http://127.0.0.1:1\n"))
	if err != nil {
		t.Fatal(err)
	}
	typ := reflect.TypeOf(NodeConfig{})
	for _, d := range providers.All() {
		if d.TestOnly || d.NodeSection == "" {
			continue
		}
		want := reflect.TypeOf(d.NewNodeConfig()).Elem()
		found := false
		for i := 0; i < typ.NumField(); i++ {
			f := typ.Field(i)
			if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); name == d.NodeSection {
				found = true
				if f.Type != want {
					t.Errorf("%s: NodeConfig.%s is %s, the table says %s", d.Name, f.Name, f.Type, want)
				}
			}
		}
		if !found {
			t.Errorf("%s: NodeConfig has no %q section", d.Name, d.NodeSection)
		}
		if _, err := c.ProviderSection(d); err != nil {
			t.Errorf("%s: %v", d.Name, err)
		}
	}
	d, _ := providers.Lookup(tpm.Name)
	s, err := c.ProviderSection(d)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := s.(tpm.NodeConfig); !ok || got.Device != "/dev/tpm0" || !reflect.DeepEqual(got.PCRs, []int{7}) {
		t.Errorf("tpm section = %#v", s)
	}
	d, _ = providers.Lookup(aws.Name)
	if s, _ := c.ProviderSection(d); s.(aws.AttestorConfig) != c.AWS {
		t.Errorf("aws section = %#v, want %#v", s, c.AWS)
	}
}

// TestLoadIsStrict: unknown fields and duplicate keys are refused, in
// release and test builds alike.
func TestLoadIsStrict(t *testing.T) {
	for doc, want := range map[string]string{
		"tpm:\n  devise: /dev/tpm0\n":       `unknown field "devise"`,
		"cacheDir: /a\ncacheDir: /b\n":      `key "cacheDir" already set`,
		"attestor: tpm\nbogusSection: {}\n": `unknown field "bogusSection"`,
	} {
		_, err := Load(writeConfig(t, doc))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: err = %v, want it to mention %s", doc, err, want)
		}
	}
}

// TestValidateChecksTheTPMSection: the tpm section is checked by the TPM
// attestor's own constructor when the configuration is validated, without
// opening a TPM.
func TestValidateChecksTheTPMSection(t *testing.T) {
	c, err := Load(writeConfig(t, "nodeName: n1\ncacheDir: /var/lib/ka\ntpm:\n  device: /nonexistent/tpm\n  pcrBank: md5\n  pcrs: [24]\n"))
	if err != nil {
		t.Fatal(err)
	}
	c.Default()
	err = c.Validate()
	for _, want := range []string{`tpm: unknown PCR bank "md5"`, "tpm: PCR 24 is out of range"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error does not report %q: %v", want, err)
		}
	}
	c.TPM.PCRBank, c.TPM.PCRs = "", nil
	if err := c.Validate(); err != nil {
		t.Errorf("valid tpm section (device not opened): %v", err)
	}
}
