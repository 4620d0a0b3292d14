// Package periodic runs work every so often on a timer, not in a goroutine
// of its own: between runs nothing waits. The controller keeps several
// such loops per workload cluster (probes, listings, renewals); as
// goroutines blocked in a sleep they would be a good part of what an
// idle workload cluster costs.
package periodic

import (
	"context"
	"sync"
	"time"

	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
)

// Every runs f at once, then period after each run returns, until ctx is
// done or f returns false. Runs never overlap; f gets ctx, and no run
// starts once ctx is done. It returns at once; the returned channel is
// closed when the last run has returned (after ctx is done or f returned
// false).
func Every(ctx context.Context, period time.Duration, f func(ctx context.Context) (again bool)) <-chan struct{} {
	return Start(ctx, func(ctx context.Context) (time.Duration, bool) { return period, f(ctx) }).Done()
}

// Loop runs a function again and again on a timer (Start).
type Loop struct {
	ctx context.Context
	f   func(context.Context) (time.Duration, bool)

	mu      sync.Mutex
	timer   *time.Timer
	stop    func() bool
	running bool
	woken   bool // Wake was called during a run
	ended   bool
	done    chan struct{}
}

// Start runs f at once, then again as long after each run as that run
// says, until ctx is done or f returns false; Wake runs it sooner. Runs
// never overlap; f gets ctx, and no run starts once ctx is done. It
// returns at once.
func Start(ctx context.Context, f func(ctx context.Context) (wait time.Duration, again bool)) *Loop {
	l := &Loop{ctx: ctx, f: f, done: make(chan struct{})}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.timer = time.AfterFunc(0, l.run)
	l.stop = context.AfterFunc(ctx, l.cancel)
	return l
}

// Done is closed when the last run has returned: after ctx is done or a
// run returned false.
func (l *Loop) Done() <-chan struct{} { return l.done }

// Wake runs f now instead of when the last run said: at once when it
// waits, right after the run under way otherwise. It does nothing once
// the loop has ended.
func (l *Loop) Wake() {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.ended:
	case l.running:
		l.woken = true
	default:
		l.timer.Reset(0)
	}
}

func (l *Loop) run() {
	l.mu.Lock()
	if l.ended || l.ctx.Err() != nil {
		l.mu.Unlock()
		return
	}
	if l.running {
		// A Wake reset the timer as it fired: run again after this run.
		l.woken = true
		l.mu.Unlock()
		return
	}
	l.running, l.woken = true, false
	l.mu.Unlock()

	wait, again := l.call()

	l.mu.Lock()
	defer l.mu.Unlock()
	l.running = false
	if !again || l.ctx.Err() != nil {
		l.end()
		return
	}
	if l.woken {
		wait, l.woken = 0, false
	}
	l.timer.Reset(wait)
}

func (l *Loop) call() (time.Duration, bool) {
	defer utilruntime.HandleCrash()
	return l.f(l.ctx)
}

// cancel ends the loop once ctx is done: at once when no run is under
// way, else when the run returns.
func (l *Loop) cancel() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.running {
		return
	}
	l.timer.Stop()
	l.end()
}

// end closes done, once; l.mu is held.
func (l *Loop) end() {
	if l.ended {
		return
	}
	l.ended = true
	l.stop()
	close(l.done)
}
