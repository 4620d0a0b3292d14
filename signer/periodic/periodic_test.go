package periodic

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

// TestEvery: runs come at once and then every period, never overlap,
// stop when f says so or ctx is done, and done is closed only once the
// run under way has returned; no goroutine is left behind.
func TestEvery(t *testing.T) {
	before := runtime.NumGoroutine()

	t.Run("repeats until f stops", func(t *testing.T) {
		var runs atomic.Int32
		done := Every(context.Background(), time.Millisecond, func(context.Context) bool { return runs.Add(1) < 5 })
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("never ended")
		}
		if n := runs.Load(); n != 5 {
			t.Errorf("%d runs, want 5", n)
		}
	})

	t.Run("first run at once", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		ran := make(chan struct{})
		Every(ctx, time.Hour, func(context.Context) bool { close(ran); return true })
		select {
		case <-ran:
		case <-time.After(5 * time.Second):
			t.Fatal("the first run did not come at once")
		}
	})

	t.Run("cancel waits for the run under way", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		var inRun, overlap atomic.Int32
		started, release := make(chan struct{}, 100), make(chan struct{})
		done := Every(ctx, time.Microsecond, func(ctx context.Context) bool {
			if inRun.Add(1) > 1 {
				overlap.Add(1)
			}
			defer inRun.Add(-1)
			started <- struct{}{}
			<-release
			return true
		})
		<-started
		cancel()
		select {
		case <-done:
			t.Fatal("done closed while a run was under way")
		case <-time.After(50 * time.Millisecond):
		}
		close(release)
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("done not closed after the run returned")
		}
		if overlap.Load() != 0 {
			t.Error("runs overlapped")
		}
		if n := len(started); n != 0 {
			t.Errorf("%d runs started after ctx was done", n)
		}
	})

	t.Run("ctx done before the first run", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		var runs atomic.Int32
		done := Every(ctx, time.Millisecond, func(context.Context) bool { runs.Add(1); return true })
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("never ended")
		}
		if runs.Load() != 0 {
			t.Error("ran after ctx was done")
		}
	})

	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		t.Errorf("%d goroutines left behind", n-before)
	}
}

// TestStartWake: each run says when the next comes; Wake runs f at once
// when it waits, once more right after a run under way (never alongside
// it), and does nothing after the loop has ended.
func TestStartWake(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var inRun, overlap atomic.Int32
	runs := make(chan struct{}, 100)
	release := make(chan struct{}, 100)
	l := Start(ctx, func(context.Context) (time.Duration, bool) {
		if inRun.Add(1) > 1 {
			overlap.Add(1)
		}
		defer inRun.Add(-1)
		runs <- struct{}{}
		<-release
		return time.Hour, true
	})
	wait := func(what string) {
		t.Helper()
		select {
		case <-runs:
		case <-time.After(5 * time.Second):
			t.Fatalf("no run %s", what)
		}
	}
	quiet := func(what string) {
		t.Helper()
		select {
		case <-runs:
			t.Fatalf("a run %s", what)
		case <-time.After(50 * time.Millisecond):
		}
	}
	wait("at once")
	release <- struct{}{}
	quiet("before the hour the first run asked for")

	l.Wake()
	wait("after Wake while waiting")
	// Woken twice during this run: one more run after it, not two, and
	// not alongside it.
	l.Wake()
	l.Wake()
	quiet("alongside the run under way")
	release <- struct{}{}
	wait("after a Wake during the run")
	release <- struct{}{}
	quiet("more than once for two Wakes during one run")
	if overlap.Load() != 0 {
		t.Error("runs overlapped")
	}

	cancel()
	select {
	case <-l.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("never ended")
	}
	l.Wake()
	quiet("after the loop ended")
}
