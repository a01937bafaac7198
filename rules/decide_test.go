package rules

import (
	"errors"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"
	"time"
)

// t0 is the injected "now" at which test operations start.
var t0 = time.Date(2026, 1, 2, 10, 20, 0, 0, time.UTC)

// fixedRand returns the same value every time, so jittered delays are exact:
// 0 gives jitter_floor*raw.
type fixedRand float64

func (f fixedRand) Float64() float64 { return float64(f) }

func example(t testing.TB) (*Contract, *Provider) {
	t.Helper()
	c := mustLoad(t, "testdata/example.yaml")
	return c, c.ProviderByName("example-exports")
}

// sentOp is a fresh operation (first status call at t0) with one status
// request reserved, as the proxy has it when the answer arrives.
func sentOp(t testing.TB) (*Provider, *Operation) {
	c, p := example(t)
	op := NewOperation(p, c, "op_1", "exp_71c", "acct_0123456789abcdef", OriginFirstStatusCal, t0, fixedRand(0))
	d := BeforeSend(p, op, t0)
	if d.Action != ActSend {
		t.Fatalf("first call: %s", d.Action)
	}
	d.Op.Lease = Lease{Holder: "proxy-1", Fence: 1, ExpiresAt: t0.Add(30 * time.Second)}
	return p, d.Op
}

func resp(code int, body string, kv ...string) Response {
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Add(kv[i], kv[i+1])
	}
	return Response{StatusCode: code, Header: h, Body: []byte(body)}
}

func TestNewOperation(t *testing.T) {
	c := mustLoad(t, "testdata/example.yaml")
	p := c.ProviderByName("example-exports")
	// R4: the record exists before the first status request, with budgets.
	op := NewOperation(p, c, "op_1", "job", "acct", OriginFirstStatusCal, t0, fixedRand(0))
	if op.DeadlineAt != t0.Add(time.Hour) || op.Budget != (Budget{StatusRequests: 12, TransportFailures: 3, RateLimited: 3}) ||
		op.Phase != PhaseWaiting || op.ContractVersion != c.Hash || op.StartedAt != t0 || op.UpdatedAt != t0 {
		t.Fatalf("record: %+v", op)
	}
	// The arriving first status call may go out at once.
	if !op.NextPollAt.Equal(t0) {
		t.Fatalf("first status call: next poll %v", op.NextPollAt)
	}
	// R5: a submission waits one backoff step (attempt 0: raw = base = 5s, floor 0.5).
	op = NewOperation(p, c, "op_2", "job", "acct", OriginSubmission, t0, fixedRand(0))
	if op.NextPollAt != t0.Add(2500*time.Millisecond) || op.DelaySource != DelayLocalBackoff {
		t.Fatalf("submission: next poll %v (%s)", op.NextPollAt, op.DelaySource)
	}
	// R19: a shorter business deadline wins.
	bare := c.ProviderByName("bare")
	op = NewOperation(bare, c, "op_3", "job", "acct", OriginFirstStatusCal, t0, nil)
	if op.DeadlineAt != t0.Add(10*time.Minute) {
		t.Fatalf("business deadline not applied: %v", op.DeadlineAt)
	}
}

func TestBeforeSend(t *testing.T) {
	_, p := example(t)
	base := func() *Operation {
		return &Operation{ID: "op", Provider: p.Name, JobID: "j", Phase: PhaseWaiting, StartedAt: t0,
			DeadlineAt: t0.Add(time.Hour), Budget: Budget{StatusRequests: 12, TransportFailures: 3, RateLimited: 3},
			Used: Counters{StatusRequests: 3}, NextPollAt: t0.Add(time.Minute), DelaySource: DelayLocalBackoff}
	}
	tests := []struct {
		name   string
		mut    func(*Operation)
		at     time.Time
		action Action
		reason Reason
		wait   time.Duration
	}{
		// R7: a terminal record is answered from the record, whatever else holds.
		{"terminal wins", func(o *Operation) { o.Phase = PhaseSucceeded; o.Used.StatusRequests = 99 }, t0.Add(2 * time.Hour), ActReplay, "", 0},
		{"escalated replays", func(o *Operation) { o.Phase = PhaseEscalated }, t0, ActReplay, "", 0},
		// R7/R10: the deadline is checked first, even before the budget.
		{"deadline first", func(o *Operation) { o.Used.StatusRequests = 12 }, t0.Add(time.Hour), ActEscalate, ReasonDeadlineExceeded, 0},
		{"deadline at exactly now", nil, t0.Add(time.Hour), ActEscalate, ReasonDeadlineExceeded, 0},
		// R9: budget checked before scheduling.
		{"budget spent", func(o *Operation) { o.Used.StatusRequests = 12 }, t0.Add(2 * time.Minute), ActEscalate, ReasonRequestBudgetExhausted, 0},
		// R7: early polls wait, never catch up.
		{"too early", nil, t0.Add(20 * time.Second), ActTooEarly, "", 40 * time.Second},
		{"on time", nil, t0.Add(time.Minute), ActSend, "", 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			op := base()
			if tc.mut != nil {
				tc.mut(op)
			}
			before := *op
			d := BeforeSend(p, op, tc.at)
			if d.Action != tc.action || d.Reason != tc.reason || d.Wait != tc.wait {
				t.Fatalf("got %s/%s wait %v, want %s/%s wait %v", d.Action, d.Reason, d.Wait, tc.action, tc.reason, tc.wait)
			}
			if op.Used != before.Used || op.Phase != before.Phase {
				t.Fatal("BeforeSend mutated its input")
			}
			switch d.Action {
			case ActSend:
				// R9: the reservation is counted before sending.
				if d.Op.Used.StatusRequests != before.Used.StatusRequests+1 {
					t.Fatalf("reservation not applied: %d", d.Op.Used.StatusRequests)
				}
			case ActTooEarly:
				if d.NextPollAt != before.NextPollAt || d.Op.Used != before.Used {
					t.Fatalf("too early changed the record: %+v", d.Op.Used)
				}
			case ActEscalate:
				if d.Op.Phase != PhaseEscalated || d.Op.Escalation == nil || d.Op.Escalation.Reason != tc.reason || d.Op.Escalation.At != tc.at {
					t.Fatalf("escalation record: %+v", d.Op.Escalation)
				}
			}
		})
	}
}

