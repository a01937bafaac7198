package ledger_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"pollgate/audit"
	"pollgate/ledger"
	"pollgate/rules"
)

func openBolt(sync bool) opener {
	return func(t *testing.T, cfg storeConfig) ledger.Store {
		t.Helper()
		s, err := ledger.OpenBolt(t.TempDir(), ledger.BoltOptions{Retention: cfg.Retention, AuditKey: cfg.AuditKey, NoSync: !sync})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
}

func TestBoltConformance(t *testing.T) {
	// fsync off for speed: the crash test and the benchmark run with fsync on.
	runConformance(t, openBolt(false))
}

func TestBoltSecondOpenFails(t *testing.T) {
	dir := t.TempDir()
	s, err := ledger.OpenBolt(dir, ledger.BoltOptions{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	st, err := os.Stat(dir + "/" + ledger.BoltFile)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("ledger file mode %v, %v; want 0600", st.Mode().Perm(), err)
	}
	start := time.Now()
	_, err = ledger.OpenBolt(dir, ledger.BoltOptions{LockTimeout: 100 * time.Millisecond})
	if err == nil {
		t.Fatal("a second OpenBolt on the same directory succeeded")
	}
	if !errors.Is(err, ledger.ErrUnavailable) || !strings.Contains(err.Error(), dir) ||
		!strings.Contains(err.Error(), "only one pollgate process may use a data directory") {
		t.Fatalf("unclear error: %v", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("second open waited %v", d)
	}
}

func TestBoltReopenKeepsRecords(t *testing.T) {
	dir := t.TempDir()
	s, err := ledger.OpenBolt(dir, ledger.BoltOptions{AuditKey: testKey})
	if err != nil {
		t.Fatal(err)
	}
	k := ledger.KeyOf(mustCreate(t, s, newOp("op_1", "job_1")))
	mustReserve(t, s, k, t0.Add(time.Second), ledger.Reserved)
	s.Close()
	s, err = ledger.OpenBolt(dir, ledger.BoltOptions{AuditKey: testKey})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	op, err := s.Get(context.Background(), k)
	if err != nil || op.Used.StatusRequests != 1 {
		t.Fatalf("after reopen: %+v %v", op, err)
	}
}

// A step queued behind a failing transaction fails with ErrUnavailable and
// writes nothing; the store recovers for later steps.
func TestBoltGroupCommitConcurrentResults(t *testing.T) {
	s := openBolt(true)(t, storeConfig{})
	ctx := context.Background()
	k := ledger.KeyOf(mustCreate(t, s, newOp("op_g", "job_g")))
	// Mixed outcomes in one batch: each step gets its own result.
	var wg sync.WaitGroup
	errs := make([]error, 40)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i%2 == 0 {
				_, errs[i] = s.Reserve(ctx, k, "w", time.Minute, t0.Add(time.Second))
			} else {
				_, errs[i] = s.Update(ctx, "missing", t0, nil)
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if i%2 == 0 && err != nil {
			t.Fatalf("reserve %d: %v", i, err)
		}
		if i%2 == 1 && !errors.Is(err, ledger.ErrNotFound) {
			t.Fatalf("update %d: %v", i, err)
		}
	}
	op, _ := s.Get(ctx, k)
	if op.Used.StatusRequests != 1 || op.Used.EarlyPolls != 19 {
		t.Fatalf("used %+v, want 1 reservation and 19 busy", op.Used)
	}
}

const crashEnv = "POLLGATE_TEST_LEDGER_CRASH_DIR"

// TestBoltCrashChild is the child half of TestBoltCrashBetweenReserveAndComplete.
func TestBoltCrashChild(t *testing.T) {
	dir := os.Getenv(crashEnv)
	if dir == "" {
		t.Skip("child process of TestBoltCrashBetweenReserveAndComplete")
	}
	s, err := ledger.OpenBolt(dir, ledger.BoltOptions{})
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

// R11, R21, R22: a process killed between Reserve and Complete leaves the
// counter incremented and the lease expiring; the budget is not reset.
func TestBoltCrashBetweenReserveAndComplete(t *testing.T) {
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestBoltCrashChild$", "-test.v=false")
	cmd.Env = append(os.Environ(), crashEnv+"="+dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "reserved" {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("child said %q, %v", line, err)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()

	s, err := ledger.OpenBolt(dir, ledger.BoltOptions{})
	if err != nil {
		t.Fatalf("reopen after SIGKILL: %v", err)
	}
	defer s.Close()
	ctx := context.Background()
	op, err := s.GetByID(ctx, "op_crash")
	if err != nil {
		t.Fatal(err)
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

// The sweeper runs on the injected clock and stops with its context.
func TestBoltRunSweeper(t *testing.T) {
	s, err := ledger.OpenBolt(t.TempDir(), ledger.BoltOptions{NoSync: true, Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	op := newOp("op_old", "job_old")
	op.Phase = rules.PhaseClosed
	mustCreate(t, s, op)
	ctx, cancel := context.WithCancel(context.Background())
	var clock atomic.Int64
	clock.Store(t0.Add(30 * time.Minute).UnixNano())
	stopped := make(chan struct{})
	go func() {
		s.RunSweeper(ctx, time.Millisecond, func() time.Time { return time.Unix(0, clock.Load()) })
		close(stopped)
	}()
	time.Sleep(20 * time.Millisecond)
	if _, err := s.GetByID(ctx, "op_old"); err != nil {
		t.Fatalf("swept inside retention: %v", err)
	}
	clock.Store(t0.Add(2 * time.Hour).UnixNano())
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := s.GetByID(ctx, "op_old"); errors.Is(err, ledger.ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("sweeper did not remove the expired operation")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	<-stopped
}
