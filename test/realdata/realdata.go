// Package realdata locates the real attestation samples (EK certificates,
// manufacturer CAs, cloud-signed identity documents) that verifier tests run
// against: they show the verifiers accept what real hardware and real
// providers produce.
//
// The samples whose source license allows it are in testdata/ (see
// testdata/PROVENANCE.md). The rest are restricted: they are read from the
// directory named by KA_REALDATA, in the same layout, and a test that needs
// one is skipped with a line naming that variable when it is not set, or
// fails when KA_REALDATA_REQUIRED=1 (as .ci/run sets it).
package realdata

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// EnvDir names the directory of the restricted samples; EnvRequired, set to
// 1, turns their absence from a skip into a failure.
const (
	EnvDir      = "KA_REALDATA"
	EnvRequired = "KA_REALDATA_REQUIRED"
)

// restricted are the samples whose source repositories' licenses do not
// let them into this repository (AGPL-3.0, MPL-2.0, no license at all):
// these files, and every Azure attested document (restrictedPrefix).
var restricted = map[string]bool{
	"tpm-ek/amd-ftpm-ryzen5-5600x-prg-rn-ek.pem":      true,
	"tpm-ek/amd-ftpm-ryzen5-5600x-prg-rn-ek.der":      true,
	"tpm-ca/dltf-amd-AMDTPM-root.pem":                 true,
	"tpm-ca/dltf-amd-PRG-RN-intermediate.pem":         true,
	"azure/baltimore-cybertrust-root.pem":             true,
	"azure/microsoft-azure-rsa-tls-issuing-ca-08.pem": true,
	"azure/microsoft-azure-tls-issuing-ca-05.pem":     true,
	"azure/microsoft-rsa-tls-ca-01.pem":               true,
	"azure/microsoft-tls-g2-rsa-ca-ocsp-02.pem":       true,
}

const restrictedPrefix = "azure/imds-attested-"

func isRestricted(rel string) bool {
	return restricted[rel] || strings.HasPrefix(rel, restrictedPrefix)
}

// Path returns the sample at elem (e.g. "tpm-ek", "stm-st33htph-rsa-ek.pem").
// A sample kept in the repository must be there: its absence fails the
// test. A restricted one comes from KA_REALDATA; without it the test is
// skipped (or fails, under KA_REALDATA_REQUIRED=1).
func Path(tb testing.TB, elem ...string) string {
	tb.Helper()
	rel := filepath.ToSlash(filepath.Join(elem...))
	if !isRestricted(rel) {
		p := filepath.Join(fixtures(tb), rel)
		if _, err := os.Stat(p); err != nil {
			tb.Fatalf("real test data missing from the repository: %v", err)
		}
		return p
	}
	p, err := restrictedPath(rel)
	if err == nil {
		return p
	}
	if os.Getenv(EnvRequired) == "1" {
		tb.Fatalf("restricted real test data %s: %v (%s=1)", rel, err, EnvRequired)
	}
	tb.Skipf("restricted real test data %s not available (%v): set %s to a directory that holds it", rel, err, EnvDir)
	return ""
}

// Available reports where the sample at elem can be read, and whether it
// can: for tests where a restricted sample adds to what is checked (a CA in
// a pool) but the rest stands without it. Under KA_REALDATA_REQUIRED=1 a
// missing restricted sample fails the test.
func Available(tb testing.TB, elem ...string) (string, bool) {
	tb.Helper()
	rel := filepath.ToSlash(filepath.Join(elem...))
	if !isRestricted(rel) {
		return Path(tb, elem...), true
	}
	p, err := restrictedPath(rel)
	if err != nil {
		if os.Getenv(EnvRequired) == "1" {
			tb.Fatalf("restricted real test data %s: %v (%s=1)", rel, err, EnvRequired)
		}
		return "", false
	}
	return p, true
}

func restrictedPath(rel string) (string, error) {
	dir := os.Getenv(EnvDir)
	if dir == "" {
		return "", os.ErrNotExist
	}
	p := filepath.Join(dir, filepath.FromSlash(rel))
	if _, err := os.Stat(p); err != nil {
		return "", err
	}
	return p, nil
}

// fixtures is this package's testdata directory, wherever the test runs.
func fixtures(tb testing.TB) string {
	tb.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		tb.Fatal("unable to locate the real test data: no caller information")
	}
	return filepath.Join(filepath.Dir(file), "testdata")
}