func TestOnResponse(t *testing.T) {
	type want struct {
		action  Action
		reason  Reason
		class   string
		state   string
		phase   Phase
		source  DelaySource
		wait    time.Duration // exact, with fixedRand(0); 0 = not checked
		story   string        // exact when set
		hintRej string        // substring
		note    string        // substring
	}
	late := func(d time.Duration) func(*Operation) {
		return func(o *Operation) { o.StartedAt = o.StartedAt.Add(-d); o.DeadlineAt = o.DeadlineAt.Add(-d) }
	}
	tests := []struct {
		name string
		mut  func(*Operation)
		resp Response
		want want
	}{
		// R2 + R5: waiting; attempt = completed polls = 1 -> raw 10s, floor 0.5 -> 5s.
		{"R2 waiting local backoff", nil, resp(200, `{"state":"queued"}`),
			want{action: ActWait, class: ClassWaiting, state: "queued", phase: PhaseWaiting, source: DelayLocalBackoff, wait: 5 * time.Second,
				story: "polled, state queued, next poll 10:20:05 from local backoff"}},
		{"R2 success", nil, resp(200, `{"state":"succeeded","result_url":"https://dl.example.com/r.csv"}`),
			want{action: ActSucceed, class: ClassSuccess, state: "succeeded", phase: PhaseSucceeded, story: "polled, state succeeded, succeeded"}},
		{"R2 failure keeps provider error", nil, resp(200, `{"state":"failed","error":{"code":"quota","message":"over quota"}}`),
			want{action: ActEscalate, reason: ReasonJobFailed, class: ClassFailure, state: "failed", phase: PhaseStopped,
				story: "polled, state failed, job failed, stopped"}},
		{"R2 cancelled", nil, resp(200, `{"state":"cancelled"}`),
			want{action: ActEscalate, reason: ReasonJobCancelled, class: ClassCancelled, state: "cancelled", phase: PhaseStopped}},
		{"R2 expired", nil, resp(200, `{"state":"expired"}`),
			want{action: ActEscalate, reason: ReasonJobExpired, class: ClassExpired, state: "expired", phase: PhaseStopped}},
		{"R2 unknown state stops", nil, resp(200, `{"state":"manual_review"}`),
			want{action: ActEscalate, reason: ReasonUnknownState, class: ClassUnknown, state: "manual_review", phase: PhaseEscalated,
				story: "polled, state manual_review, unknown state, escalated"}},
		{"R2 missing state is unknown", nil, resp(200, `{"status":"queued"}`),
			want{action: ActEscalate, reason: ReasonUnknownState, class: ClassUnknown, phase: PhaseEscalated}},
		{"R2 object state is unknown", nil, resp(200, `{"state":{"name":"queued"}}`),
			want{action: ActEscalate, reason: ReasonUnknownState, class: ClassUnknown, phase: PhaseEscalated}},
		{"R2 case matters", nil, resp(200, `{"state":"Queued"}`),
			want{action: ActEscalate, reason: ReasonUnknownState, class: ClassUnknown, state: "Queued"}},
		// R3: success without what the next action needs is not ready.
		{"R3 success without result_url", nil, resp(200, `{"state":"succeeded"}`),
			want{action: ActNotReady, class: ClassSuccess, state: "succeeded", phase: PhaseWaiting, source: DelayLocalBackoff, wait: 5 * time.Second,
				note: "result_url is missing", story: "polled, state succeeded but result_url is missing, not ready, next poll 10:20:05 from local backoff"}},
		{"R3 success with null result_url", nil, resp(200, `{"state":"succeeded","result_url":null}`),
			want{action: ActNotReady, class: ClassSuccess, note: "result_url is missing"}},
		{"R3 success with relative result_url", nil, resp(200, `{"state":"succeeded","result_url":"/r.csv"}`),
			want{action: ActNotReady, class: ClassSuccess, note: "not an absolute http(s) URL"}},
		{"R3 running after expires_at", nil, resp(200, `{"state":"running","expires_at":"2026-01-02T10:00:00Z"}`),
			want{action: ActEscalate, reason: ReasonContradiction, class: ClassWaiting, state: "running", phase: PhaseEscalated}},
		{"R3 running after unix expires_at", nil, resp(200, `{"state":"running","expires_at":1767348000}`),
			want{action: ActEscalate, reason: ReasonContradiction, class: ClassWaiting}},
		{"R3 running before expires_at", nil, resp(200, `{"state":"running","expires_at":"2026-01-02T12:00:00Z"}`),
			want{action: ActWait, class: ClassWaiting}},
		// R6: validated hints.
		{"R6 poll_after_seconds", nil, resp(200, `{"state":"running","poll_after_seconds":30}`),
			want{action: ActWait, source: DelayProviderPollHint, wait: 30 * time.Second, story: "polled, state running, next poll 10:20:30 from provider hint"}},
		{"R6 poll_after_seconds as string", nil, resp(200, `{"state":"running","poll_after_seconds":"12.5"}`),
			want{action: ActWait, source: DelayProviderPollHint, wait: 12500 * time.Millisecond}},
		{"R6 negative hint rejected", nil, resp(200, `{"state":"running","poll_after_seconds":-5}`),
			want{action: ActWait, source: DelayLocalBackoff, wait: 5 * time.Second, hintRej: "poll_after_seconds -5 rejected: negative"}},
		{"R6 garbage hint rejected", nil, resp(200, `{"state":"running","poll_after_seconds":"soon"}`),
			want{action: ActWait, source: DelayLocalBackoff, hintRej: "not a number"}},
		{"R6 hint beyond deadline escalates at once", nil, resp(200, `{"state":"running","poll_after_seconds":7200}`),
			want{action: ActEscalate, reason: ReasonDeadlineExceeded, class: ClassWaiting, hintRej: "reaches past the deadline 11:20:00"}},
		{"R6 next_check_at", nil, resp(200, `{"state":"running","next_check_at":"2026-01-02T10:21:00Z"}`),
			want{action: ActWait, source: DelayProviderPollHint, wait: time.Minute}},
		{"R6 next_check_at unparseable", nil, resp(200, `{"state":"running","next_check_at":"tomorrow"}`),
			want{action: ActWait, source: DelayLocalBackoff, hintRej: "not an RFC 3339 timestamp"}},
		{"R6 next_check_at in the past", nil, resp(200, `{"state":"running","next_check_at":"2026-01-02T09:00:00Z"}`),
			want{action: ActWait, source: DelayLocalBackoff, hintRej: "in the past"}},
		{"R6 both hints: the later wins", nil, resp(200, `{"state":"running","poll_after_seconds":10,"next_check_at":"2026-01-02T10:20:40Z"}`),
			want{action: ActWait, source: DelayProviderPollHint, wait: 40 * time.Second}},
		// R13: Retry-After on a 2xx is a minimum over the local backoff.
		{"R13 Retry-After on 200 below backoff", nil, resp(200, `{"state":"running"}`, "Retry-After", "1"),
			want{action: ActWait, source: DelayLocalBackoff, wait: 5 * time.Second}},
		{"R13 Retry-After on 200 above backoff", nil, resp(200, `{"state":"running"}`, "Retry-After", "20"),
			want{action: ActWait, source: DelayProviderRetryAfter, wait: 20 * time.Second}},
		// R10: escalate at once when no poll remains.
		{"R10 budget spent after a waiting answer", func(o *Operation) { o.Budget.StatusRequests = 1 }, resp(200, `{"state":"running"}`),
			want{action: ActEscalate, reason: ReasonRequestBudgetExhausted, class: ClassWaiting, state: "running", phase: PhaseEscalated,
				story: "polled, state running, request budget exhausted, escalated"}},
		{"R10 next poll past the deadline", func(o *Operation) { o.DeadlineAt = t0.Add(3 * time.Second) }, resp(200, `{"state":"running"}`),
			want{action: ActEscalate, reason: ReasonDeadlineExceeded, class: ClassWaiting, story: "polled, state running, deadline exceeded, escalated"}},
		// R16.
		{"R16 401", nil, resp(401, `{"error":"bad key"}`),
			want{action: ActEscalate, reason: ReasonAuthorizationDenied, phase: PhaseEscalated, story: "received 401, authorization denied, escalated"}},
		{"R16 403 before anything else", func(o *Operation) { o.Budget.StatusRequests = 1 }, resp(403, `{"state":"succeeded"}`),
			want{action: ActEscalate, reason: ReasonAuthorizationDenied}},
		// R13: 429.
		{"R13 429 with Retry-After seconds", nil, resp(429, ``, "Retry-After", "120"),
			want{action: ActWait, source: DelayProviderRetryAfter, wait: 120 * time.Second, story: "received 429, Retry-After 120, next poll 10:22:00 from provider guidance"}},
		{"R13 429 with Retry-After date", nil, resp(429, ``, "Retry-After", "Fri, 02 Jan 2026 10:21:30 GMT"),
			want{action: ActWait, source: DelayProviderRetryAfter, wait: 90 * time.Second}},
		{"R13 429 without Retry-After raises the delay", nil, resp(429, ``),
			want{action: ActWait, source: DelayLocalBackoff, wait: 20 * time.Second, note: "raised 4x",
				story: "received 429 without Retry-After, delay raised 4x, next poll 10:20:20 from local backoff"}},
		{"R13 429 with garbage Retry-After", nil, resp(429, ``, "Retry-After", "later"),
			want{action: ActWait, source: DelayLocalBackoff, wait: 20 * time.Second, hintRej: "neither delay-seconds nor an HTTP-date"}},
		{"R13 rate-limit budget spent", func(o *Operation) { o.Used.RateLimited = 2 }, resp(429, ``, "Retry-After", "5"),
			want{action: ActEscalate, reason: ReasonRateLimited, phase: PhaseEscalated, story: "received 429, rate limited, escalated"}},
		{"R13 Retry-After past the deadline", func(o *Operation) { o.DeadlineAt = t0.Add(time.Minute) }, resp(429, ``, "Retry-After", "120"),
			want{action: ActEscalate, reason: ReasonDeadlineExceeded}},
		// R17: 5xx.
		{"R17 503 with Retry-After", nil, resp(503, ``, "Retry-After", "120"),
			want{action: ActWait, source: DelayProviderRetryAfter, wait: 120 * time.Second, story: "received 503, Retry-After 120, next poll 10:22:00 from provider guidance"}},
		{"R17 500 ignores Retry-After", nil, resp(500, ``, "Retry-After", "120"),
			want{action: ActWait, source: DelayLocalBackoff, wait: 5 * time.Second, story: "received 500, next poll 10:20:05 from local backoff"}},
		{"R17 transport budget spent", func(o *Operation) { o.Used.TransportFailures = 2 }, resp(502, `<html>`),
			want{action: ActEscalate, reason: ReasonTransportFailuresExhausted, story: "received 502, transport failures exhausted, escalated"}},
		// R15: 404.
		{"R15 404 inside grace", nil, resp(404, `{}`),
			want{action: ActWait, phase: PhaseWaiting, source: DelayLocalBackoff, note: "not-found grace"}},
		{"R15 404 after grace", late(time.Minute), resp(404, `{}`),
			want{action: ActEscalate, reason: ReasonJobNotFound, phase: PhaseEscalated}},
		// R10: unparseable answers stop.
		{"invalid: not JSON", nil, resp(200, `<html>oops</html>`),
			want{action: ActEscalate, reason: ReasonInvalidResponse, story: "received 200, body not JSON, invalid response, escalated"}},
		{"invalid: truncated JSON", nil, resp(200, `{"state":"runn`),
			want{action: ActEscalate, reason: ReasonInvalidResponse}},
		{"invalid: array", nil, resp(200, `[{"state":"running"}]`),
			want{action: ActEscalate, reason: ReasonInvalidResponse}},
		{"invalid: empty", nil, resp(204, ``),
			want{action: ActEscalate, reason: ReasonInvalidResponse}},
		{"invalid: too large", nil, Response{StatusCode: 200, Header: http.Header{}, BodyTooLarge: true, Body: []byte(`{"state":`)},
			want{action: ActEscalate, reason: ReasonInvalidResponse}},
		{"invalid: redirect", nil, resp(302, ``, "Location", "https://elsewhere.example"),
			want{action: ActEscalate, reason: ReasonInvalidResponse}},
		{"invalid: 400", nil, resp(400, `{"error":"bad"}`),
			want{action: ActEscalate, reason: ReasonInvalidResponse}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, op := sentOp(t)
			if tc.mut != nil {
				tc.mut(op)
			}
			in := op.Clone()
			at := t0
			r := tc.resp
			r.Header.Set("X-Request-Id", "req_42")
			d := OnResponse(p, op, r, at, fixedRand(0))
			w := tc.want
			if d.Action != w.action || d.Reason != w.reason {
				t.Fatalf("got %s/%s, want %s/%s (story %q, note %q, hint %q)", d.Action, d.Reason, w.action, w.reason, d.Story, d.Note, d.HintRejected)
			}
			if w.class != "" && d.StateClass != w.class {
				t.Errorf("class %q, want %q", d.StateClass, w.class)
			}
			if w.state != "" && (d.State != w.state || d.Op.LastState != w.state) {
				t.Errorf("state %q / last %q, want %q", d.State, d.Op.LastState, w.state)
			}
			if w.phase != "" && d.Op.Phase != w.phase {
				t.Errorf("phase %s, want %s", d.Op.Phase, w.phase)
			}
			if w.source != "" && (d.DelaySource != w.source || d.Op.DelaySource != w.source) {
				t.Errorf("delay source %s, want %s", d.DelaySource, w.source)
			}
			if w.wait != 0 && (d.Wait != w.wait || !d.NextPollAt.Equal(at.Add(w.wait)) || !d.Op.NextPollAt.Equal(d.NextPollAt)) {
				t.Errorf("wait %v (next %v), want %v", d.Wait, d.NextPollAt, w.wait)
			}
			if w.story != "" && d.Story != w.story {
				t.Errorf("story %q\n      want %q", d.Story, w.story)
			}
			if d.Story == "" {
				t.Error("every decision carries a story line (R25)")
			}
			if !strings.Contains(d.HintRejected, w.hintRej) || (w.hintRej == "" && d.HintRejected != "") {
				t.Errorf("hint rejected %q, want %q", d.HintRejected, w.hintRej)
			}
			if !strings.Contains(d.Note, w.note) {
				t.Errorf("note %q, want %q", d.Note, w.note)
			}
			// Every answer: one completed poll, HTTP result, request id, lease released.
			o := d.Op
			if o.Used.Polls != in.Used.Polls+1 || o.LastHTTP != r.StatusCode || !o.LastHTTPAt.Equal(at) ||
				o.LastRequestID != "req_42" || o.Lease.Holder != "" || !o.Lease.ExpiresAt.IsZero() || !o.UpdatedAt.Equal(at) {
				t.Errorf("bookkeeping: polls %d http %d at %v reqid %q lease %+v", o.Used.Polls, o.LastHTTP, o.LastHTTPAt, o.LastRequestID, o.Lease)
			}
			if o.Lease.Fence != in.Lease.Fence {
				t.Error("the fence is the ledger's, it must not change")
			}
			// Decisions never alias the input record.
			if op.Used != in.Used || op.Phase != in.Phase || op.Lease != in.Lease {
				t.Error("OnResponse mutated its input")
			}
			switch d.Action {
			case ActEscalate, ActSucceed:
				if o.Terminal == nil || o.Terminal.StatusCode != r.StatusCode || o.Terminal.Header["X-Request-Id"] != "req_42" {
					t.Errorf("terminal response not stored: %+v", o.Terminal)
				}
				if !o.NextPollAt.IsZero() {
					t.Errorf("a stopped operation has no next poll: %v", o.NextPollAt)
				}
			default:
				if o.Terminal != nil || o.Phase != PhaseWaiting || o.Escalation != nil {
					t.Errorf("a waiting decision stored a terminal answer or escalation")
				}
			}
			if d.Action == ActEscalate {
				if o.Escalation == nil || o.Escalation.Reason != w.reason || !o.Escalation.At.Equal(at) || o.Escalation.Message == "" {
					t.Fatalf("escalation: %+v", o.Escalation)
				}
			}
		})
	}
}

