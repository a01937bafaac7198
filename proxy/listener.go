package proxy

import (
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// NewIdleListener wraps ln so each accepted connection is closed after idle
// without traffic in either direction. http.Server timeouts stop applying
// once goproxy hijacks a connection for a tunnel or MITM; this one does not.
// The wrapped connections keep CloseRead/CloseWrite, so goproxy still
// half-closes tunnels cleanly.
func NewIdleListener(ln net.Listener, idle time.Duration) net.Listener {
	if idle <= 0 {
		return ln
	}
	return &idleListener{Listener: ln, idle: idle}
}

type idleListener struct {
	net.Listener
	idle time.Duration
}

func (l *idleListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	ic := &idleConn{Conn: c, idle: l.idle}
	ic.touch()
	if tc, ok := c.(*net.TCPConn); ok {
		return &idleTCPConn{idleConn: ic, tcp: tc}, nil
	}
	return ic, nil
}

// idleConn refreshes its deadlines on every Read and Write. A read that
// times out while the other direction was active recently (a long download
// with a silent client) is retried, so only real idleness closes the
// connection. Deadlines set by someone else (net/http aborting a background
// read with a deadline in the past) are honoured: the effective deadline is
// the earlier of theirs and now+idle, and the retry loop stops when theirs
// changed or passed.
type idleConn struct {
	net.Conn
	idle time.Duration
	last atomic.Int64 // unix nanos of the last successful read or write

	mu       sync.Mutex
	gen      int64     // bumped by every external read deadline
	extRead  time.Time // external read deadline, zero = none
	extWrite time.Time // external write deadline, zero = none
}

func (c *idleConn) touch() { c.last.Store(time.Now().UnixNano()) }

func earlier(ext, idle time.Time) time.Time {
	if !ext.IsZero() && ext.Before(idle) {
		return ext
	}
	return idle
}

func (c *idleConn) Read(b []byte) (int, error) {
	for {
		c.mu.Lock()
		gen, ext := c.gen, c.extRead
		_ = c.Conn.SetReadDeadline(earlier(ext, time.Now().Add(c.idle)))
		c.mu.Unlock()
		n, err := c.Conn.Read(b)
		if n > 0 {
			c.touch()
		}
		if err != nil && n == 0 && errors.Is(err, os.ErrDeadlineExceeded) {
			c.mu.Lock()
			same := c.gen == gen && (ext.IsZero() || time.Now().Before(ext))
			c.mu.Unlock()
			if same && time.Since(time.Unix(0, c.last.Load())) < c.idle {
				continue // the write side was busy: not idle
			}
		}
		return n, err
	}
}

func (c *idleConn) Write(b []byte) (int, error) {
	c.mu.Lock()
	_ = c.Conn.SetWriteDeadline(earlier(c.extWrite, time.Now().Add(c.idle)))
	c.mu.Unlock()
	n, err := c.Conn.Write(b)
	if n > 0 {
		c.touch()
	}
	return n, err
}

func (c *idleConn) SetDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	c.extRead, c.extWrite = t, t
	now := time.Now()
	_ = c.Conn.SetWriteDeadline(earlier(t, now.Add(c.idle)))
	return c.Conn.SetReadDeadline(earlier(t, now.Add(c.idle)))
}

func (c *idleConn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	c.extRead = t
	return c.Conn.SetReadDeadline(earlier(t, time.Now().Add(c.idle)))
}

func (c *idleConn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.extWrite = t
	return c.Conn.SetWriteDeadline(earlier(t, time.Now().Add(c.idle)))
}

// idleTCPConn keeps the half-close methods of *net.TCPConn.
type idleTCPConn struct {
	*idleConn
	tcp *net.TCPConn
}

func (c *idleTCPConn) CloseRead() error  { return c.tcp.CloseRead() }
func (c *idleTCPConn) CloseWrite() error { return c.tcp.CloseWrite() }
