package scenario

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// NodeBinaryAt builds the node binary kubelet-authenticator as it was at
// commit of this repository's history (git archive into a temporary
// directory, go build with the test build tags BinaryTags and the same
// module cache), for version-skew tests against an older release. The
// binary is kept under the user cache directory, keyed by commit, so a
// rerun does not build it again. A clone without that commit (a shallow
// clone) fails the test with one line saying so.
func NodeBinaryAt(tb testing.TB, commit string) string {
	tb.Helper()
	cacheDir, err := os.UserCacheDir()
	if err != nil {
		tb.Fatal(err)
	}
	dir := filepath.Join(cacheDir, "kubelet-authenticator", "node-binary-at", commit+"-"+strings.ReplaceAll(BinaryTags, " ", ","))
	bin := filepath.Join(dir, nodeBinaryName)
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	root, err := harness.RepoRoot()
	if err != nil {
		tb.Fatal(err)
	}
	if err := exec.Command("git", "-C", root, "cat-file", "-e", commit+"^{commit}").Run(); err != nil {
		tb.Fatalf("commit %s is not in this clone's history (a shallow clone?): "+
			"fetch the full history (git fetch --unshallow) to build the node binary of that release",
			commit)
	}
	archive, err := exec.Command("git", "-C", root, "archive", "--format=tar", commit).Output()
	if err != nil {
		tb.Fatalf("git archive %s: %v", commit, err)
	}
	src := tb.TempDir()
	if err := untar(bytes.NewReader(archive), src); err != nil {
		tb.Fatalf("unable to unpack %s: %v", commit, err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		tb.Fatal(err)
	}
	tmp, err := os.MkdirTemp(dir, "build-")
	if err != nil {
		tb.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	cmd := exec.Command("go", "build", "-tags", BinaryTags, "-o", filepath.Join(tmp, nodeBinaryName), "./cmd/kubelet-authenticator")
	cmd.Dir = src
	if out, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("unable to build the node binary at %s: %v\n%s", commit, err, out)
	}
	// Rename: a concurrent or interrupted build never leaves half a binary.
	if err := os.Rename(filepath.Join(tmp, nodeBinaryName), bin); err != nil {
		tb.Fatal(err)
	}
	return bin
}

// untar writes the regular files and directories of a git archive into dir.
func untar(r io.Reader, dir string) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		name := filepath.Join(dir, filepath.FromSlash(h.Name))
		if !strings.HasPrefix(name, dir+string(filepath.Separator)) {
			continue // nothing outside dir
		}
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(name, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
				return err
			}
			f, err := os.OpenFile(name, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, os.FileMode(h.Mode)&0o755|0o600)
			if err != nil {
				return err
			}
			_, err = io.Copy(f, tr)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
		case tar.TypeSymlink:
			if err := os.Symlink(h.Linkname, name); err != nil {
				return err
			}
		}
	}
}
