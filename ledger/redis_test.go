package ledger_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"pollgate/audit"
	"pollgate/ledger"
	"pollgate/rules"
)

var prefixSeq atomic.Int64

// uniquePrefix keeps tests on a shared server apart.
func uniquePrefix() string {
	return fmt.Sprintf("pgtest%d-%d", time.Now().UnixNano(), prefixSeq.Add(1))
}

func openMiniredis(t *testing.T, cfg storeConfig) ledger.Store {
	t.Helper()
	m := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	c.AddHook(sameSlotHook{t})
	s := ledger.NewRedisStore(c, ledger.RedisOptions{Retention: cfg.Retention, AuditKey: cfg.AuditKey, Prefix: uniquePrefix()})
	t.Cleanup(func() { s.Close() })
	return s
}

// realRedisURL returns POLLGATE_TEST_REDIS_URL, skipping (or failing in
// strict mode) when it is not set.
func realRedisURL(t testing.TB) string {
	t.Helper()
	url := os.Getenv("POLLGATE_TEST_REDIS_URL")
	if url == "" {
		if os.Getenv("POLLGATE_TEST_STRICT") == "1" {
			t.Fatal("POLLGATE_TEST_STRICT=1 but POLLGATE_TEST_REDIS_URL is not set (a real redis-server is required)")
		}
		t.Skip("real Redis tests skipped: set POLLGATE_TEST_REDIS_URL=redis://127.0.0.1:6379/0 to run them")
	}
	return url
}

func openRealRedis(t *testing.T, cfg storeConfig) ledger.Store {
	t.Helper()
	url, prefix := realRedisURL(t), uniquePrefix()
	s, err := ledger.OpenRedis(context.Background(), url,
		ledger.RedisOptions{Retention: cfg.Retention, AuditKey: cfg.AuditKey, Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.Close()
		dropPrefix(t, url, prefix)
	})
	return s
}

// dropPrefix deletes a test's keys from a shared server.
func dropPrefix(t testing.TB, url, prefix string) {
	o, err := redis.ParseURL(url)
	if err != nil {
		t.Error(err)
		return
	}
	c := redis.NewClient(o)
	defer c.Close()
	ctx := context.Background()
	iter := c.Scan(ctx, 0, prefix+":*", 1000).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	for len(keys) > 0 {
		n := min(len(keys), 500)
		if err := c.Del(ctx, keys[:n]...).Err(); err != nil {
			t.Errorf("failed to clean up test keys: %v", err)
			return
		}
		keys = keys[n:]
	}
}

func TestRedisConformance(t *testing.T) {
	t.Run("miniredis", func(t *testing.T) { runConformance(t, openMiniredis) })
	t.Run("redis-server", func(t *testing.T) {
		realRedisURL(t)
		runConformance(t, openRealRedis)
	})
}

// Redis down: every step fails with ErrUnavailable.
func TestRedisDownIsUnavailable(t *testing.T) {
	m := miniredis.RunT(t)
	s := ledger.NewRedisStore(redis.NewClient(&redis.Options{Addr: m.Addr(), MaxRetries: -1}), ledger.RedisOptions{})
	defer s.Close()
	ctx := context.Background()
	k := ledger.KeyOf(mustCreate(t, s, newOp("op_d", "job_d")))
	addr := m.Addr()
	m.Close()
	if _, err := s.Reserve(ctx, k, "w", time.Second, t0); !errors.Is(err, ledger.ErrUnavailable) {
		t.Fatalf("Reserve with Redis down: %v", err)
	}
	if _, _, err := s.Create(ctx, newOp("op_d2", "job_d2"), entry("created", t0)); !errors.Is(err, ledger.ErrUnavailable) {
		t.Fatalf("Create with Redis down: %v", err)
	}
	if err := s.Ping(ctx); !errors.Is(err, ledger.ErrUnavailable) {
		t.Fatalf("Ping with Redis down: %v", err)
	}
	if _, err := ledger.OpenRedis(ctx, "redis://:s3cret@"+addr+"/0", ledger.RedisOptions{}); !errors.Is(err, ledger.ErrUnavailable) || strings.Contains(err.Error(), "s3cret") {
		t.Fatalf("OpenRedis with Redis down: %v (must wrap ErrUnavailable, never show the password)", err)
	}
	if _, err := ledger.OpenRedis(ctx, "http://:s3cret@x", ledger.RedisOptions{}); err == nil || strings.Contains(err.Error(), "s3cret") {
		t.Fatalf("bad URL: %v", err)
	}
}

