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
	l := &loop{ctx: ctx, period: period, f: f, done: make(chan struct{})}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.timer = time.AfterFunc(0, l.run)
	l.stop = context.AfterFunc(ctx, l.cancel)
	return l.done
}

type loop struct {
	ctx    context.Context
	period time.Duration
	f      func(context.Context) bool

	mu      sync.Mutex
	timer   *time.Timer
	stop    func() bool
	running bool
	ended   bool
	done    chan struct{}
}

func (l *loop) run() {
	l.mu.Lock()
	if l.ended || l.ctx.Err() != nil {
		l.mu.Unlock()
		return
	}
	l.running = true
	l.mu.Unlock()

	again := l.call()

	l.mu.Lock()
	defer l.mu.Unlock()
	l.running = false
	if !again || l.ctx.Err() != nil {
		l.end()
		return
	}
	l.timer.Reset(l.period)
}

func (l *loop) call() bool {
	defer utilruntime.HandleCrash()
	return l.f(l.ctx)
}

// cancel ends the loop once ctx is done: at once when no run is under
// way, else when the run returns.
func (l *loop) cancel() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.running {
		return
	}
	l.timer.Stop()
	l.end()
}

// end closes done, once; l.mu is held.
func (l *loop) end() {
	if l.ended {
		return
	}
	l.ended = true
	l.stop()
	close(l.done)
}
