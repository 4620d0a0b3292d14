package controller

import (
	"runtime"
	"testing"
	"time"

	"k8s.io/client-go/util/workqueue"
)

// TestRetryQueue: a delayed add comes once its time has passed; of two
// delayed adds of one key the earlier wins and the key comes once; a
// rate-limited add waits as the limiter says and Forget resets it; shut
// down, no delayed add comes and no goroutine is left.
func TestRetryQueue(t *testing.T) {
	before := runtime.NumGoroutine()
	q := newRetryQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[key](20*time.Millisecond, time.Second))
	got := make(chan key, 10)
	go func() {
		for {
			k, quit := q.Get()
			if quit {
				return
			}
			got <- k
			q.Done(k)
		}
	}()
	get := func(within time.Duration) (key, bool) {
		t.Helper()
		select {
		case k := <-got:
			return k, true
		case <-time.After(within):
			return key{}, false
		}
	}
	a, b := key{signer: "s", name: "a"}, key{signer: "s", name: "b"}

	start := time.Now()
	q.AddAfter(a, time.Hour)
	q.AddAfter(a, 50*time.Millisecond) // earlier: wins
	q.AddAfter(a, time.Hour)           // later: ignored
	if k, ok := get(5 * time.Second); !ok || k != a {
		t.Fatalf("got %v %v, want %v", k, ok, a)
	}
	if d := time.Since(start); d < 50*time.Millisecond {
		t.Errorf("delayed add came after %s, want at least 50ms", d)
	}
	if k, ok := get(200 * time.Millisecond); ok {
		t.Errorf("%v came again: one delayed add per key", k)
	}

	q.AddRateLimited(b)
	q.AddRateLimited(b)
	if n := q.NumRequeues(b); n != 2 {
		t.Errorf("NumRequeues = %d, want 2", n)
	}
	if k, ok := get(5 * time.Second); !ok || k != b {
		t.Fatalf("got %v %v, want %v", k, ok, b)
	}
	q.Forget(b)
	if n := q.NumRequeues(b); n != 0 {
		t.Errorf("NumRequeues after Forget = %d, want 0", n)
	}

	q.AddAfter(a, 50*time.Millisecond)
	q.ShutDown()
	time.Sleep(100 * time.Millisecond)
	if k, ok := get(0); ok {
		t.Errorf("%v added after shut down", k)
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine() - before; n > 0 {
		t.Errorf("%d goroutines left after shut down", n)
	}
}
