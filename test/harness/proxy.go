package harness

import (
	"net"
	"sync"
	"testing"
	"time"
)

// TCPProxy forwards TCP connections to a target address, and can fail
// them as a network does: Cut drops every connection and every new one,
// Refuse drops them and refuses new ones (as a host whose server is down),
// until Restore; Delay holds every byte forwarded for a while.
type TCPProxy struct {
	tb     testing.TB
	addr   string
	target string

	mu      sync.Mutex
	ln      net.Listener // nil while refusing
	cut     bool
	delay   time.Duration
	stopped bool
	conns   map[net.Conn]bool
}

// StartTCPProxy starts a TCPProxy to target ("host:port") on 127.0.0.1
// until the test ends.
func StartTCPProxy(tb testing.TB, target string) *TCPProxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &TCPProxy{tb: tb, addr: ln.Addr().String(), ln: ln, target: target, conns: map[net.Conn]bool{}}
	go p.serve(ln)
	tb.Cleanup(func() {
		p.Refuse()
		p.mu.Lock()
		p.stopped = true
		p.mu.Unlock()
	})
	return p
}

// Addr is the proxy's address ("127.0.0.1:port").
func (p *TCPProxy) Addr() string { return p.addr }

// Cut closes every connection through the proxy, and every new one as soon
// as it is accepted, until Restore.
func (p *TCPProxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	p.dropLocked()
}

// Refuse closes every connection through the proxy and stops listening:
// new connections are refused (ECONNREFUSED), as by a host whose server
// is down, until Restore.
func (p *TCPProxy) Refuse() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropLocked()
	if p.ln != nil {
		_ = p.ln.Close()
		p.ln = nil
	}
}

func (p *TCPProxy) dropLocked() {
	for c := range p.conns {
		_ = c.Close()
	}
	clear(p.conns)
}

// Delay makes the proxy hold every byte it forwards, in either direction
// and on every connection, d before passing it on (0: at once again). A
// byte already held keeps the delay it was read with, so that the
// stream's order is kept.
func (p *TCPProxy) Delay(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.delay = d
}

// Restore forwards new connections again, listening again on the same
// address after Refuse.
func (p *TCPProxy) Restore() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = false
	if p.ln != nil || p.stopped {
		return
	}
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		p.tb.Errorf("proxy to %s: unable to listen on %s again: %v", p.target, p.addr, err)
		return
	}
	p.ln = ln
	go p.serve(ln)
}

// track records c as open, unless the proxy is cut.
func (p *TCPProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut || p.ln == nil {
		return false
	}
	p.conns[c] = true
	return true
}

func (p *TCPProxy) untrack(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.conns, c)
}

func (p *TCPProxy) latency() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.delay
}

func (p *TCPProxy) serve(ln net.Listener) {
	for {
		in, err := ln.Accept()
		if err != nil {
			return
		}
		go p.forward(in)
	}
}

func (p *TCPProxy) forward(in net.Conn) {
	defer in.Close()
	if !p.track(in) {
		return
	}
	defer p.untrack(in)
	out, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer out.Close()
	if !p.track(out) {
		return
	}
	defer p.untrack(out)
	done := make(chan struct{}, 2)
	go func() { p.pipe(out, in); done <- struct{}{} }()
	go func() { p.pipe(in, out); done <- struct{}{} }()
	<-done // either side gone: both are closed on return
}

// pipe copies src to dst, each chunk held for the delay set when it was
// read, until either fails.
func (p *TCPProxy) pipe(dst, src net.Conn) {
	type chunk struct {
		b  []byte
		at time.Time
	}
	held := make(chan chunk, 64)
	go func() {
		defer close(held)
		for {
			b := make([]byte, 32<<10)
			n, err := src.Read(b)
			if n > 0 {
				held <- chunk{b[:n], time.Now().Add(p.latency())}
			}
			if err != nil {
				return
			}
		}
	}()
	failed := false
	for c := range held {
		if failed {
			continue // drained, so that the reader ends with src
		}
		time.Sleep(time.Until(c.at))
		if _, err := dst.Write(c.b); err != nil {
			failed = true
			_ = src.Close()
		}
	}
}
