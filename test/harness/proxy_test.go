package harness

import (
	"bufio"
	"net"
	"testing"
	"time"
)

// TestTCPProxy checks that the proxy forwards, that Cut drops the
// connections through it and refuses new ones, and that Restore forwards
// again.
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
}