// roundTrips counts commands and pipelines sent to Redis.
type roundTrips struct{ n atomic.Int64 }

func (r *roundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }
func (r *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { r.n.Add(1); return next(ctx, cmd) }
}
func (r *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error { r.n.Add(1); return next(ctx, cmds) }
}

// A governed status call costs two Redis round trips: one Reserve script,
// one Complete script.
func TestRedisRoundTripsPerStatusCall(t *testing.T) {
	for _, real := range []bool{false, true} {
		name := "miniredis"
		if real {
			name = "redis-server"
		}
		t.Run(name, func(t *testing.T) {
			var c *redis.Client
			prefix := uniquePrefix()
			if real {
				url := realRedisURL(t)
				o, err := redis.ParseURL(url)
				if err != nil {
					t.Fatal(err)
				}
				c = redis.NewClient(o)
				t.Cleanup(func() { dropPrefix(t, url, prefix) })
			} else {
				c = redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
			}
			s := ledger.NewRedisStore(c, ledger.RedisOptions{Prefix: prefix})
			defer s.Close()
			ctx := context.Background()
			op := newOp("op_rt", "job_rt")
			op.Budget.StatusRequests = 1000
			k := ledger.KeyOf(mustCreate(t, s, op))
			call := func(i int) {
				now := t0.Add(time.Duration(i) * time.Second)
				r := mustReserve(t, s, k, now, ledger.Reserved)
				if _, err := s.Complete(ctx, r, r.Op, entry("polled", now)); err != nil {
					t.Fatal(err)
				}
			}
			call(1) // loads the scripts (EVALSHA, NOSCRIPT, EVAL)
			var rt roundTrips
			c.AddHook(&rt)
			const calls = 100
			for i := range calls {
				call(i + 2)
			}
			if got := float64(rt.n.Load()) / calls; got != 2 {
				t.Fatalf("%.2f round trips per governed status call, want 2", got)
			}
			t.Logf("%s: %d round trips for %d governed status calls", name, rt.n.Load(), calls)
		})
	}
}

// --- a redis-server of our own (crash test, config warnings) ----------------

type redisServer struct {
	bin, dir, addr string
	args           []string
	cmd            *exec.Cmd
}

