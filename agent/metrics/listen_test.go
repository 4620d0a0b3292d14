package metrics

import (
	"context"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestListenUnix: the socket is 0600 whatever the umask, a socket left by
// an earlier run is replaced, and any other file in the way is not touched.
func TestListenUnix(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)
	dir := t.TempDir()
	sock := filepath.Join(dir, "metrics.sock")
	for range 2 { // the second time over the first one's socket file
		l, err := Listen("unix:" + sock)
		if err != nil {
			t.Fatal(err)
		}
		l.(*net.UnixListener).SetUnlinkOnClose(false)
		fi, err := os.Lstat(sock)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
			t.Errorf("socket mode %v, want a socket 0600", fi.Mode())
		}
		if got := Address(l); got != "unix:"+sock {
			t.Errorf("Address = %q", got)
		}
		_ = l.Close()
	}
	regular := filepath.Join(dir, "file")
	if err := os.WriteFile(regular, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen("unix:" + regular); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("Listen over a regular file: %v", err)
	}
	if _, err := os.Stat(regular); err != nil {
		t.Errorf("the regular file is gone: %v", err)
	}
}

// TestServerRetries: an address in use is reported and retried, and
// served once free.
func TestServerRetries(t *testing.T) {
	squatter, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := squatter.Addr().String()
	var (
		mu     sync.Mutex
		states []ListenerState
	)
	srv := &Server{
		Handler:      New().Handler(func() error { return nil }),
		BindAddress:  addr,
		RetryInitial: 10 * time.Millisecond,
		RetryMax:     20 * time.Millisecond,
		OnState: func(s ListenerState) {
			mu.Lock()
			states = append(states, s)
			mu.Unlock()
		},
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); srv.Run(ctx) }()
	defer func() { cancel(); <-done }()

	waitFor := func(what string, ok func(ListenerState) bool) {
		t.Helper()
		for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
			mu.Lock()
			n := len(states)
			var last ListenerState
			if n > 0 {
				last = states[n-1]
			}
			mu.Unlock()
			if n > 0 && ok(last) {
				return
			}
		}
		t.Fatalf("never %s; states %+v", what, states)
	}
	waitFor("reported the address in use", func(s ListenerState) bool {
		return s.Err != nil && strings.Contains(s.Err.Error(), "address already in use") && !s.NextAttempt.IsZero()
	})
	_ = squatter.Close()
	waitFor("served", func(s ListenerState) bool { return s.Err == nil && len(s.Addresses) == 1 && s.Addresses[0] == addr })
	resp, err := http.Get("http://" + addr + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/healthz: %s", resp.Status)
	}
}
