package harness

import (
	"bufio"
	"errors"
	"net"
	"syscall"
	"testing"
	"time"
)

// TestTCPProxy checks that the proxy forwards, that Cut drops the
// connections through it and new ones, that Refuse drops them and refuses
// new ones, that Restore forwards again after either, and that Delay
// holds what it forwards, both ways, until set back to 0.
func TestTCPProxy(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() { // echoes lines
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	p := StartTCPProxy(t, ln.Addr().String())
	echo := func(c net.Conn) error {
		if err := c.SetDeadline(time.Now().Add(2 * time.Second)); err != nil {
			return err
		}
		if _, err := c.Write([]byte("ping\n")); err != nil {
			return err
		}
		_, err := bufio.NewReader(c).ReadString('\n')
		return err
	}
	dial := func() net.Conn {
		t.Helper()
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}

	open := dial()
	if err := echo(open); err != nil {
		t.Fatalf("through the proxy: %v", err)
	}
	p.Cut()
	if err := echo(open); err == nil {
		t.Error("a connection open when the proxy was cut still works")
	}
	if err := echo(dial()); err == nil {
		t.Error("a connection made while the proxy is cut works")
	}
	p.Restore()
	if err := echo(dial()); err != nil {
		t.Errorf("a connection made after Restore: %v", err)
	}

	open = dial()
	if err := echo(open); err != nil {
		t.Fatalf("through the proxy: %v", err)
	}
	p.Refuse()
	if err := echo(open); err == nil {
		t.Error("a connection open when the proxy refused still works")
	}
	if c, err := net.Dial("tcp", p.Addr()); err == nil {
		c.Close()
		t.Error("a connection made while the proxy refuses was accepted")
	} else if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("a connection made while the proxy refuses: %v, want connection refused", err)
	}
	p.Restore()
	if err := echo(dial()); err != nil {
		t.Errorf("a connection made after Restore: %v", err)
	}

	const d = 300 * time.Millisecond
	open = dial()
	p.Delay(d)
	at := time.Now()
	if err := echo(open); err != nil {
		t.Fatalf("through the delaying proxy: %v", err)
	}
	if rtt := time.Since(at); rtt < 2*d {
		t.Errorf("a round trip through a proxy delaying %s took %s, want at least %s", d, rtt, 2*d)
	}
	p.Delay(0)
	at = time.Now()
	if err := echo(open); err != nil {
		t.Fatalf("through the proxy: %v", err)
	}
	if rtt := time.Since(at); rtt >= d {
		t.Errorf("a round trip through the proxy after Delay(0) took %s", rtt)
	}
}