func redisServerBinary(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("POLLGATE_TEST_REDIS_SERVER")
	if bin == "" {
		bin, _ = exec.LookPath("redis-server")
	}
	if bin == "" {
		skipOrFail(t, "redis-server not found: install it (apt-get install -y redis-server) or set POLLGATE_TEST_REDIS_SERVER")
	}
	return bin
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func startRedisServer(t *testing.T, extra ...string) *redisServer {
	t.Helper()
	r := &redisServer{bin: redisServerBinary(t), dir: t.TempDir(), addr: freePort(t), args: extra}
	r.start(t)
	t.Cleanup(func() { r.kill() })
	return r
}

func (r *redisServer) start(t *testing.T) {
	t.Helper()
	_, port, _ := net.SplitHostPort(r.addr)
	args := append([]string{"--port", port, "--bind", "127.0.0.1", "--dir", r.dir, "--save", ""}, r.args...)
	r.cmd = exec.Command(r.bin, args...)
	r.cmd.Stdout, r.cmd.Stderr = io.Discard, io.Discard
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(&redis.Options{Addr: r.addr})
	defer c.Close()
	for i := 0; ; i++ {
		if c.Ping(context.Background()).Err() == nil {
			return
		}
		if i > 100 {
			t.Fatalf("redis-server on %s did not start", r.addr)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (r *redisServer) kill() {
	if r.cmd != nil && r.cmd.Process != nil {
		r.cmd.Process.Signal(syscall.SIGKILL)
		r.cmd.Wait()
		r.cmd = nil
	}
}

func TestRedisConfigWarnings(t *testing.T) {
	srv := startRedisServer(t, "--appendonly", "no", "--maxmemory-policy", "allkeys-lru")
	var logs bytes.Buffer
	s, err := ledger.OpenRedis(context.Background(), "redis://"+srv.addr+"/0",
		ledger.RedisOptions{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	out := logs.String()
	if !strings.Contains(out, "maxmemory-policy") || !strings.Contains(out, "noeviction") || !strings.Contains(out, "appendonly") {
		t.Fatalf("missing warnings for allkeys-lru and appendonly no:\n%s", out)
	}
	// miniredis has no CONFIG: tolerated, no warning.
	m := miniredis.RunT(t)
	logs.Reset()
	s2, err := ledger.OpenRedis(context.Background(), "redis://"+m.Addr(), ledger.RedisOptions{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	s2.Close()
	if strings.Contains(logs.String(), "WARN") {
		t.Fatalf("warning without CONFIG: %s", logs.String())
	}
}

const crashRedisEnv = "POLLGATE_TEST_LEDGER_CRASH_REDIS"

// TestRedisCrashChild is the child half of TestRedisCrashBetweenReserveAndComplete.
func TestRedisCrashChild(t *testing.T) {
	url := os.Getenv(crashRedisEnv)
	if url == "" {
		t.Skip("child process of TestRedisCrashBetweenReserveAndComplete")
	}
	s, err := ledger.OpenRedis(context.Background(), url, ledger.RedisOptions{})
	if err != nil {
		fmt.Println("error", err)
		os.Exit(1)
	}
	k := ledger.KeyOf(mustCreate(t, s, newOp("op_crash", "job_crash")))
	r, err := s.Reserve(context.Background(), k, "child", 30*time.Second, t0.Add(time.Second))
	if err != nil || r.Outcome != ledger.Reserved {
		fmt.Println("error", r.Outcome, err)
		os.Exit(1)
	}
	fmt.Println("reserved")
	time.Sleep(time.Minute) // killed here, before Complete
	os.Exit(3)
}

// R11, R21: the proxy and redis-server both killed with SIGKILL between
// Reserve and Complete; after redis-server restarts on its AOF, the counter
// is still incremented and the lease still expiring.
func TestRedisCrashBetweenReserveAndComplete(t *testing.T) {
	srv := startRedisServer(t, "--appendonly", "yes", "--appendfsync", "always")
	url := "redis://" + srv.addr + "/0"
	cmd := exec.Command(os.Args[0], "-test.run=^TestRedisCrashChild$")
	cmd.Env = append(os.Environ(), crashRedisEnv+"="+url)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	if err != nil || strings.TrimSpace(line) != "reserved" {
		t.Fatalf("child said %q, %v", line, err)
	}
	srv.kill()
	if _, err := os.Stat(filepath.Join(srv.dir, "appendonlydir")); err != nil {
		if _, err2 := os.Stat(filepath.Join(srv.dir, "appendonly.aof")); err2 != nil {
			t.Fatalf("no AOF in %s: %v", srv.dir, err)
		}
	}
	srv.start(t)

	s, err := ledger.OpenRedis(context.Background(), url, ledger.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	op, err := s.GetByID(ctx, "op_crash")
	if err != nil {
		t.Fatalf("record lost after redis-server restart: %v", err)
	}
	if op.Used.StatusRequests != 1 || op.Lease.Fence != 1 || op.Lease.Holder != "child" ||
		!op.Lease.ExpiresAt.Equal(t0.Add(31*time.Second)) || op.AuditCount != 1 {
		t.Fatalf("record after crash: used %+v lease %+v audit %d", op.Used, op.Lease, op.AuditCount)
	}
	k := ledger.KeyOf(op)
	mustReserve(t, s, k, t0.Add(10*time.Second), ledger.Busy)
	r := mustReserve(t, s, k, t0.Add(32*time.Second), ledger.Reserved)
	if r.Fence != 2 || r.Op.Used.StatusRequests != 2 {
		t.Fatalf("after lease expiry: fence %d used %d, want 2 and 2 (budget not reset)", r.Fence, r.Op.Used.StatusRequests)
	}
	var buf bytes.Buffer
	if err := s.Export(ctx, &buf); err != nil {
		t.Fatal(err)
	}
	if rep, err := audit.Verify(&buf); err != nil || !rep.OK() || rep.Entries != 1 {
		t.Fatalf("audit after crash: %+v %v", rep, err)
	}
}

// benchRedisStore is the real server when POLLGATE_TEST_REDIS_URL is set,
// else miniredis.
func benchRedisStore(b *testing.B) ledger.Store {
	if url := os.Getenv("POLLGATE_TEST_REDIS_URL"); url != "" {
		prefix := uniquePrefix()
		s, err := ledger.OpenRedis(context.Background(), url, ledger.RedisOptions{Prefix: prefix})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close(); dropPrefix(b, url, prefix) })
		return s
	}
	m := miniredis.NewMiniRedis()
	if err := m.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(m.Close)
	s := ledger.NewRedisStore(redis.NewClient(&redis.Options{Addr: m.Addr()}), ledger.RedisOptions{Prefix: uniquePrefix()})
	b.Cleanup(func() { s.Close() })
	return s
}

// Retention on Redis: a terminal operation's keys expire; a waiting one and
// one reopened by an extension (escalated -> waiting) do not.
func TestRedisRetentionExpiry(t *testing.T) {
	m := miniredis.RunT(t)
	s := ledger.NewRedisStore(redis.NewClient(&redis.Options{Addr: m.Addr()}), ledger.RedisOptions{Retention: time.Hour})
	defer s.Close()
	ctx := context.Background()
	done := newOp("op_done", "job_done")
	done.Phase = rules.PhaseSucceeded
	mustCreate(t, s, done)
	mustCreate(t, s, newOp("op_wait", "job_wait"))
	k := ledger.KeyOf(mustCreate(t, s, newOp("op_ext", "job_ext")))
	r := mustReserve(t, s, k, t0.Add(time.Second), ledger.Reserved)
	esc := r.Op.Clone()
	esc.Phase = rules.PhaseEscalated
	if _, err := s.Complete(ctx, r, esc, entry("escalated", t0.Add(2*time.Second))); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Update(ctx, "op_ext", t0.Add(time.Minute), func(op *rules.Operation) (audit.Entry, error) {
		op.Phase = rules.PhaseWaiting
		op.DeadlineAt = op.DeadlineAt.Add(15 * time.Minute)
		return audit.Entry{Event: "extended", Story: "extended"}, nil
	}); err != nil {
		t.Fatal(err)
	}
	m.FastForward(59 * time.Minute)
	if _, err := s.GetByID(ctx, "op_done"); err != nil {
		t.Fatalf("terminal operation expired before its retention: %v", err)
	}
	m.FastForward(2 * time.Minute)
	if _, err := s.GetByID(ctx, "op_done"); !errors.Is(err, ledger.ErrNotFound) {
		t.Fatalf("terminal operation kept past its retention: %v", err)
	}
	if envs, err := s.Audit(ctx, "op_done"); err == nil && len(envs) > 0 {
		t.Fatal("audit chain kept past retention")
	}
	for _, id := range []string{"op_wait", "op_ext"} {
		if op, err := s.GetByID(ctx, id); err != nil || op.Phase != rules.PhaseWaiting {
			t.Fatalf("%s: %v %v", id, op, err)
		}
	}
	if n, err := s.Sweep(ctx, t0); err != nil || n != 0 {
		t.Fatalf("Sweep = %d, %v", n, err)
	}
	p, err := s.List(ctx, ledger.Filter{})
	if err != nil || len(p.Operations) != 2 {
		t.Fatalf("List after expiry: %d operations, %v", len(p.Operations), err)
	}
}

// sameSlotHook fails the test when a script is called with keys of
// different hash tags: Redis Cluster would reject it with CROSSSLOT.
type sameSlotHook struct{ t *testing.T }

func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

func (h sameSlotHook) check(cmd redis.Cmder) {
	args := cmd.Args()
	name := strings.ToLower(fmt.Sprint(args[0]))
	if (name != "evalsha" && name != "eval") || len(args) < 3 {
		return
	}
	n, _ := args[2].(int)
	if n < 1 {
		h.t.Errorf("%s without KEYS: every key must be passed in KEYS", name)
		return
	}
	tag := hashTag(fmt.Sprint(args[3]))
	for _, k := range args[3 : 3+n] {
		if hashTag(fmt.Sprint(k)) != tag {
			h.t.Errorf("script keys in different hash slots: %v", args[3:3+n])
		}
	}
}

func (h sameSlotHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h sameSlotHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { h.check(cmd); return next(ctx, cmd) }
}
func (h sameSlotHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			h.check(c)
		}
		return next(ctx, cmds)
	}
}

// lostReply runs a command, then reports the connection as broken: the
// write happened but the caller never learns its result.
type lostReply struct{ on atomic.Bool }

func (h *lostReply) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *lostReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if h.on.Load() {
			cmd.SetErr(io.ErrUnexpectedEOF)
			return io.ErrUnexpectedEOF
		}
		return err
	}
}
func (h *lostReply) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// Fault injection "fail after persisting": a Reserve whose reply is lost
// returns ErrUnavailable, and the reservation stays counted (R9: an unused
// reservation is better than an invisible extra request); the next
// Reserve after the lease sees it.
func TestRedisLostReplyAfterReserve(t *testing.T) {
	m := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: m.Addr(), MaxRetries: -1})
	var h lostReply
	c.AddHook(&h)
	s := ledger.NewRedisStore(c, ledger.RedisOptions{})
	defer s.Close()
	ctx := context.Background()
	k := ledger.KeyOf(mustCreate(t, s, newOp("op_l", "job_l")))
	mustReserve(t, s, ledger.Key{Provider: "acme", JobID: "none"}, t0, ledger.NotFound) // loads the script
	h.on.Store(true)
	if _, err := s.Reserve(ctx, k, "w", 30*time.Second, t0.Add(time.Second)); !errors.Is(err, ledger.ErrUnavailable) {
		t.Fatalf("Reserve with a lost reply: %v, want ErrUnavailable", err)
	}
	h.on.Store(false)
	mustReserve(t, s, k, t0.Add(2*time.Second), ledger.Busy)
	r := mustReserve(t, s, k, t0.Add(32*time.Second), ledger.Reserved)
	if r.Op.Used.StatusRequests != 2 || r.Fence != 2 {
		t.Fatalf("after a lost reply: used %d fence %d, want 2 and 2", r.Op.Used.StatusRequests, r.Fence)
	}
}

// Sweep prunes a registry entry only when its record was missing twice, so
// a Create between its index and record steps is never dropped.
func TestRedisSweepPrunesRegistry(t *testing.T) {
	m := miniredis.RunT(t)
	s := ledger.NewRedisStore(redis.NewClient(&redis.Options{Addr: m.Addr()}), ledger.RedisOptions{Prefix: "pg"})
	defer s.Close()
	ctx := context.Background()
	mustCreate(t, s, newOp("op_1", "job_1"))
	mustCreate(t, s, newOp("op_2", "job_2"))
	var gone string
	for _, k := range m.Keys() {
		if strings.HasSuffix(k, ":op") {
			gone = k
			break
		}
	}
	m.Del(gone) // as if expired
	count := func() int {
		n, err := m.ZMembers("pg:{idx}:ops")
		if err != nil {
			t.Fatal(err)
		}
		return len(n)
	}
	for i, want := range []int{2, 1, 1} {
		if _, err := s.Sweep(ctx, t0); err != nil {
			t.Fatal(err)
		}
		if got := count(); got != want {
			t.Fatalf("after sweep %d: %d registry entries, want %d", i+1, got, want)
		}
	}
	if p, err := s.List(ctx, ledger.Filter{}); err != nil || len(p.Operations) != 1 {
		t.Fatalf("List: %d, %v", len(p.Operations), err)
	}
}
