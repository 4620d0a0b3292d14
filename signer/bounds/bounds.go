// Package bounds bounds what a workload cluster's API server can make the
// controller hold or wait for. A tenant points its Cluster's
// `<cluster>-kubeconfig` at a server it runs, so every answer from it is
// hostile input: a body of any size, a body dripped a byte at a time, a
// watch that never ends an event. Limits.Wrap is an http.RoundTripper
// wrapper (rest.Config.Wrap) that reads at most MaxResponseBytes of any
// answer, gives every request RequestTimeout from sending it to the end of
// its body, and holds a watch to MaxEventBytes and RequestTimeout per
// event and WatchIdleTimeout between events. A request that exceeds one
// fails with an *ExceededError, which the wrapper also reports, once per
// request, to its caller's function: the cluster is then marked unhealthy
// and retried later rather than grown into.
package bounds

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"k8s.io/client-go/transport"
)

// Defaults of Limits.
const (
	// DefaultMaxResponseBytes bounds one answer: a page of CSRs (at
	// DefaultListPageSize) or any single object is far smaller.
	DefaultMaxResponseBytes = 16 << 20
	// DefaultMaxEventBytes bounds one watch event: larger than the largest
	// object the API server stores (etcd's 1.5 MiB request, in JSON).
	DefaultMaxEventBytes = 4 << 20
	// DefaultRequestTimeout bounds a request from sending it to the end of
	// its body, and each watch event from its first byte to its last.
	DefaultRequestTimeout = 30 * time.Second
	// DefaultWatchIdleTimeout bounds the time a watch may go without a
	// complete event: longer than the 5 to 10 minutes after which an API
	// server ends a reflector's watch (its timeoutSeconds).
	DefaultWatchIdleTimeout = 11 * time.Minute
	// DefaultListPageSize is the limit of each page of a list.
	DefaultListPageSize = 100
)

// Bounds a workload cluster can exceed (ExceededError.Limit).
const (
	LimitResponseSize = "ResponseTooLarge"
	LimitEventSize    = "WatchEventTooLarge"
	LimitTimeout      = "RequestTimedOut"
	LimitEventTimeout = "WatchEventTimedOut"
	LimitWatchIdle    = "WatchIdle"
	LimitCachedCSRs   = "TooManyCachedCSRs"
	LimitCachedBytes  = "CachedCSRsTooLarge"
)

// Limits bound what one workload API server can make the controller hold
// or wait for. Zero fields mean the defaults.
type Limits struct {
	MaxResponseBytes int64
	MaxEventBytes    int64
	RequestTimeout   time.Duration
	WatchIdleTimeout time.Duration
}

// Complete returns l with the defaults filled in.
func (l Limits) Complete() Limits {
	if l.MaxResponseBytes <= 0 {
		l.MaxResponseBytes = DefaultMaxResponseBytes
	}
	if l.MaxEventBytes <= 0 {
		l.MaxEventBytes = DefaultMaxEventBytes
	}
	if l.RequestTimeout <= 0 {
		l.RequestTimeout = DefaultRequestTimeout
	}
	if l.WatchIdleTimeout <= 0 {
		l.WatchIdleTimeout = DefaultWatchIdleTimeout
	}
	return l
}

// ExceededError is a workload API server's answer that exceeded a bound.
type ExceededError struct {
	// Limit is which bound (LimitResponseSize, ...); Bound says its value.
	Limit, Bound string
	// Request is the method and path of the request ("" for a cache
	// budget).
	Request string
}

func (e *ExceededError) Error() string {
	if e.Request == "" {
		return fmt.Sprintf("the workload cluster exceeded a bound of the controller (%s: %s)", e.Limit, e.Bound)
	}
	return fmt.Sprintf("the workload API server's answer to %s exceeded a bound of the controller (%s: %s)", e.Request, e.Limit, e.Bound)
}

// Wrap returns the wrapper that bounds every request of a client config
// (rest.Config.Wrap). exceeded, when set, is told of each request that
// exceeds a bound (it must not block).
func (l Limits) Wrap(exceeded func(*ExceededError)) transport.WrapperFunc {
	l = l.Complete()
	return func(next http.RoundTripper) http.RoundTripper {
		return &boundedTransport{limits: l, next: next, exceeded: exceeded}
	}
}

type boundedTransport struct {
	limits   Limits
	next     http.RoundTripper
	exceeded func(*ExceededError)
}

// WrappedRoundTripper lets client-go see through the wrapper.
func (t *boundedTransport) WrappedRoundTripper() http.RoundTripper { return t.next }

// isWatch reports whether req is a watch (its answer is a stream).
func isWatch(req *http.Request) bool {
	switch req.URL.Query().Get("watch") {
	case "true", "1":
		return true
	}
	return strings.Contains(req.URL.Path, "/watch/")
}

