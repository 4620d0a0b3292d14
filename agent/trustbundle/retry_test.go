package trustbundle

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
)

// TestFailedWriteIsRetried: a write that fails (here the projection's
// parent is a file, not a directory) is retried with backoff without any
// change of the source, and succeeds once the obstacle is gone; a file
// removed behind the agent's back comes back at the next resync.
func TestFailedWriteIsRetried(t *testing.T) {
	root := t.TempDir()
	blocker := filepath.Join(root, "bundles")
	if err := os.WriteFile(blocker, []byte("in the way"), 0o644); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(blocker, "cluster", "ca.crt")
	var log statusLog
	p := &Projector{
		Projection:   config.TrustBundleProjection{Name: "root", Path: path},
		OnStatus:     log.set,
		RetryInitial: 10 * time.Millisecond,
		RetryMax:     50 * time.Millisecond,
		ResyncPeriod: 200 * time.Millisecond,
	}
	p.start()
	objects := map[string]string{"root": newCAPEM(t, "a")}
	trigger := make(chan struct{}, 1)
	trigger <- struct{}{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	list := func() map[string]string { return objects }
	confirm := func(context.Context) (map[string]string, error) { return objects, nil }
	go func() { defer close(done); p.loop(ctx, trigger, list, confirm) }()
	t.Cleanup(func() { cancel(); <-done })

	waitFor(t, "the failed write reported", func() bool { s := log.get(path); return s.Stale && s.Reason != "" && s.LastSync.IsZero() })
	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the retried write", func() bool { return current(log.get(path)) })
	if _, err := os.Stat(path); err != nil {
		t.Fatal(err)
	}

	if err := os.RemoveAll(filepath.Dir(path)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the resync to restore the file", func() bool { _, err := os.Stat(path); return err == nil })
}

// TestRemoveStale: the files of a projection removed from the
// configuration go (its link, ..data and timestamped directories); what
// else is in its directory stays, and so does a directory a current
// projection writes to.
func TestRemoveStale(t *testing.T) {
	root := t.TempDir()
	gone := filepath.Join(root, "gone", "ca.crt")
	kept := filepath.Join(root, "kept", "ca.crt")
	renamed := filepath.Join(root, "renamed", "ca.crt")
	for _, p := range []string{gone, kept, renamed} {
		if _, err := NewWriter(p).Write([]byte(newCAPEM(t, "a"))); err != nil {
			t.Fatal(err)
		}
	}
	other := filepath.Join(root, "gone", "operator-notes.txt")
	if err := os.WriteFile(other, []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	current := []config.TrustBundleProjection{
		{Name: "k", Path: kept},
		{Name: "r", Path: filepath.Join(root, "renamed", "bundle.pem")},
	}
	if err := RemoveStale([]string{gone, kept, renamed, "relative/ca.crt"}, current); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(filepath.Dir(gone))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 || entries[0].Name() != "operator-notes.txt" {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("left in the removed projection's directory: %q, want only operator-notes.txt", names)
	}
	for _, p := range []string{kept, renamed} {
		if _, err := os.ReadFile(p); err != nil {
			t.Errorf("%s: %v", p, err)
		}
	}
}

// TestLimits: a selection over the number or size cap is refused whole: the
// last good content stays, the projection is stale and says which limit;
// back under the cap, it is written.
func TestLimits(t *testing.T) {
	a, b, c := newCAPEM(t, "a"), newCAPEM(t, "b"), newCAPEM(t, "c")
	for name, tc := range map[string]struct {
		maxBundles int
		maxBytes   int64
		want       string
	}{
		"count": {maxBundles: 2, want: "agent.maxTrustBundles"},
		"bytes": {maxBytes: int64(len(a) + len(b)), want: "agent.maxTrustBundleBytes"},
	} {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "sel", "ca.crt")
			var log statusLog
			p := &Projector{Projection: config.TrustBundleProjection{SignerName: "example.com/x", Path: path}, OnStatus: log.set,
				MaxBundles: tc.maxBundles, MaxBytes: tc.maxBytes}
			p.start()
			ctx := context.Background()
			if err := p.sync(ctx, map[string]string{"a": a, "b": b}); err != nil {
				t.Fatal(err)
			}
			good, _ := os.ReadFile(path)
			if s := log.get(path); !current(s) || s.Certificates != 2 {
				t.Fatalf("under the cap: %+v", s)
			}
			if err := p.sync(ctx, map[string]string{"a": a, "b": b, "c": c}); err != nil {
				t.Fatal(err)
			}
			s := log.get(path)
			if !s.Stale || !strings.Contains(s.Reason, tc.want) {
				t.Errorf("over the cap: %+v, want stale naming %s", s, tc.want)
			}
			if got, _ := os.ReadFile(path); !bytes.Equal(got, good) {
				t.Error("an over-limit selection changed the file")
			}
		})
	}
}
