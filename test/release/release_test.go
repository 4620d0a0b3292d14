// Package release checks what release builds contain: the node binary and
// the controller built without build tags (as `make build` builds them) link
// neither the null rubber-stamp attestor nor, for the node, the in-process
// TPM simulator; the test builds (scenario.BinaryTags) link both, which shows
// that the checks can see them. It also keeps the node binary lean: every
// package it links is initialised on every exec credential call, so it must
// not link client-go's clientset, informers, dynamic or discovery clients.
package release

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

const (
	nullPkg      = "sigs.k8s.io/kubelet-authenticator/attestor/null"
	simulatorPkg = "github.com/google/go-tpm-tools/simulator"
	tpmsimPkg    = "sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
)

// binary is one command as `make build` builds it.
type binary struct {
	name, pkg string
	env       []string
	// testOnly are the test-only packages that a test build of the command
	// links and a release build must not.
	testOnly []string
	// heavy are packages no build of the command may link.
	heavy []string
}

// nodeHeavy are what made the node binary's start-up cost several times a
// minimal Go program's: client-go's clientset (its scheme registers every
// API group), informers, the dynamic and discovery clients (OpenAPI,
// protobuf descriptors).
var nodeHeavy = []string{
	"k8s.io/client-go/kubernetes",
	"k8s.io/client-go/kubernetes/scheme",
	"k8s.io/client-go/informers",
	"k8s.io/client-go/dynamic",
	"k8s.io/client-go/discovery",
}

var binaries = []binary{
	{"kubelet-authenticator", "./cmd/kubelet-authenticator", nil, []string{nullPkg, simulatorPkg, tpmsimPkg}, nodeHeavy},
	{"node-attestation-controller", "./cmd/node-attestation-controller", []string{"CGO_ENABLED=0"}, []string{nullPkg}, nil},
}

// TestReleaseBuildsExcludeTestOnlyCode builds each command without tags and
// with the test tags and checks, both in the package graph (go list -deps)
// and in the linked binary (function names, which stripped Go binaries
// keep, and the build settings go version -m reports), that the test-only
// packages are absent from the release build and present in the test one.
func TestReleaseBuildsExcludeTestOnlyCode(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binaries")
	}
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, b := range binaries {
		for _, build := range []struct {
			kind string
			tags string
		}{{"release", ""}, {"test", scenario.BinaryTags}} {
			release := build.tags == ""
			t.Run(b.name+"/"+build.kind, func(t *testing.T) {
				deps := goList(t, root, b, build.tags)
				for _, pkg := range b.heavy {
					if slices.Contains(deps, pkg) {
						t.Errorf("the %s build of %s links %s", build.kind, b.name, pkg)
					}
				}
				// -s -w as make build links; -trimpath is left out (it
				// changes file names, not which packages are linked) so
				// that the build cache of the other tests is reused.
				out := filepath.Join(dir, b.name+"-"+build.kind)
				run(t, root, b.env, "go", "build", "-tags", build.tags, "-ldflags=-s -w", "-o", out, b.pkg)
				bin, err := os.ReadFile(out)
				if err != nil {
					t.Fatal(err)
				}
				for _, pkg := range b.testOnly {
					inDeps := slices.ContainsFunc(deps, func(d string) bool { return d == pkg || strings.HasPrefix(d, pkg+"/") })
					// Function names in the binary: "<pkg>.Func" or "<pkg>.(*T).M".
					inBinary := bytes.Contains(bin, []byte(pkg+"."))
					switch {
					case release && inDeps:
						t.Errorf("the release build of %s depends on %s", b.name, pkg)
					case release && inBinary:
						t.Errorf("the release binary %s contains code of %s", b.name, pkg)
					case !release && (!inDeps || !inBinary):
						t.Errorf("the test build of %s (tags %q) does not link %s (go list: %v, binary: %v): the check cannot see it", b.name, build.tags, pkg, inDeps, inBinary)
					}
				}
				settings := run(t, root, nil, "go", "version", "-m", out)
				if release && strings.Contains(settings, "-tags=") {
					t.Errorf("the release binary %s was built with tags:\n%s", b.name, settings)
				}
				if !release && !strings.Contains(settings, "-tags="+strings.ReplaceAll(build.tags, " ", ",")) {
					t.Errorf("go version -m does not report the test tags of %s:\n%s", b.name, settings)
				}
			})
		}
	}
}

func goList(t *testing.T, root string, b binary, tags string) []string {
	t.Helper()
	return strings.Fields(run(t, root, b.env, "go", "list", "-tags", tags, "-deps", b.pkg))
}

func run(t *testing.T, dir string, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String()
}
