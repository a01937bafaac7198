package notify

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pollgate/rules"
)

// outcomes counts OnOutcome calls and lets a test wait for one.
type outcomes struct {
	mu sync.Mutex
	n  map[string]int
	ch chan string
}

func newOutcomes() *outcomes { return &outcomes{n: map[string]int{}, ch: make(chan string, 100)} }

func (o *outcomes) record(s string) {
	o.mu.Lock()
	o.n[s]++
	o.mu.Unlock()
	o.ch <- s
}

func (o *outcomes) get(s string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.n[s]
}

func (o *outcomes) waitFor(t *testing.T, want string) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case got := <-o.ch:
			if got == want {
				return
			}
		case <-timeout:
			t.Fatalf("timed out waiting for outcome %q", want)
		}
	}
}

// sleeps records the backoff delays without waiting.
type sleeps struct {
	mu sync.Mutex
	d  []time.Duration
}

func (s *sleeps) sleep(ctx context.Context, d time.Duration) error {
	s.mu.Lock()
	s.d = append(s.d, d)
	s.mu.Unlock()
	return ctx.Err()
}

func (s *sleeps) got() []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]time.Duration(nil), s.d...)
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func escalatedOp() *rules.Operation {
	at := time.Date(2026, 12, 2, 10, 58, 0, 0, time.UTC)
	return &rules.Operation{
		ID: "op_123", Provider: "acme", JobID: "exp_71c", LastState: "running", LastHTTP: 200,
		StartedAt: at.Add(-38 * time.Minute), DeadlineAt: at.Add(2 * time.Minute),
		Budget: rules.Budget{StatusRequests: 12}, Used: rules.Counters{StatusRequests: 12},
		Phase: rules.PhaseEscalated,
		Escalation: &rules.Escalation{
			Reason:  rules.ReasonRequestBudgetExhausted,
			Message: "Operation op_123 (acme job exp_71c) stopped:\nrequest budget exhausted after 12 of 12 status requests.",
			Options: []rules.Option{
				{Action: "extend", Duration: 15 * time.Minute, DurationText: "15m0s", StatusRequests: 4, Description: "extend once by 15m with 4 more status requests"},
				{Action: "close", Description: "close the operation"},
			},
			At: at,
		},
	}
}

// R18: the receiver gets the message and the bounded options, plus a
// Slack-compatible one-paragraph text.
func TestDeliversMessageAndOptions(t *testing.T) {
	var got atomic.Pointer[Message]
	var ctype atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var m Message
		if err := json.NewDecoder(r.Body).Decode(&m); err != nil {
			t.Errorf("receiver: bad JSON: %v", err)
		}
		ctype.Store(r.Header.Get("Content-Type"))
		got.Store(&m)
	}))
	defer srv.Close()

	oc := newOutcomes()
	n := New(Config{OnOutcome: oc.record, Logger: quietLogger()})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n.Start(ctx)

	c := &rules.Contract{Notify: &rules.NotifySpec{Webhook: srv.URL + "/hook"}}
	if !n.Escalated(c, escalatedOp()) {
		t.Fatal("Escalated returned false with a default webhook configured")
	}
	oc.waitFor(t, OutcomeDelivered)
	m := got.Load()
	if m == nil {
		t.Fatal("receiver got nothing")
	}
	if ctype.Load() != "application/json" {
		t.Errorf("content type %v", ctype.Load())
	}
	if m.Reason != rules.ReasonRequestBudgetExhausted || m.OperationID != "op_123" || m.ProviderJobID != "exp_71c" {
		t.Errorf("wrong fields: %+v", m)
	}
	if len(m.Options) != 2 || m.Options[0].Action != "extend" || m.Options[0].StatusRequests != 4 || m.Options[0].DurationText != "15m0s" {
		t.Errorf("options not carried: %+v", m.Options)
	}
	if strings.Contains(m.Text, "\n") {
		t.Errorf("text is not one paragraph: %q", m.Text)
	}
	for _, want := range []string{"acme", "exp_71c", "request_budget_exhausted", "extend once by 15m", "pollgate ops show op_123"} {
		if !strings.Contains(m.Text, want) {
			t.Errorf("text %q lacks %q", m.Text, want)
		}
	}
}

func TestWebhookForPrefersProvider(t *testing.T) {
	c := &rules.Contract{
		Notify: &rules.NotifySpec{Webhook: "http://default"},
		Providers: []*rules.Provider{
			{Name: "a", Notify: &rules.NotifySpec{Webhook: "http://a"}},
			{Name: "b"},
		},
	}
	for prov, want := range map[string]string{"a": "http://a", "b": "http://default", "zzz": "http://default"} {
		if got := WebhookFor(c, prov); got != want {
			t.Errorf("WebhookFor(%q) = %q, want %q", prov, got, want)
		}
	}
	if got := WebhookFor(&rules.Contract{}, "a"); got != "" {
		t.Errorf("no webhook configured: got %q", got)
	}
	n := New(Config{Logger: quietLogger()})
	if n.Escalated(&rules.Contract{}, escalatedOp()) {
		t.Error("Escalated queued a message without a webhook")
	}
}

