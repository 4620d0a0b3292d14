// Package connectproxy is a real HTTP CONNECT proxy on 127.0.0.1 for tests:
// it tunnels TCP to the host a CONNECT request names, counts the tunnels it
// opened by target, and can require Basic proxy authorization.
package connectproxy

import (
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"testing"
	"time"
)

// Proxy is a running CONNECT proxy.
type Proxy struct {
	// URL is the proxy's http://127.0.0.1:port URL, without credentials.
	URL *url.URL

	srv      *httptest.Server
	user     string
	password string

	mu      sync.Mutex
	tunnels map[string]int
	refused int
	conns   []net.Conn
}

// Option configures a Proxy.
type Option func(*Proxy)

// WithBasicAuth makes the proxy answer 407 to a CONNECT without these
// credentials.
func WithBasicAuth(user, password string) Option {
	return func(p *Proxy) { p.user, p.password = user, password }
}

// Start starts a proxy that stops when the test ends.
func Start(tb testing.TB, opts ...Option) *Proxy {
	tb.Helper()
	p := &Proxy{tunnels: map[string]int{}}
	for _, o := range opts {
		o(p)
	}
	p.srv = httptest.NewServer(http.HandlerFunc(p.serve))
	u, err := url.Parse(p.srv.URL)
	if err != nil {
		tb.Fatal(err)
	}
	p.URL = u
	tb.Cleanup(p.Close)
	return p
}

// Close stops the proxy and cuts its tunnels.
func (p *Proxy) Close() {
	p.srv.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

// Tunnels returns how many tunnels the proxy opened to target (host:port).
func (p *Proxy) Tunnels(target string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.tunnels[target]
}

// Total returns how many tunnels the proxy opened, to any target.
func (p *Proxy) Total() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, v := range p.tunnels {
		n += v
	}
	return n
}

// Refused returns how many requests the proxy refused (not CONNECT, or
// without the credentials it requires).
func (p *Proxy) Refused() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.refused
}

func (p *Proxy) refuse(w http.ResponseWriter, code int) {
	p.mu.Lock()
	p.refused++
	p.mu.Unlock()
	if code == http.StatusProxyAuthRequired {
		w.Header().Set("Proxy-Authenticate", `Basic realm="test"`)
	}
	http.Error(w, http.StatusText(code), code)
}

func (p *Proxy) serve(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodConnect {
		p.refuse(w, http.StatusMethodNotAllowed)
		return
	}
	if p.user != "" {
		want := "Basic " + base64.StdEncoding.EncodeToString([]byte(p.user+":"+p.password))
		if r.Header.Get("Proxy-Authorization") != want {
			p.refuse(w, http.StatusProxyAuthRequired)
			return
		}
	}
	upstream, err := net.DialTimeout("tcp", r.Host, 5*time.Second)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	client, buffered, err := http.NewResponseController(w).Hijack()
	if err != nil {
		_ = upstream.Close()
		return
	}
	p.mu.Lock()
	p.tunnels[r.Host]++
	p.conns = append(p.conns, client, upstream)
	p.mu.Unlock()
	if _, err := io.WriteString(client, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		_ = client.Close()
		_ = upstream.Close()
		return
	}
	go func() {
		// What the client sent past the CONNECT request is in buffered.
		_, _ = io.Copy(upstream, buffered)
		_ = upstream.Close()
	}()
	go func() {
		_, _ = io.Copy(client, upstream)
		_ = client.Close()
	}()
}
