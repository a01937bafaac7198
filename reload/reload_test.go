package reload

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pollgate/rules"
)

// contractYAML is a minimal valid contract whose policy differs by version.
func contractYAML(deadline string, maxRequests int) string {
	return fmt.Sprintf(`version: 1
defaults:
  policy:
    deadline: %s
    max_status_requests: %d
providers:
  - name: acme
    base_url: https://api.acme.test
    status:
      request: GET /v1/jobs/{job_id}
      state: status
      states:
        waiting: [queued, running]
        success: [done]
        failure: [failed]
`, deadline, maxRequests)
}

// Two problems, both must be logged.
const invalidYAML = `version: 1
providers:
  - name: acme
    base_url: ftp://api.acme.test
    status:
      request: GET /v1/jobs/{job_id}
      state: status
      states:
        waiting: [queued]
        success: [done]
    bogus_key: 1
`

// syncBuffer is a log sink safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	// Write and rename, as editors do, so a reader never sees half a file.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func setup(t *testing.T, content string) (string, *atomic.Pointer[rules.Contract]) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "providers.yaml")
	writeFile(t, path, content)
	c, err := rules.Load(path)
	if err != nil {
		t.Fatalf("initial contract: %v", err)
	}
	var p atomic.Pointer[rules.Contract]
	p.Store(c)
	return path, &p
}

