package proxy

import (
	"io"
	"net"
	"testing"
	"time"
)

// Tunnels ignore http.Server timeouts after hijack; the idle listener
// closes a connection nobody uses, but not one that is busy in only one
// direction.
func TestIdleListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	idle := NewIdleListener(ln, 300*time.Millisecond)
	defer idle.Close()
	go func() {
		for {
			c, err := idle.Accept()
			if err != nil {
				return
			}
			if _, ok := c.(interface{ CloseWrite() error }); !ok {
				t.Error("wrapped TCP conn lost CloseWrite")
			}
			go func(c net.Conn) {
				defer c.Close()
				var b [1]byte
				if _, err := c.Read(b[:]); err != nil {
					return // idle: closed by the deadline
				}
				// "download": write for 1s while the client stays silent.
				for end := time.Now().Add(time.Second); time.Now().Before(end); {
					if _, err := c.Write([]byte("x")); err != nil {
						return
					}
					time.Sleep(20 * time.Millisecond)
				}
				c.Read(b[:]) // then idle: closed by the deadline
			}(c)
		}
	}()

	// An idle connection is closed after about the idle time.
	c1, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	c1.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c1.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("idle conn: read err %v, want EOF", err)
	}
	if took := time.Since(start); took < 250*time.Millisecond || took > 3*time.Second {
		t.Fatalf("idle conn closed after %s, want about 300ms", took)
	}

	// A connection busy in one direction stays open past the idle time.
	c2, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	c2.Write([]byte("go"))
	c2.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, err := io.Copy(io.Discard, c2)
	if n < 30 {
		t.Fatalf("download cut after %d bytes (err %v): one-way traffic counted as idle", n, err)
	}
}
