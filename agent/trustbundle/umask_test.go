package trustbundle

import (
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestWriterModesUnderUmask077: the agent's unit runs with UMask=0077, and
// the bundle is for consumers running as other users, so the projection's
// directories and file must come out 0755 and 0644 whatever the umask; an
// earlier write that left them private is repaired even when the content
// does not change.
func TestWriterModesUnderUmask077(t *testing.T) {
	old := syscall.Umask(0o077)
	t.Cleanup(func() { syscall.Umask(old) })

	root := t.TempDir()
	if err := os.Chmod(root, 0o755); err != nil {
		t.Fatal(err)
	}
	w := NewWriter(filepath.Join(root, "trust-bundles", "cluster", "ca.crt"))
	data := []byte(newCAPEM(t, "a"))
	if _, err := w.Write(data); err != nil {
		t.Fatal(err)
	}
	checkModes := func(t *testing.T) {
		t.Helper()
		for path, want := range map[string]fs.FileMode{
			filepath.Join(root, "trust-bundles"):      DirMode,
			w.Dir:                                     DirMode,
			filepath.Join(w.Dir, DataDirName):         DirMode,
			filepath.Join(w.Dir, DataDirName, w.File): FileMode,
			w.Path(): FileMode,
		} {
			fi, err := os.Stat(path)
			if err != nil {
				t.Fatal(err)
			}
			if got := fi.Mode().Perm(); got != want {
				t.Errorf("%s: mode %o, want %o", path, got, want)
			}
		}
	}
	checkModes(t)

	// As an older agent left them: private directory, data and file.
	target, err := os.Readlink(filepath.Join(w.Dir, DataDirName))
	if err != nil {
		t.Fatal(err)
	}
	for path, mode := range map[string]fs.FileMode{
		w.Dir:                                0o700,
		filepath.Join(w.Dir, target):         0o700,
		filepath.Join(w.Dir, target, w.File): 0o600,
	} {
		if err := os.Chmod(path, mode); err != nil {
			t.Fatal(err)
		}
	}
	changed, err := w.Write(data)
	if err != nil {
		t.Fatal(err)
	}
	if changed {
		t.Error("unchanged content rewritten")
	}
	checkModes(t)
}

// TestWriterKeepsAnOperatorsDirectoryMode: a projection directory the
// operator made, with a mode of their choosing, keeps it; only the agent's
// own private 0700 is opened to consumers.
func TestWriterKeepsAnOperatorsDirectoryMode(t *testing.T) {
	for _, mode := range []fs.FileMode{0o750, fs.ModeSticky | 0o777, 0o711} {
		dir := filepath.Join(t.TempDir(), "bundles")
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(dir, mode); err != nil {
			t.Fatal(err)
		}
		w := &Writer{Dir: dir, File: "ca.crt"}
		for range 2 { // a write, then an unchanged one
			if _, err := w.Write([]byte("bundle\n")); err != nil {
				t.Fatal(err)
			}
		}
		fi, err := os.Stat(dir)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode() & (fs.ModePerm | fs.ModeSticky); got != mode {
			t.Errorf("directory of mode %o is now %o", mode, got)
		}
	}
}
