package scenario

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestRemoveStaleBinaries: the binaries' directories of test processes
// that ended are removed, those of running ones kept, whatever else is in
// the temporary directory left alone.
func TestRemoveStaleBinaries(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	ended := exec.Command("true")
	if err := ended.Run(); err != nil {
		t.Fatal(err)
	}
	dirs := map[string]bool{ // name: kept
		fmt.Sprintf("ka-bin-%d-1", os.Getpid()):       true,
		fmt.Sprintf("ka-bin-%d-2", ended.Process.Pid): false,
		"ka-bin-3202805558":                           true,  // unnumbered, new
		"ka-bin-4106831892":                           false, // unnumbered, two days old
		"ka-bin-notapid-3":                            true,
		"other-1":                                     true,
	}
	for name := range dirs {
		if err := os.Mkdir(filepath.Join(tmp, name), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(tmp, name, "kubelet-authenticator"), []byte("x"), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-48 * time.Hour)
	if err := os.Chtimes(filepath.Join(tmp, "ka-bin-4106831892"), old, old); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", ended.Process.Pid)); err == nil {
		t.Skipf("process ID %d was reused at once", ended.Process.Pid)
	}
	removeStaleBinaries(t)
	for name, kept := range dirs {
		_, err := os.Stat(filepath.Join(tmp, name))
		if got := err == nil; got != kept {
			t.Errorf("%s kept: %v, want %v", name, got, kept)
		}
	}
}