func TestOnResponseCounters(t *testing.T) {
	p, op := sentOp(t)
	d := OnResponse(p, op, resp(429, ``), t0, fixedRand(0))
	if d.Op.Used.RateLimited != 1 || d.Op.Used.TransportFailures != 0 {
		t.Fatalf("429 counters: %+v", d.Op.Used)
	}
	d = OnResponse(p, d.Op, resp(503, ``), t0.Add(time.Minute), fixedRand(0))
	if d.Op.Used.TransportFailures != 1 || d.Op.Used.Polls != 2 {
		t.Fatalf("503 counters: %+v", d.Op.Used)
	}
	d = OnResponse(p, d.Op, resp(404, `{}`), t0.Add(2*time.Second), fixedRand(0))
	if d.Op.Used.NotFound != 1 {
		t.Fatalf("404 counters: %+v", d.Op.Used)
	}
}

func TestSuccessDetails(t *testing.T) {
	p, op := sentOp(t)
	d := OnResponse(p, op, resp(200, `{"state":"succeeded","result_url":"https://dl.example.com/r.csv?sig=abc"}`, "Content-Type", "application/json", "Set-Cookie", "s=1"), t0, nil)
	if d.Op.ResultURL != "https://dl.example.com/r.csv?sig=abc" {
		t.Fatalf("result url %q", d.Op.ResultURL)
	}
	if d.Op.Terminal.Header["Content-Type"] != "application/json" || len(d.Op.Terminal.Header) != 1 {
		t.Fatalf("only selected headers are stored: %v", d.Op.Terminal.Header)
	}
	if d.Op.Escalation != nil || d.Reason != "" {
		t.Fatal("success is no escalation")
	}
}

