package harness

import (
	"io"
	"net"
	"sync"
	"testing"
)

// TCPProxy forwards TCP connections to a target address, and can cut them
// off as a network does: Cut drops every connection and every new one
// until Restore.
type TCPProxy struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]bool
}

// StartTCPProxy starts a TCPProxy to target ("host:port") on 127.0.0.1
// until the test ends.
func StartTCPProxy(tb testing.TB, target string) *TCPProxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &TCPProxy{ln: ln, target: target, conns: map[net.Conn]bool{}}
	go p.serve()
	tb.Cleanup(func() {
		_ = ln.Close()
		p.Cut()
	})
	return p
}

// Addr is the proxy's address ("127.0.0.1:port").
func (p *TCPProxy) Addr() string { return p.ln.Addr().String() }

// Cut closes every connection through the proxy, and every new one as soon
// as it is accepted, until Restore.
func (p *TCPProxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for c := range p.conns {
		_ = c.Close()
	}
	clear(p.conns)
}

// Restore forwards new connections again.
func (p *TCPProxy) Restore() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = false
}

// track records c as open, unless the proxy is cut.
func (p *TCPProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut {
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

func (p *TCPProxy) serve() {
	for {
		in, err := p.ln.Accept()
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
	go func() { _, _ = io.Copy(out, in); done <- struct{}{} }()
	go func() { _, _ = io.Copy(in, out); done <- struct{}{} }()
	<-done // either side gone: both are closed on return
}