// A receiver that fails twice with 503 and then accepts: two retries with
// doubling delays, then delivered.
func TestRetriesWithBackoff(t *testing.T) {
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) <= 2 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	oc := newOutcomes()
	sl := &sleeps{}
	n := New(Config{OnOutcome: oc.record, Sleep: sl.sleep, BaseDelay: time.Second, MaxDelay: time.Minute, Logger: quietLogger()})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n.Start(ctx)
	n.Enqueue(srv.URL, BuildMessage(escalatedOp()))
	oc.waitFor(t, OutcomeDelivered)
	if calls.Load() != 3 {
		t.Errorf("receiver saw %d attempts, want 3", calls.Load())
	}
	if d := sl.got(); len(d) != 2 || d[0] != time.Second || d[1] != 2*time.Second {
		t.Errorf("backoff delays %v, want [1s 2s]", d)
	}
	if oc.get(OutcomeRetried) != 2 || oc.get(OutcomeFailed) != 0 {
		t.Errorf("outcomes retried=%d failed=%d", oc.get(OutcomeRetried), oc.get(OutcomeFailed))
	}
}

// A receiver that is down: every attempt fails, the delays are capped, the
// failure is counted, and Enqueue never blocked the caller.
func TestReceiverDownCountsFailure(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := "http://" + ln.Addr().String() + "/hook"
	ln.Close() // nothing listens there any more: connection refused

	oc := newOutcomes()
	sl := &sleeps{}
	n := New(Config{OnOutcome: oc.record, Sleep: sl.sleep, Attempts: 4, BaseDelay: time.Second, MaxDelay: 3 * time.Second,
		Timeout: 2 * time.Second, Logger: quietLogger()})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n.Start(ctx)
	start := time.Now()
	if !n.Enqueue(down, BuildMessage(escalatedOp())) {
		t.Fatal("enqueue refused")
	}
	if took := time.Since(start); took > 100*time.Millisecond {
		t.Errorf("Enqueue blocked for %v", took)
	}
	oc.waitFor(t, OutcomeFailed)
	if d := sl.got(); len(d) != 3 || d[0] != time.Second || d[1] != 2*time.Second || d[2] != 3*time.Second {
		t.Errorf("backoff delays %v, want [1s 2s 3s] (capped at MaxDelay)", d)
	}
	if oc.get(OutcomeRetried) != 3 || oc.get(OutcomeFailed) != 1 || oc.get(OutcomeDelivered) != 0 {
		t.Errorf("outcomes %v", oc.n)
	}
}

// A 4xx other than 408/429 will not get better by retrying.
func TestClientErrorIsNotRetried(t *testing.T) {
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.WriteHeader(http.StatusNotFound)
	}))
	defer srv.Close()
	oc := newOutcomes()
	n := New(Config{OnOutcome: oc.record, Sleep: (&sleeps{}).sleep, Logger: quietLogger()})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n.Start(ctx)
	n.Enqueue(srv.URL, BuildMessage(escalatedOp()))
	oc.waitFor(t, OutcomeFailed)
	if calls.Load() != 1 {
		t.Errorf("receiver saw %d attempts, want 1", calls.Load())
	}
}

// A slow receiver fills the bounded queue: further messages are dropped and
// counted, and Enqueue still returns at once.
func TestFullQueueDrops(t *testing.T) {
	release := make(chan struct{})
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		<-release
	}))
	defer srv.Close()
	defer close(release)

	oc := newOutcomes()
	n := New(Config{OnOutcome: oc.record, QueueSize: 2, Workers: 1, Timeout: 30 * time.Second, Logger: quietLogger()})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n.Start(ctx)

	msg := BuildMessage(escalatedOp())
	n.Enqueue(srv.URL, msg)
	// Wait until the worker holds the first message, so the queue is empty.
	for deadline := time.Now().Add(10 * time.Second); calls.Load() == 0; {
		if time.Now().After(deadline) {
			t.Fatal("worker never picked up the first message")
		}
		time.Sleep(5 * time.Millisecond)
	}
	start := time.Now()
	accepted := 0
	for range 5 {
		if n.Enqueue(srv.URL, msg) {
			accepted++
		}
	}
	if took := time.Since(start); took > 100*time.Millisecond {
		t.Errorf("Enqueue blocked for %v on a full queue", took)
	}
	if accepted != 2 || oc.get(OutcomeDropped) != 3 {
		t.Errorf("accepted %d dropped %d, want 2 and 3", accepted, oc.get(OutcomeDropped))
	}
}