func TestProviderErrorAndTruncation(t *testing.T) {
	p, op := sentOp(t)
	big := `{"state":"failed","error":{"message":"boom"},"pad":"` + strings.Repeat("x", MaxStoredBody) + `"}`
	d := OnResponse(p, op, resp(200, big), t0, nil)
	if d.Op.ProviderError != `{"message":"boom"}` {
		t.Fatalf("provider error %q", d.Op.ProviderError)
	}
	if !d.Op.Terminal.Truncated || len(d.Op.Terminal.Body) != MaxStoredBody {
		t.Fatalf("body kept %d bytes, truncated %v", len(d.Op.Terminal.Body), d.Op.Terminal.Truncated)
	}
}

func TestBooleanStates(t *testing.T) {
	c := mustLoad(t, "testdata/example.yaml")
	p := c.ProviderByName("bare")
	op := NewOperation(p, c, "op", "42", "anonymous", OriginFirstStatusCal, t0, nil)
	op.Used.StatusRequests = 1
	// booleans are classified as "true"/"false".
	if d := OnResponse(p, op, resp(200, `{"done":false}`), t0, nil); d.Action != ActWait || d.State != "false" {
		t.Fatalf("false: %s %q", d.Action, d.State)
	}
	if d := OnResponse(p, op, resp(200, `{"done":true}`), t0, nil); d.Action != ActSucceed || d.State != "true" {
		t.Fatalf("true: %s %q", d.Action, d.State)
	}
	// A string "true" is a string, not the boolean - still the same text.
	if d := OnResponse(p, op, resp(200, `{"done":"maybe"}`), t0, nil); d.Reason != ReasonUnknownState {
		t.Fatalf("maybe: %s", d.Reason)
	}
}

