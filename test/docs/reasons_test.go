// Package docs checks that the documentation keeps up with the code.
package docs

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

var (
	reasonConst = regexp.MustCompile(`\bReason\w*\s*=\s*"([A-Z][A-Za-z]+)"`)
	denyCall    = regexp.MustCompile(`\.Deny\("([A-Z][A-Za-z]+)"`)
)

// approvals are reasons of approvals, not denials.
var approvals = map[string]bool{"AttestationVerified": true, "ServingAddressesVerified": true, "AttestedServingVerified": true, "AttestedNode": true}

// TestEveryDenialReasonIsDocumented: an operator who meets a denial reason
// finds it, and what to do about it, in docs/troubleshooting.md.
func TestEveryDenialReasonIsDocumented(t *testing.T) {
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "troubleshooting.md"))
	if err != nil {
		t.Fatal(err)
	}
	found := map[string]string{}
	for _, dir := range []string{"signer", "attestor"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			src, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for _, re := range []*regexp.Regexp{reasonConst, denyCall} {
				for _, m := range re.FindAllSubmatch(src, -1) {
					found[string(m[1])] = path
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(found) < 40 {
		t.Fatalf("found only %d reasons; the scan is broken", len(found))
	}
	for reason, path := range found {
		if approvals[reason] {
			continue
		}
		if !strings.Contains(string(doc), "`"+reason+"`") {
			t.Errorf("denial reason %s (%s) is not in docs/troubleshooting.md", reason, path)
		}
	}
}
