// Package configexamples checks that every attestor configuration example
// the project ships starts: each AttestorConfig in deploy/ (YAML files) and
// in docs/ (```yaml blocks) is parsed strictly and each provider section is
// built into its verifier with the provider's own constructor, exactly as
// the controller does at start. An example that names a file that does not
// exist, lacks a required field, or carries a field the code no longer
// knows fails here rather than in an operator's cluster.
package configexamples

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor/aws"
	"sigs.k8s.io/kubelet-authenticator/attestor/azure"
	"sigs.k8s.io/kubelet-authenticator/attestor/gcp"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// load parses and validates an example the way the controller does its
// --attestor-config file: app.LoadAttestorConfig (strict YAML) and
// Validate.
func load(data []byte) (*app.AttestorConfig, error) {
	f, err := os.CreateTemp("", "attestor-config-*.yaml")
	if err != nil {
		return nil, err
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(data); err != nil {
		return nil, err
	}
	if err := f.Close(); err != nil {
		return nil, err
	}
	c, err := app.LoadAttestorConfig(f.Name())
	if err != nil {
		return nil, err
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// start builds every configured verifier, as the controller does at start.
func start(c *app.AttestorConfig) error {
	if c.AWS != nil {
		if _, err := aws.NewVerifier(*c.AWS); err != nil {
			return fmt.Errorf("aws: %w", err)
		}
	}
	if c.Azure != nil {
		if _, err := azure.NewVerifier(*c.Azure); err != nil {
			return fmt.Errorf("azure: %w", err)
		}
	}
	if c.GCP != nil {
		if _, err := gcp.NewVerifier(*c.GCP); err != nil {
			return fmt.Errorf("gcp: %w", err)
		}
	}
	return nil
}

type example struct {
	where string
	data  []byte
}

var (
	fence       = regexp.MustCompile("(?ms)^```ya?ml\\s*\\n(.*?)^```")
	kindAttConf = regexp.MustCompile(`(?m)^kind:\s*AttestorConfig\s*$`)
)

// examples finds every AttestorConfig in deploy/ and docs/.
func examples(t *testing.T) []example {
	t.Helper()
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	var out []example
	for _, dir := range []string{"deploy", "docs"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			rel, _ := filepath.Rel(root, p)
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			switch filepath.Ext(p) {
			case ".yaml", ".yml":
				for i, doc := range bytes.Split(data, []byte("\n---")) {
					if kindAttConf.Match(doc) {
						out = append(out, example{fmt.Sprintf("%s (document %d)", rel, i+1), doc})
					}
				}
			case ".md":
				for _, m := range fence.FindAllSubmatchIndex(data, -1) {
					block := data[m[2]:m[3]]
					if kindAttConf.Match(block) {
						line := 1 + bytes.Count(data[:m[2]], []byte("\n"))
						out = append(out, example{fmt.Sprintf("%s:%d", rel, line), block})
					}
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// TestEveryAttestorConfigExampleStarts (issue 13.6).
func TestEveryAttestorConfigExampleStarts(t *testing.T) {
	exs := examples(t)
	// deploy/examples/attestor-config and the aws, azure and gcp pages at
	// least: fewer means the scan is broken.
	if len(exs) < 4 {
		t.Fatalf("found only %d AttestorConfig examples: %v", len(exs), exs)
	}
	for _, ex := range exs {
		t.Run(ex.where, func(t *testing.T) {
			c, err := load(ex.data)
			if err != nil {
				t.Fatalf("%s does not parse as the controller parses --attestor-config: %v", ex.where, err)
			}
			if err := start(c); err != nil {
				t.Fatalf("%s does not start: %v", ex.where, err)
			}
		})
	}
}

// TestTheCheckCanFail: an example like the ones shipped before issue 13.6
// (AWS without certificates or allowedRoles, Azure with files nobody ships)
// is refused, so the test above is not vacuous.
func TestTheCheckCanFail(t *testing.T) {
	for _, bad := range []string{
		"apiVersion: kubelet-authenticator.x-k8s.io/v1alpha1\nkind: AttestorConfig\naws:\n  accounts: [\"111122223333\"]\n",
		"apiVersion: kubelet-authenticator.x-k8s.io/v1alpha1\nkind: AttestorConfig\nazure:\n  roots: [/etc/node-attestation-controller/azure/roots.pem]\n  subscriptions: [s]\n",
		"apiVersion: kubelet-authenticator.x-k8s.io/v1alpha1\nkind: AttestorConfig\ngcp:\n  projects: [p]\n  jwks:\n    tls:\n      trustedCA:\n        file: /nonexistent/ca.pem\n",
		"apiVersion: kubelet-authenticator.x-k8s.io/v1alpha1\nkind: AttestorConfig\ngcp:\n  projects: [p]\n  projectz: [q]\n",
	} {
		c, err := load([]byte(bad))
		if err == nil {
			err = start(c)
		}
		if err == nil {
			t.Errorf("example accepted:\n%s", bad)
		}
	}
}