// Live reload with valid and invalid edits while requests keep loading the
// contract: every reader sees a complete valid contract, an invalid edit
// keeps the old one with every problem logged, and the race detector
// watches the pointer.
func TestReloadWhileTrafficFlows(t *testing.T) {
	path, ptr := setup(t, contractYAML("40m", 12))
	v1 := ptr.Load().Hash
	logs := &syncBuffer{}
	var mu sync.Mutex
	var outcomes []string
	r, err := New(Config{Path: path, Contract: ptr, Interval: -1,
		Logger: slog.New(slog.NewJSONHandler(logs, nil)),
		OnReload: func(o string, _ *rules.Contract) {
			mu.Lock()
			outcomes = append(outcomes, o)
			mu.Unlock()
		}})
	if err != nil {
		t.Fatal(err)
	}

	// Traffic: readers that load the pointer once per "request" and use it.
	valid := sync.Map{}
	valid.Store(v1, true)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var requests atomic.Int64
	var bad atomic.Value
	u, _ := url.Parse("https://api.acme.test/v1/jobs/j1")
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				c := ptr.Load()
				m, ok := c.Match(http.MethodGet, u)
				if !ok || m.Kind != rules.KindStatus || m.JobID != "j1" {
					bad.Store(fmt.Sprintf("contract %s did not match a status call", c.Hash))
				}
				if _, ok := valid.Load(c.Hash); !ok {
					bad.Store("reader saw contract " + c.Hash + " that was never valid")
				}
				requests.Add(1)
			}
		}()
	}

	// Valid edit: applied.
	writeFile(t, path, contractYAML("40m", 20))
	v2 := hashOf([]byte(contractYAML("40m", 20)))
	valid.Store(v2, true)
	if out, err := r.Poll(); out != Applied || err != nil {
		t.Fatalf("valid edit: %s, %v", out, err)
	}
	if got := ptr.Load(); got.Hash != v2 || got.Providers[0].Policy.MaxStatusRequests != 20 {
		t.Fatalf("active contract %s max %d, want %s max 20", got.Hash, got.Providers[0].Policy.MaxStatusRequests, v2)
	}

	// Invalid edit: rejected, old contract kept, every problem logged.
	writeFile(t, path, invalidYAML)
	out, err := r.Poll()
	if out != Rejected || err == nil {
		t.Fatalf("invalid edit: %s, %v", out, err)
	}
	if ptr.Load().Hash != v2 {
		t.Fatalf("invalid edit replaced the contract")
	}
	ve := err.(interface{ Unwrap() error }).Unwrap().(*rules.ValidationError)
	if len(ve.Problems) < 2 {
		t.Fatalf("want at least 2 problems, got %v", ve.Problems)
	}
	logged := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var rec struct{ Problem string }
		if json.Unmarshal([]byte(line), &rec) == nil && rec.Problem != "" {
			logged[rec.Problem] = true
		}
	}
	for _, p := range ve.Problems {
		if !logged[p.String()] {
			t.Errorf("problem %q not logged", p.String())
		}
	}
	// Not reported again until it changes.
	if out, _ := r.Poll(); out != Unchanged {
		t.Errorf("second poll of the same invalid file: %s", out)
	}

	// SIGHUP through Run, with a valid file again.
	sig := make(chan os.Signal, 1)
	r2, _ := New(Config{Path: path, Contract: ptr, Interval: -1, Signals: sig,
		Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r2.Run(ctx); close(done) }()
	writeFile(t, path, contractYAML("2h", 30))
	v3 := hashOf([]byte(contractYAML("2h", 30)))
	valid.Store(v3, true)
	sig <- os.Interrupt // any value: the channel stands for SIGHUP
	for deadline := time.Now().Add(10 * time.Second); ptr.Load().Hash != v3; {
		if time.Now().After(deadline) {
			t.Fatal("signal did not reload the contract")
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	<-done

	close(stop)
	wg.Wait()
	if b := bad.Load(); b != nil {
		t.Fatal(b)
	}
	if requests.Load() == 0 {
		t.Fatal("no traffic ran during the reloads")
	}
	mu.Lock()
	defer mu.Unlock()
	if strings.Join(outcomes, ",") != "applied,error" {
		t.Errorf("outcomes %v, want [applied error]", outcomes)
	}
}

// Touching the file without changing it, or a signal with the same bytes,
// is not a reload.
func TestUnchangedFile(t *testing.T) {
	path, ptr := setup(t, contractYAML("40m", 12))
	before := ptr.Load()
	r, _ := New(Config{Path: path, Contract: ptr, Interval: -1, Logger: slog.New(slog.NewTextHandler(&syncBuffer{}, nil))})
	later := time.Now().Add(time.Hour)
	if err := os.Chtimes(path, later, later); err != nil {
		t.Fatal(err)
	}
	if out, _ := r.Poll(); out != Unchanged {
		t.Errorf("touched file: %s", out)
	}
	if out, _ := r.Reload("signal"); out != Unchanged {
		t.Errorf("signal with the same bytes: %s", out)
	}
	if ptr.Load() != before {
		t.Error("the contract pointer changed")
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if out, err := r.Reload("signal"); out != Rejected || err == nil {
		t.Errorf("missing file: %s %v", out, err)
	}
	if ptr.Load() != before {
		t.Error("a missing file replaced the contract")
	}
}

// A reload never changes an existing operation's authorized deadline or
// budgets (R24): they live on the record; the new contract's policy only
// shapes new operations.
func TestReloadKeepsExistingBudgets(t *testing.T) {
	path, ptr := setup(t, contractYAML("40m", 12))
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	rnd := rand.New(rand.NewPCG(1, 2))
	c1 := ptr.Load()
	op := rules.NewOperation(c1.ProviderByName("acme"), c1, "op_1", "j1", "acct", rules.OriginFirstStatusCal, now, rnd)

	r, _ := New(Config{Path: path, Contract: ptr, Interval: -1, Logger: slog.New(slog.NewTextHandler(&syncBuffer{}, nil))})
	writeFile(t, path, contractYAML("5m", 3))
	if out, err := r.Poll(); out != Applied {
		t.Fatalf("reload: %s %v", out, err)
	}
	c2 := ptr.Load()
	p2 := c2.ProviderByName("acme")

	// The next poll and its answer are decided under the new contract.
	d := rules.BeforeSend(p2, op, now.Add(time.Minute))
	if d.Action != rules.ActSend {
		t.Fatalf("before send: %s", d.Action)
	}
	d = rules.OnResponse(p2, d.Op, rules.Response{StatusCode: 200, Body: []byte(`{"status":"running"}`), At: now.Add(time.Minute)},
		now.Add(time.Minute), rnd)
	if d.Action != rules.ActWait {
		t.Fatalf("on response: %s (%s)", d.Action, d.Story)
	}
	if !d.Op.DeadlineAt.Equal(op.DeadlineAt) || d.Op.Budget != op.Budget {
		t.Errorf("reload changed the record: deadline %v -> %v, budget %+v -> %+v", op.DeadlineAt, d.Op.DeadlineAt, op.Budget, d.Op.Budget)
	}
	// A new operation gets the new limits.
	op2 := rules.NewOperation(p2, c2, "op_2", "j2", "acct", rules.OriginFirstStatusCal, now, rnd)
	if op2.Budget.StatusRequests != 3 || !op2.DeadlineAt.Equal(now.Add(5*time.Minute)) {
		t.Errorf("new operation: budget %d deadline %v", op2.Budget.StatusRequests, op2.DeadlineAt)
	}
}

// An in-place edit that keeps the size, right after the previous write
// (same coarse modification time), is still seen: recent files are hashed.
func TestInPlaceSameSizeEdit(t *testing.T) {
	path, ptr := setup(t, contractYAML("40m", 12))
	r, _ := New(Config{Path: path, Contract: ptr, Interval: -1, Logger: slog.New(slog.NewTextHandler(&syncBuffer{}, nil))})
	if err := os.WriteFile(path, []byte(contractYAML("40m", 13)), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := r.Poll(); out != Applied {
		t.Fatalf("in-place edit: %s %v", out, err)
	}
	if got := ptr.Load().Providers[0].Policy.MaxStatusRequests; got != 13 {
		t.Errorf("max status requests %d, want 13", got)
	}
}