func TestOnTransportError(t *testing.T) {
	p, op := sentOp(t)
	d := OnTransportError(p, op, "dial tcp 10.0.0.1:443: connect: connection refused", t0, fixedRand(0))
	// R17: transport budget; R8: the reserved request stays counted; attempt = polls + failures = 1 -> 10s raw -> 5s.
	if d.Action != ActWait || d.Op.Used.TransportFailures != 1 || d.Op.Used.StatusRequests != 1 || d.Op.Used.Polls != 0 || d.Wait != 5*time.Second {
		t.Fatalf("first failure: %s %+v wait %v", d.Action, d.Op.Used, d.Wait)
	}
	if d.Story != "transport error (dial tcp 10.0.0.1:443: connect: connection refused), 1 of 3 transport failures, next poll 10:20:05 from local backoff" {
		t.Fatalf("story %q", d.Story)
	}
	if d.Op.LastError == "" || d.Op.Lease.Holder != "" {
		t.Fatalf("record: %+v", d.Op)
	}
	d.Op.Used.StatusRequests = 2
	d = OnTransportError(p, d.Op, "timeout", t0.Add(10*time.Second), fixedRand(0))
	if d.Action != ActWait || d.Wait != 10*time.Second {
		t.Fatalf("second failure backs off further: %s %v", d.Action, d.Wait)
	}
	d = OnTransportError(p, d.Op, "tls: bad certificate", t0.Add(30*time.Second), fixedRand(0))
	if d.Action != ActEscalate || d.Reason != ReasonTransportFailuresExhausted || d.Op.Terminal != nil {
		t.Fatalf("third failure: %s %s", d.Action, d.Reason)
	}
	if !strings.Contains(d.Op.Escalation.Message, "last transport error: tls: bad certificate") {
		t.Fatalf("message %q", d.Op.Escalation.Message)
	}
}

