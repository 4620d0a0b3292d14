package trustbundle

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"k8s.io/utils/clock"
)

// Names inside a projection directory, as kubelet's AtomicWriter uses them.
const (
	// DataDirName is the symlink to the current timestamped directory.
	DataDirName = "..data"
	// newDataDirName is the symlink renamed over DataDirName.
	newDataDirName = "..data_tmp"
	// DirMode and FileMode are the modes of what a projection writes,
	// set explicitly whatever the umask: trust bundles are public and read
	// by consumers running as other users.
	DirMode  fs.FileMode = 0o755
	FileMode fs.FileMode = 0o644
	// tsLayout names the timestamped directories (os.MkdirTemp adds a
	// random suffix).
	tsLayout = "..2006_01_02_15_04_05."
)

// Writer writes one file into a directory it owns, like kubelet's
// AtomicWriter:
//
//	<dir>/..2026_01_02_15_04_05.123/<file>   the content
//	<dir>/..data -> ..2026_01_02_15_04_05.123 swapped by rename(2)
//	<dir>/<file> -> ..data/<file>             what consumers open
//
// A new version goes into a new timestamped directory, is synced, and
// becomes visible in one rename of the ..data symlink. The previous
// timestamped directory is kept until the next write, so that a reader
// whose path lookup started before the swap still finds its file; older
// ones are removed. A Writer is not safe for concurrent use; one process
// owns the directory.
type Writer struct {
	// Dir is the directory; File the file name in it.
	Dir, File string
	// Clock names the timestamped directories; nil means the real clock.
	Clock clock.PassiveClock
}

// NewWriter returns a Writer for path.
func NewWriter(path string) *Writer {
	return &Writer{Dir: filepath.Dir(path), File: filepath.Base(path)}
}

// Path is the file consumers read.
func (w *Writer) Path() string { return filepath.Join(w.Dir, w.File) }

// Read returns the current content, or nil and no error when nothing has
// been written yet.
func (w *Writer) Read() ([]byte, error) {
	data, err := os.ReadFile(filepath.Join(w.Dir, DataDirName, w.File))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("unable to read %s: %w", w.Path(), err)
	}
	return data, nil
}

// Write makes data the content of the file. It writes nothing and returns
// false when the content is already data.
func (w *Writer) Write(data []byte) (bool, error) {
	current, err := w.Read()
	if err != nil {
		return false, err
	}
	if current != nil && bytes.Equal(current, data) {
		if err := w.ensureModes(); err != nil {
			return false, err
		}
		return false, w.ensureVisible()
	}
	if err := mkdirAll(w.Dir); err != nil {
		return false, fmt.Errorf("unable to create %s: %w", w.Dir, err)
	}
	if err := repairDirMode(w.Dir); err != nil {
		return false, err
	}
	now := time.Now()
	if w.Clock != nil {
		now = w.Clock.Now()
	}
	ts, err := os.MkdirTemp(w.Dir, now.UTC().Format(tsLayout))
	if err != nil {
		return false, fmt.Errorf("unable to create a data directory in %s: %w", w.Dir, err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(ts)
		}
	}()
	if err := os.Chmod(ts, DirMode); err != nil {
		return false, fmt.Errorf("unable to write %s: %w", w.Path(), err)
	}
	if err := writeSynced(filepath.Join(ts, w.File), data, FileMode); err != nil {
		return false, fmt.Errorf("unable to write %s: %w", w.Path(), err)
	}
	if err := syncDir(ts); err != nil {
		return false, fmt.Errorf("unable to write %s: %w", w.Path(), err)
	}
	tmpLink := filepath.Join(w.Dir, newDataDirName)
	if err := os.Remove(tmpLink); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return false, fmt.Errorf("unable to write %s: %w", w.Path(), err)
	}
	previous, _ := os.Readlink(filepath.Join(w.Dir, DataDirName))
	if err := os.Symlink(filepath.Base(ts), tmpLink); err != nil {
		return false, fmt.Errorf("unable to write %s: %w", w.Path(), err)
	}
	if err := os.Rename(tmpLink, filepath.Join(w.Dir, DataDirName)); err != nil {
		_ = os.Remove(tmpLink)
		return false, fmt.Errorf("unable to write %s: %w", w.Path(), err)
	}
	ok = true
	if err := w.ensureVisible(); err != nil {
		return true, err
	}
	if err := syncDir(w.Dir); err != nil {
		return true, fmt.Errorf("unable to write %s: %w", w.Path(), err)
	}
	return true, w.prune(filepath.Base(ts), previous)
}

// ensureModes gives the directory, the current data directory and the file
// their modes, in case an earlier write (or an older agent, under a
// restrictive umask) left them unreadable to consumers.
func (w *Writer) ensureModes() error {
	if err := repairDirMode(w.Dir); err != nil {
		return err
	}
	data := filepath.Join(w.Dir, DataDirName)
	for _, c := range []struct {
		path string
		mode fs.FileMode
	}{{data, DirMode}, {filepath.Join(data, w.File), FileMode}} {
		if err := chmodIfNot(c.path, c.mode); err != nil {
			return err
		}
	}
	return nil
}