func (t *boundedTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	name := req.Method + " " + req.URL.Path
	var once sync.Once
	fail := func(limit, bound string) *ExceededError {
		e := &ExceededError{Limit: limit, Bound: bound, Request: name}
		once.Do(func() {
			if t.exceeded != nil {
				t.exceeded(e)
			}
		})
		return e
	}
	ctx, cancel := context.WithCancelCause(req.Context())
	// Until its headers arrive, a watch is bounded as any request.
	deadline := time.AfterFunc(t.limits.RequestTimeout, func() {
		cancel(fail(LimitTimeout, t.limits.RequestTimeout.String()))
	})
	resp, err := t.next.RoundTrip(req.WithContext(ctx))
	if err != nil {
		deadline.Stop()
		cancel(nil)
		return nil, cause(ctx, err)
	}
	// A watch the API server refuses (an error, while it starts, ...) is
	// answered with one Status, not a stream of events: bounded as any
	// answer, and never read as frames (a protobuf Status starts with
	// "k8s\x00", no frame length).
	if !isWatch(req) || resp.StatusCode != http.StatusOK {
		if resp.ContentLength > t.limits.MaxResponseBytes {
			deadline.Stop()
			resp.Body.Close()
			cancel(nil)
			return nil, fail(LimitResponseSize, fmt.Sprintf("%d bytes", t.limits.MaxResponseBytes))
		}
		resp.Body = &limitedBody{rc: resp.Body, ctx: ctx, left: t.limits.MaxResponseBytes, stop: func() { deadline.Stop(); cancel(nil) },
			tooLarge: func() error { return fail(LimitResponseSize, fmt.Sprintf("%d bytes", t.limits.MaxResponseBytes)) }}
		return resp, nil
	}
	deadline.Stop()
	w := &watchBody{rc: resp.Body, ctx: ctx, cancel: cancel, limits: t.limits, fail: fail,
		protobuf: strings.Contains(resp.Header.Get("Content-Type"), "protobuf")}
	w.idle = time.AfterFunc(t.limits.WatchIdleTimeout, func() { cancel(fail(LimitWatchIdle, t.limits.WatchIdleTimeout.String())) })
	resp.Body = w
	return resp, nil
}

// cause returns the bound ctx was cancelled for, if any, else err.
func cause(ctx context.Context, err error) error {
	var e *ExceededError
	if c := context.Cause(ctx); errors.As(c, &e) {
		return e
	}
	return err
}

// limitedBody is the body of an answer: at most left bytes, read before
// the request's deadline.
type limitedBody struct {
	rc       io.ReadCloser
	ctx      context.Context
	left     int64
	stop     func()
	tooLarge func() error
	done     bool
}

func (b *limitedBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		// One more byte tells a body of exactly the bound from a larger one.
		var one [1]byte
		n, err := b.rc.Read(one[:])
		if n > 0 {
			b.finish()
			return 0, b.tooLarge()
		}
		if err != nil {
			b.finish()
			return 0, cause(b.ctx, err)
		}
		return 0, nil
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.rc.Read(p)
	b.left -= int64(n)
	if err != nil {
		b.finish()
		err = cause(b.ctx, err)
	}
	return n, err
}

func (b *limitedBody) finish() {
	if !b.done {
		b.done = true
		b.stop()
	}
}

func (b *limitedBody) Close() error {
	err := b.rc.Close()
	b.finish()
	return err
}

// watchBody is the stream of a watch: each event (a JSON line, or a
// length-prefixed protobuf frame) at most MaxEventBytes and whole within
// RequestTimeout of its first byte, and a complete event at least every
// WatchIdleTimeout.
type watchBody struct {
	rc       io.ReadCloser
	ctx      context.Context
	cancel   context.CancelCauseFunc
	limits   Limits
	fail     func(limit, bound string) *ExceededError
	protobuf bool

	mu    sync.Mutex
	idle  *time.Timer
	event *time.Timer // running while an event is incomplete

	// JSON: bytes of the current line, and whether any is not blank.
	line    int64
	content bool
	// protobuf: the header bytes read of the current frame, then the
	// frame bytes still to come.
	header  [4]byte
	headerN int
	frame   int64
}

func (w *watchBody) Read(p []byte) (int, error) {
	n, err := w.rc.Read(p)
	if n > 0 {
		if e := w.scan(p[:n]); e != nil {
			w.cancel(e)
			return 0, e
		}
	}
	if err != nil {
		err = cause(w.ctx, err)
	}
	return n, err
}

// scan accounts for the bytes b of the stream.
func (w *watchBody) scan(b []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	tooLarge := func() error { return w.fail(LimitEventSize, fmt.Sprintf("%d bytes", w.limits.MaxEventBytes)) }
	for len(b) > 0 {
		if w.protobuf {
			if w.frame == 0 {
				c := copy(w.header[w.headerN:], b)
				w.headerN += c
				b = b[c:]
				w.started()
				if w.headerN < 4 {
					continue
				}
				w.headerN = 0
				w.frame = int64(binary.BigEndian.Uint32(w.header[:]))
				if w.frame > w.limits.MaxEventBytes {
					return tooLarge()
				}
				if w.frame == 0 {
					w.ended()
				}
				continue
			}
			c := int64(len(b))
			if c > w.frame {
				c = w.frame
			}
			w.frame -= c
			b = b[c:]
			if w.frame == 0 {
				w.ended()
			}
			continue
		}
		i := 0
		for ; i < len(b) && b[i] != '\n'; i++ {
			if !w.content && b[i] != ' ' && b[i] != '\t' && b[i] != '\r' {
				w.content = true
			}
		}
		w.line += int64(i)
		if w.line > w.limits.MaxEventBytes {
			return tooLarge()
		}
		if w.content {
			w.started()
		}
		if i == len(b) {
			break
		}
		if w.content {
			w.ended()
		}
		w.line, w.content = 0, false
		b = b[i+1:]
	}
	return nil
}

// started notes that an event is under way.
func (w *watchBody) started() {
	if w.event == nil {
		w.event = time.AfterFunc(w.limits.RequestTimeout, func() {
			w.cancel(w.fail(LimitEventTimeout, w.limits.RequestTimeout.String()))
		})
	}
}

// ended notes a complete event.
func (w *watchBody) ended() {
	if w.event != nil {
		w.event.Stop()
		w.event = nil
	}
	w.idle.Reset(w.limits.WatchIdleTimeout)
}

func (w *watchBody) Close() error {
	err := w.rc.Close()
	w.mu.Lock()
	w.idle.Stop()
	if w.event != nil {
		w.event.Stop()
	}
	w.mu.Unlock()
	w.cancel(nil)
	return err
}