// R18: the message names everything a person needs, and no secrets.
func TestEscalationMessage(t *testing.T) {
	p, op := sentOp(t)
	op.Used.StatusRequests = 12
	r := resp(200, `{"state":"running","api_key":"sk-secret"}`)
	r.Header.Set("Authorization", "Bearer sk-secret")
	d := OnResponse(p, op, r, t0.Add(38*time.Minute), fixedRand(0))
	if d.Reason != ReasonRequestBudgetExhausted {
		t.Fatalf("reason %s", d.Reason)
	}
	msg := d.Op.Escalation.Message
	for _, want := range []string{"op_1", "exp_71c", "example-exports", "request_budget_exhausted", "last state running", "elapsed 38m", "status requests used 12 of 12",
		"last HTTP result 200 at 10:58:00 UTC", "all 12 status requests are used", "extend once (2 extensions left) by 15m with 4 more status requests", "cancel the job at the provider", "inspect"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message lacks %q:\n%s", want, msg)
		}
	}
	if strings.Contains(msg, "sk-secret") || strings.Contains(msg, "acct_") {
		t.Errorf("message leaks a secret or the account: %s", msg)
	}
	if d.Story != "polled, state running, request budget exhausted, escalated" {
		t.Errorf("story %q", d.Story)
	}
}

