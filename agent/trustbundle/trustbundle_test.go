package trustbundle

import (
	"bytes"
	"context"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

func newCAPEM(t *testing.T, name string) string {
	t.Helper()
	ca, err := harness.NewCA(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(ca.CertPEM)
}

func TestAssemble(t *testing.T) {
	a, b := newCAPEM(t, "a"), newCAPEM(t, "b")
	got, err := Assemble(map[string]string{"x": b + "\n" + a, "y": a})
	if err != nil {
		t.Fatal(err)
	}
	if got.Certificates != 2 {
		t.Fatalf("got %d certificates, want 2 (de-duplicated)", got.Certificates)
	}
	again, err := Assemble(map[string]string{"y": a + b})
	if err != nil || !bytes.Equal(got.PEM, again.PEM) {
		t.Fatalf("assembling the same certificates in another order gave different output (err %v)", err)
	}
	key := string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: []byte{1}}))
	for name, bundle := range map[string]string{
		"empty":              "  \n",
		"not a certificate":  a + key,
		"garbage between":    a + "hello\n" + b,
		"garbage after":      a + "trailing",
		"unparsable":         string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: []byte("nope")})),
		"headers":            string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Headers: map[string]string{"k": "v"}, Bytes: []byte("x")})),
		"truncated PEM data": a[:len(a)-30],
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := Assemble(map[string]string{"good": b, "bad": bundle}); err == nil || !strings.Contains(err.Error(), "ClusterTrustBundle bad") {
				t.Fatalf("Assemble accepted an invalid bundle or did not name it: %v", err)
			}
		})
	}
	if _, err := Assemble(nil); err == nil {
		t.Fatal("Assemble of nothing succeeded")
	}
}

func TestWriter(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "bundle")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	// A regular file left by an earlier installation is replaced.
	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	w := NewWriter(filepath.Join(dir, "ca.crt"))
	for i, content := range []string{"one", "one", "two", "three", "four"} {
		changed, err := w.Write([]byte(content))
		if err != nil {
			t.Fatal(err)
		}
		if want := i != 1; changed != want {
			t.Fatalf("write %d (%q): changed = %v, want %v", i, content, changed, want)
		}
		got, err := os.ReadFile(w.Path())
		if err != nil || string(got) != content {
			t.Fatalf("read %q, %v; want %q", got, err, content)
		}
	}
	if target, err := os.Readlink(w.Path()); err != nil || target != "..data/ca.crt" {
		t.Fatalf("%s -> %q, %v; want a symlink to ..data/ca.crt", w.Path(), target, err)
	}
	entries, _ := os.ReadDir(dir)
	var ts []string
	for _, e := range entries {
		if isTimestamped(e.Name()) {
			ts = append(ts, e.Name())
		} else if e.Name() != "..data" && e.Name() != "ca.crt" {
			t.Errorf("unexpected entry %s", e.Name())
		}
	}
	if len(ts) != 2 {
		t.Errorf("timestamped directories %v: want the current and the previous one", ts)
	}
	// Leftovers of a crash are removed.
	if err := os.Symlink("nowhere", filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := w.Cleanup(); err != nil {
		t.Fatal(err)
	}
	entries, _ = os.ReadDir(dir)
	if len(entries) != 3 {
		t.Errorf("after Cleanup: %d entries, want ..data, its directory and ca.crt", len(entries))
	}
}

type statusLog struct {
	mu   sync.Mutex
	last map[string]Status
}

func (l *statusLog) set(s Status) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.last == nil {
		l.last = map[string]Status{}
	}
	l.last[s.Projection] = s
}

func (l *statusLog) get(p string) Status {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.last[p]
}

func current(s Status) bool { return !s.Stale && !s.LastSync.IsZero() }

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestInvalidBundleKeepsLastGood: a selected object whose bundle does not
// validate (kube-apiserver refuses such a write, so the projector is handed
// it directly) leaves the file as it was and marks the projection stale; a
// valid one heals it.
func TestInvalidBundleKeepsLastGood(t *testing.T) {
	a := newCAPEM(t, "a")
	path := filepath.Join(t.TempDir(), "root", "ca.crt")
	var log statusLog
	p := &Projector{Projection: config.TrustBundleProjection{Name: "root", Path: path}, OnStatus: log.set}
	ctx := context.Background()
	p.start()
	if s := log.get(path); !s.Stale {
		t.Fatalf("before the first sync: %+v, want stale", s)
	}
	mustSync(t, p, map[string]string{"root": a})
	if s := log.get(path); !current(s) || s.Certificates != 1 {
		t.Fatalf("after the first sync: %+v", s)
	}
	good, _ := os.ReadFile(path)
	_ = p.sync(ctx, map[string]string{"root": a + "garbage"}) // rejected: the file must not change
	if got, _ := os.ReadFile(path); !bytes.Equal(got, good) {
		t.Fatal("an invalid bundle changed the file")
	}
	if s := log.get(path); !s.Stale || !strings.Contains(s.Reason, "keeping the last good content") {
		t.Errorf("after an invalid bundle: %+v", s)
	}
	_ = p.sync(ctx, map[string]string{}) // deleted: the file must not change
	if got, _ := os.ReadFile(path); !bytes.Equal(got, good) {
		t.Fatal("a deleted bundle changed the file")
	}
	b := newCAPEM(t, "b")
	mustSync(t, p, map[string]string{"root": a + b})
	if s := log.get(path); !current(s) || s.Certificates != 2 {
		t.Fatalf("after a valid bundle: %+v", s)
	}
}

// mustSync runs one sync the test expects to succeed.
func mustSync(t *testing.T, p *Projector, objects map[string]string) {
	t.Helper()
	if err := p.sync(t.Context(), objects); err != nil {
		t.Fatalf("sync: %v", err)
	}
}
