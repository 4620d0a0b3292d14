// Package realdata locates the real attestation samples (EK certificates,
// manufacturer CAs, cloud-signed identity documents) that verifier tests
// run against. They are read at run time from the shared folder next to the
// repository and never copied into it. Their absence fails a test: these
// tests are what shows the verifiers accept what real hardware and real
// providers produce.
package realdata

import (
	"os"
	"path/filepath"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// Dir returns the realdata directory: $KA_REALDATA if set, else
// ../shared/realdata next to the repository, else /work/shared/realdata
// (where this workplace keeps it for checkouts elsewhere).
func Dir(tb testing.TB) string {
	tb.Helper()
	var candidates []string
	if d := os.Getenv("KA_REALDATA"); d != "" {
		candidates = append(candidates, d)
	}
	if root, err := harness.RepoRoot(); err == nil {
		candidates = append(candidates, filepath.Join(root, "..", "shared", "realdata"))
	}
	candidates = append(candidates, "/work/shared/realdata")
	for _, d := range candidates {
		if _, err := os.Stat(filepath.Join(d, "MANIFEST.md")); err == nil {
			return d
		}
	}
	tb.Fatalf("real test data not found (looked in %v; set KA_REALDATA): it must be present, these tests are never skipped", candidates)
	return ""
}

// Path returns a file under Dir, failing the test if it is missing.
func Path(tb testing.TB, elem ...string) string {
	tb.Helper()
	p := filepath.Join(append([]string{Dir(tb)}, elem...)...)
	if _, err := os.Stat(p); err != nil {
		tb.Fatalf("real test data missing (it must be present, never skipped): %v", err)
	}
	return p
}