// R18: the options depend on the reason, the contract and the extensions used.
func TestEscalationOptions(t *testing.T) {
	c, p := example(t)
	bare := c.ProviderByName("bare")
	actions := func(opts []Option) string {
		var s []string
		for _, o := range opts {
			s = append(s, o.Action)
		}
		return strings.Join(s, ",")
	}
	op := &Operation{}
	tests := []struct {
		p      *Provider
		ext    int
		reason Reason
		want   string
	}{
		{p, 0, ReasonDeadlineExceeded, "extend,cancel_at_provider,inspect"},
		{p, 0, ReasonRequestBudgetExhausted, "extend,cancel_at_provider,inspect"},
		{p, 0, ReasonAuthorizationDenied, "cancel_at_provider,inspect"},
		{p, 0, ReasonJobFailed, "inspect"},
		{p, 0, ReasonJobCancelled, "inspect"},
		{p, 0, ReasonJobExpired, "inspect"},
		{p, 0, ReasonResubmissionBlocked, "cancel_at_provider,allow_resubmission,inspect"},
		{p, 2, ReasonDeadlineExceeded, "cancel_at_provider,inspect"}, // max_extensions reached
		{bare, 0, ReasonDeadlineExceeded, "extend,inspect"},          // no cancel in the contract
		{bare, 0, ReasonUnknownState, "extend,inspect"},
	}
	for _, tc := range tests {
		op.Extensions = make([]Extension, tc.ext)
		opts := EscalationOptions(tc.p, op, tc.reason)
		if got := actions(opts); got != tc.want {
			t.Errorf("%s/%s with %d extensions: %s, want %s", tc.p.Name, tc.reason, tc.ext, got, tc.want)
		}
		for _, o := range opts {
			if o.Action == "extend" && (o.Duration != 15*time.Minute || o.DurationText != "15m0s" || o.StatusRequests != 4) {
				t.Errorf("extend option not concrete: %+v", o)
			}
			if o.Description == "" || len(o.Description) > 200 {
				t.Errorf("option description unbounded: %q", o.Description)
			}
		}
	}
	op.Extensions = make([]Extension, 1)
	if d := EscalationOptions(p, op, ReasonDeadlineExceeded)[0].Description; d != "extend once by 15m with 4 more status requests" {
		t.Errorf("description %q", d)
	}
}

// R24: extensions are bounded new authorizations.
func TestExtend(t *testing.T) {
	p, op := sentOp(t)
	op.Used.StatusRequests = 12
	d := OnResponse(p, op, resp(200, `{"state":"running"}`), t0.Add(10*time.Minute), fixedRand(0))
	esc := d.Op
	now := t0.Add(20 * time.Minute)
	o, err := Extend(p, esc, ExtendRequest{Duration: 15 * time.Minute, StatusRequests: 4, By: "ann", Note: "customer waits"}, now)
	if err != nil {
		t.Fatal(err)
	}
	if o.Phase != PhaseWaiting || o.Escalation != nil || o.DeadlineAt != esc.DeadlineAt.Add(15*time.Minute) || o.Budget.StatusRequests != 16 ||
		!o.NextPollAt.Equal(now) || o.DelaySource != DelayManualExtension || len(o.Extensions) != 1 || o.Extensions[0].By != "ann" ||
		o.Extensions[0].NewDeadline != o.DeadlineAt || o.Terminal != nil {
		t.Fatalf("extended record: %+v", o)
	}
	if esc.Phase != PhaseEscalated {
		t.Fatal("Extend mutated its input")
	}
	// R24: an extension never shortens the time left; after the deadline has
	// passed it counts from now.
	late := esc.DeadlineAt.Add(5 * time.Minute)
	if o2, err := Extend(p, esc, ExtendRequest{Duration: 15 * time.Minute, StatusRequests: 4}, late); err != nil || !o2.DeadlineAt.Equal(late.Add(15*time.Minute)) {
		t.Fatalf("extension after the deadline: %v %+v", err, o2)
	}
	// The extended operation polls again, and the next escalation counts the extension.
	if bd := BeforeSend(p, o, now); bd.Action != ActSend {
		t.Fatalf("after extension: %s", bd.Action)
	}
	refused := []struct {
		name string
		op   func() *Operation
		req  ExtendRequest
	}{
		{"not escalated", func() *Operation { return o }, ExtendRequest{Duration: time.Minute, StatusRequests: 1}},
		{"too long", func() *Operation { return esc }, ExtendRequest{Duration: 16 * time.Minute, StatusRequests: 1}},
		{"too many requests", func() *Operation { return esc }, ExtendRequest{Duration: time.Minute, StatusRequests: 5}},
		{"zero", func() *Operation { return esc }, ExtendRequest{Duration: 0, StatusRequests: 1}},
		{"authorization denied", func() *Operation {
			return OnResponse(p, esc, resp(401, ``), now, nil).Op
		}, ExtendRequest{Duration: time.Minute, StatusRequests: 1}},
		{"job failed", func() *Operation {
			return OnResponse(p, esc, resp(200, `{"state":"failed"}`), now, nil).Op
		}, ExtendRequest{Duration: time.Minute, StatusRequests: 1}},
		{"extensions used up", func() *Operation {
			x := esc.Clone()
			x.Extensions = make([]Extension, 2)
			return x
		}, ExtendRequest{Duration: time.Minute, StatusRequests: 1}},
	}
	for _, tc := range refused {
		if _, err := Extend(p, tc.op(), tc.req, now); !errors.Is(err, ErrExtensionRefused) {
			t.Errorf("%s: err %v, want ErrExtensionRefused", tc.name, err)
		}
	}
}

