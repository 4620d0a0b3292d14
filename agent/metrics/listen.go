package metrics

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"
)

// Listen opens addr for Serve: "unix:" and an absolute path for a unix
// socket, created 0600 (a socket file left by an earlier run is replaced;
// any other file there is an error), or host:port for TCP.
func Listen(addr string) (net.Listener, error) {
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		return listenUnix(path)
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("unable to listen on %s: %w", addr, err)
	}
	return l, nil
}

func listenUnix(path string) (net.Listener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("unable to listen on unix:%s: a file that is not a socket is in the way", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("unable to remove the old socket %s: %w", path, err)
		}
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("unable to listen on unix:%s: %w", path, err)
	}
	// Whatever the umask: only root may connect. A wider audience comes
	// from kubelet-authenticator-metrics.socket (SocketMode, SocketGroup).
	if err := os.Chmod(path, 0o600); err != nil {
		_ = l.Close()
		return nil, fmt.Errorf("unable to restrict %s: %w", path, err)
	}
	return l, nil
}

// Address is how a listener's address is shown: host:port, or "unix:"
// and the path.
func Address(l net.Listener) string {
	a := l.Addr()
	if a.Network() == "unix" {
		return "unix:" + a.String()
	}
	return a.String()
}

// ListenerState is what a Server reports whenever it starts serving or
// fails to.
type ListenerState struct {
	// Addresses are the addresses served; empty while none is.
	Addresses []string
	// Err is the last error; nil while serving. NextAttempt is when the
	// server tries again after an error.
	Err         error
	NextAttempt time.Time
}

// Server serves a handler on the agent's metrics listener and keeps at it:
// an address another process holds, or a listener that fails, is reported
// through OnState and retried with capped exponential backoff. It never
// returns an error, so that what it serves cannot stop the work it reports
// on.
type Server struct {
	Handler http.Handler
	// Activated are listeners systemd passed (socket activation); when
	// there are any, BindAddress is not used.
	Activated []net.Listener
	// BindAddress is opened with Listen otherwise.
	BindAddress string
	// RetryInitial doubles after each consecutive failure up to RetryMax.
	// Defaults: 1s and 1m.
	RetryInitial, RetryMax time.Duration
	// OnState is called on every change.
	OnState func(ListenerState)
}

// Run serves until ctx is done.
func (s *Server) Run(ctx context.Context) {
	wait := s.RetryInitial
	if wait <= 0 {
		wait = time.Second
	}
	maxWait := s.RetryMax
	if maxWait <= 0 {
		maxWait = time.Minute
	}
	initial := wait
	for {
		ls, err := s.open()
		if err == nil {
			wait = initial
			err = s.serve(ctx, ls)
		}
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			err = errors.New("metrics server stopped")
		}
		s.report(ListenerState{Err: err, NextAttempt: time.Now().Add(wait)})
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(2*wait, maxWait)
	}
}

func (s *Server) report(st ListenerState) {
	if s.OnState != nil {
		s.OnState(st)
	}
}

func (s *Server) open() ([]net.Listener, error) {
	if len(s.Activated) > 0 {
		// Serve each through a duplicate of its descriptor: closing the
		// duplicate after a failure leaves systemd's socket, and ours,
		// open for the next attempt.
		var ls []net.Listener
		for _, l := range s.Activated {
			d, err := duplicate(l)
			if err != nil {
				for _, o := range ls {
					_ = o.Close()
				}
				return nil, err
			}
			ls = append(ls, d)
		}
		return ls, nil
	}
	l, err := Listen(s.BindAddress)
	if err != nil {
		return nil, err
	}
	return []net.Listener{l}, nil
}

// serve serves on every listener until ctx is done (nil) or one fails
// (its error; the others are stopped).
func (s *Server) serve(ctx context.Context, ls []net.Listener) error {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var addrs []string
	for _, l := range ls {
		addrs = append(addrs, Address(l))
	}
	s.report(ListenerState{Addresses: addrs})
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	for _, l := range ls {
		wg.Go(func() {
			err := Serve(sctx, l, s.Handler)
			if err == nil && sctx.Err() == nil {
				err = fmt.Errorf("metrics server on %s stopped", Address(l))
			}
			if err != nil {
				once.Do(func() { first = err })
				cancel()
			}
		})
	}
	wg.Wait()
	if ctx.Err() != nil {
		return nil
	}
	return first
}

func duplicate(l net.Listener) (net.Listener, error) {
	fl, ok := l.(interface{ File() (*os.File, error) })
	if !ok {
		return nil, fmt.Errorf("unable to use the socket-activated listener %s: %T has no descriptor", Address(l), l)
	}
	f, err := fl.File()
	if err != nil {
		return nil, fmt.Errorf("unable to duplicate the socket-activated listener %s: %w", Address(l), err)
	}
	defer f.Close()
	d, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("unable to use the socket-activated listener %s: %w", Address(l), err)
	}
	return d, nil
}
