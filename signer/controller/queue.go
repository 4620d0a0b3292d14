package controller

import (
	"sync"
	"time"

	"k8s.io/client-go/util/workqueue"
)

// retryQueue is client-go's work queue and rate limiters, its delayed
// adds made with timers. client-go's delaying queue keeps a goroutine, a
// ticker and a buffer of a thousand pending adds per queue, which every
// opted-in Cluster held for its life, idle or not; a timer costs nothing
// until a request waits for a retry.
type retryQueue struct {
	workqueue.TypedInterface[key]
	limiter workqueue.TypedRateLimiter[key]

	mu sync.Mutex
	// waiting holds the delayed add of each key, the earliest asked for:
	// as in client-go's delaying queue, a key waits at most once.
	waiting map[key]*delayedAdd
}

type delayedAdd struct {
	at    time.Time
	timer *time.Timer
}

func newRetryQueue(limiter workqueue.TypedRateLimiter[key]) *retryQueue {
	// No name: no metrics, and so no goroutine updating them.
	return &retryQueue{TypedInterface: workqueue.NewTypedWithConfig(workqueue.TypedQueueConfig[key]{}), limiter: limiter, waiting: map[key]*delayedAdd{}}
}

// AddAfter adds k once d has passed, or sooner if an earlier add of k is
// already waiting.
func (q *retryQueue) AddAfter(k key, d time.Duration) {
	if q.ShuttingDown() {
		return
	}
	if d <= 0 {
		q.Add(k)
		return
	}
	at := time.Now().Add(d)
	q.mu.Lock()
	defer q.mu.Unlock()
	if w := q.waiting[k]; w != nil {
		if !at.Before(w.at) {
			return
		}
		// A timer that fired already only adds k early; it no longer
		// removes the entry (below).
		w.timer.Stop()
	}
	w := &delayedAdd{at: at}
	w.timer = time.AfterFunc(d, func() {
		q.mu.Lock()
		if q.waiting[k] == w {
			delete(q.waiting, k)
		}
		q.mu.Unlock()
		q.Add(k)
	})
	q.waiting[k] = w
}

// AddRateLimited adds k when its rate limiter allows.
func (q *retryQueue) AddRateLimited(k key) { q.AddAfter(k, q.limiter.When(k)) }

// Forget tells the rate limiter k is done with retrying.
func (q *retryQueue) Forget(k key) { q.limiter.Forget(k) }

// NumRequeues says how many times k has been retried.
func (q *retryQueue) NumRequeues(k key) int { return q.limiter.NumRequeues(k) }

// ShutDown stops the delayed adds and the queue.
func (q *retryQueue) ShutDown() {
	q.mu.Lock()
	for k, w := range q.waiting {
		w.timer.Stop()
		delete(q.waiting, k)
	}
	q.mu.Unlock()
	q.TypedInterface.ShutDown()
}