func TestExtendRaisesExhaustedSideBudgets(t *testing.T) {
	p, op := sentOp(t)
	op.Used.TransportFailures = 2
	d := OnTransportError(p, op, "refused", t0, nil)
	if d.Reason != ReasonTransportFailuresExhausted {
		t.Fatalf("reason %s", d.Reason)
	}
	o, err := Extend(p, d.Op, ExtendRequest{Duration: time.Minute, StatusRequests: 2, By: "bob"}, t0.Add(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if o.Budget.TransportFailures <= o.Used.TransportFailures {
		t.Fatalf("extension leaves no transport failure room: %+v / %+v", o.Budget, o.Used)
	}
	// One more failure escalates again rather than polling forever.
	o.Used.StatusRequests++
	if d := OnTransportError(p, o, "refused", t0.Add(2*time.Minute), nil); d.Reason != ReasonTransportFailuresExhausted {
		t.Fatalf("after extension: %s %s", d.Action, d.Reason)
	}
}

// R25: a run reads as a story.
func TestStoryOfARun(t *testing.T) {
	c, p := example(t)
	rnd := rand.New(rand.NewPCG(7, 7))
	op := NewOperation(p, c, "op_1", "exp_71c", "acct", OriginSubmission, t0, rnd)
	now := t0
	var story []string
	step := func(r *Response) Decision {
		d := BeforeSend(p, op, now)
		if d.Action == ActTooEarly {
			now = d.NextPollAt
			d = BeforeSend(p, op, now)
		}
		if d.Action != ActSend {
			story = append(story, Clock(now)+" "+d.Story)
			op = d.Op
			return d
		}
		d = OnResponse(p, d.Op, *r, now, rnd)
		story = append(story, Clock(now)+" "+Story(d))
		op = d.Op
		return d
	}
	step(&Response{StatusCode: 200, Body: []byte(`{"state":"queued"}`)})
	step(&Response{StatusCode: 503, Header: http.Header{"Retry-After": {"120"}}})
	step(&Response{StatusCode: 200, Body: []byte(`{"state":"running"}`)})
	d := step(&Response{StatusCode: 200, Body: []byte(`{"state":"succeeded","result_url":"https://dl.example.com/x"}`)})
	if d.Action != ActSucceed {
		t.Fatalf("run did not succeed: %v", story)
	}
	if !strings.Contains(story[1], "received 503, Retry-After 120, next poll") || !strings.HasSuffix(story[1], "from provider guidance") {
		t.Fatalf("story:\n%s", strings.Join(story, "\n"))
	}
	t.Log("\n" + strings.Join(story, "\n"))
}

// R4/R18: credentials in a client error's URL never reach the record.
func TestTransportErrorRedactsURLs(t *testing.T) {
	p, op := sentOp(t)
	d := OnTransportError(p, op, `Get "https://user:pw@speech.googleapis.com/v1/operations/1?key=AIzaSECRET&alt=json": dial tcp: i/o timeout`, t0, nil)
	if strings.Contains(d.Op.LastError, "AIzaSECRET") || strings.Contains(d.Op.LastError, "pw@") || strings.Contains(d.Story, "AIzaSECRET") {
		t.Fatalf("secret kept: %q / %q", d.Op.LastError, d.Story)
	}
	if !strings.Contains(d.Op.LastError, "https://speech.googleapis.com/v1/operations/1") || !strings.Contains(d.Op.LastError, "i/o timeout") {
		t.Fatalf("error text lost: %q", d.Op.LastError)
	}
}

// R25: the first story line names the job, its deadline and budget, and
// says when pollgate first saw the job at a status call.
func TestCreatedStory(t *testing.T) {
	op := &Operation{JobID: "exp_71c", Origin: OriginSubmission, DeadlineAt: time.Date(2026, 12, 2, 11, 0, 0, 0, time.UTC), Budget: Budget{StatusRequests: 12}}
	if got := CreatedStory(op); got != "submitted job exp_71c, deadline 11:00:00, budget 12" {
		t.Fatalf("submission: %q", got)
	}
	op.Origin = OriginFirstStatusCal
	if got := CreatedStory(op); got != "first status call for job exp_71c (not seen at submission), deadline 11:00:00, budget 12" {
		t.Fatalf("first status call: %q", got)
	}
}