// repairDirMode opens the projection directory to consumers when it is
// private the way an agent under UMask=0077 made it (0700), and otherwise
// leaves it alone: an operator may have chosen the directory and its mode
// (0750 for a group of consumers, a sticky 1777), and the agent widens or
// narrows nothing it did not make.
func repairDirMode(dir string) error {
	fi, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("unable to read the mode of %s: %w", dir, err)
	}
	if fi.Mode()&(fs.ModePerm|fs.ModeSticky|fs.ModeSetuid|fs.ModeSetgid) != 0o700 {
		return nil
	}
	if err := os.Chmod(dir, DirMode); err != nil {
		return fmt.Errorf("unable to set the mode of %s: %w", dir, err)
	}
	return nil
}

// chmodIfNot sets path's permission bits to mode if they differ (following
// symlinks).
func chmodIfNot(path string, mode fs.FileMode) error {
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("unable to read the mode of %s: %w", path, err)
	}
	if fi.Mode().Perm() == mode {
		return nil
	}
	if err := os.Chmod(path, mode); err != nil {
		return fmt.Errorf("unable to make %s readable to its consumers: %w", path, err)
	}
	return nil
}

// ensureVisible makes <dir>/<file> a symlink to ..data/<file>, replacing
// whatever is there (a regular file from an earlier installation) by
// rename, so that the path never disappears.
func (w *Writer) ensureVisible() error {
	target := filepath.Join(DataDirName, w.File)
	if t, err := os.Readlink(w.Path()); err == nil && t == target {
		return nil
	}
	tmp := filepath.Join(w.Dir, "."+w.File+".link-tmp")
	_ = os.Remove(tmp)
	if err := os.Symlink(target, tmp); err != nil {
		return fmt.Errorf("unable to link %s: %w", w.Path(), err)
	}
	if err := os.Rename(tmp, w.Path()); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("unable to link %s: %w", w.Path(), err)
	}
	return nil
}

// prune removes timestamped directories other than keep, and leftovers of
// an interrupted write.
func (w *Writer) prune(keep ...string) error {
	entries, err := os.ReadDir(w.Dir)
	if err != nil {
		return fmt.Errorf("unable to clean up %s: %w", w.Dir, err)
	}
	var errs []error
	for _, e := range entries {
		n := e.Name()
		switch {
		case n == newDataDirName || n == "."+w.File+".link-tmp":
			_ = os.Remove(filepath.Join(w.Dir, n))
		case e.IsDir() && isTimestamped(n) && !slices.Contains(keep, n):
			if err := os.RemoveAll(filepath.Join(w.Dir, n)); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// Cleanup removes leftovers of a write interrupted by a crash: a stray
// ..data_tmp link and timestamped directories ..data does not point to.
func (w *Writer) Cleanup() error {
	current, err := os.Readlink(filepath.Join(w.Dir, DataDirName))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("unable to read %s: %w", filepath.Join(w.Dir, DataDirName), err)
	}
	return w.prune(current)
}

func isTimestamped(name string) bool {
	if !strings.HasPrefix(name, "..") || len(name) < len(tsLayout) {
		return false
	}
	_, err := time.Parse(tsLayout, name[:len(tsLayout)])
	return err == nil
}

// mkdirAll creates dir and its missing parents with DirMode whatever the
// umask (the agent's unit runs with UMask=0077, which would otherwise leave
// them 0700 and the bundle unreadable to its consumers).
func mkdirAll(dir string) error {
	if fi, err := os.Stat(dir); err == nil {
		if !fi.IsDir() {
			return fmt.Errorf("%s is not a directory", dir)
		}
		return nil
	}
	if parent := filepath.Dir(dir); parent != dir {
		if err := mkdirAll(parent); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, DirMode); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	return os.Chmod(dir, DirMode)
}

func writeSynced(path string, data []byte, perm fs.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	// The umask applies to OpenFile's mode; consumers need perm itself.
	if err := f.Chmod(perm); err != nil {
		_ = f.Close()
		return err
	}
	if _, err := f.Write(data); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Remove takes away what the Writer put in its directory: the consumers'
// symlink (only if it still points into ..data), the ..data link and the
// timestamped directories, and leftovers of an interrupted write. Other
// files, and the directory itself, are left alone: they are not the
// agent's. It is for a projection removed from the configuration.
func (w *Writer) Remove() error {
	var errs []error
	remove := func(path string) {
		if err := os.RemoveAll(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if t, err := os.Readlink(w.Path()); err == nil && t == filepath.Join(DataDirName, w.File) {
		remove(w.Path())
	}
	for _, link := range []string{DataDirName, newDataDirName, "." + w.File + ".link-tmp"} {
		if fi, err := os.Lstat(filepath.Join(w.Dir, link)); err == nil && fi.Mode()&fs.ModeSymlink != 0 {
			remove(filepath.Join(w.Dir, link))
		}
	}
	entries, err := os.ReadDir(w.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		return errors.Join(errs...)
	}
	if err != nil {
		return fmt.Errorf("unable to clean up %s: %w", w.Dir, err)
	}
	for _, e := range entries {
		if e.IsDir() && isTimestamped(e.Name()) {
			remove(filepath.Join(w.Dir, e.Name()))
		}
	}
	return errors.Join(errs...)
}
