package proxy

import (
	"context"
	"crypto/x509"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"pollgate/audit"
	"pollgate/rules"
)

// R2, R4, R9, R14: a submission creates the record before the agent sees
// the answer; polls go queued -> running -> succeeded through the MITM'd
// tunnel, and the chain the agent sees is signed by the pollgate CA.
func TestSubmitPollSucceedTLS(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true})
	h.prov.script("job_1", state("queued"), state("running"), succeeded())

	sub := h.do("POST", "/v1/jobs", `{"input":"x"}`, map[string]string{"Pollgate-Operation": "op-agent-1"})
	if sub.code != http.StatusAccepted {
		t.Fatalf("submit: %d %s", sub.code, sub.body)
	}
	if got := sub.h.Get(HeaderOperation); got != "op-agent-1" {
		t.Fatalf("Pollgate-Operation = %q, want the agent's id", got)
	}
	// The MITM chain verifies against the test CA only.
	if sub.tls == nil || len(sub.tls.PeerCertificates) == 0 {
		t.Fatal("no TLS state: the call was not MITM'd")
	}
	leaf := sub.tls.PeerCertificates[0]
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: h.ca.Pool(), DNSName: "127.0.0.1"}); err != nil {
		t.Fatalf("leaf does not verify against the pollgate CA: %v", err)
	}
	if err := leaf.CheckSignatureFrom(h.ca.Certificate()); err != nil {
		t.Fatalf("leaf is not signed by the pollgate CA: %v", err)
	}
	op := h.op("job_1")
	if op.Origin != rules.OriginSubmission || op.RequestFingerprint == "" || op.ID != "op-agent-1" {
		t.Fatalf("record after submit: %+v", op)
	}
	// R4: the credential is never stored, only its fingerprint.
	if strings.Contains(op.Account, "sk-test-secret") || op.Account == "" {
		t.Fatalf("account fingerprint %q", op.Account)
	}

	var states []string
	for i := 0; i < 3; i++ {
		h.waitForSlot("job_1")
		g := h.poll("job_1")
		if g.code != 200 {
			t.Fatalf("poll %d: %d %s", i, g.code, g.body)
		}
		if d := g.h.Get(HeaderDecision); d != DecisionForwarded {
			t.Fatalf("poll %d: decision %q", i, d)
		}
		if g.h.Get(HeaderRequests) != strconv.Itoa(i+1)+"/6" {
			t.Fatalf("poll %d: Pollgate-Requests = %q", i, g.h.Get(HeaderRequests))
		}
		states = append(states, g.json["state"].(string))
		if i < 2 {
			if ra, err := strconv.Atoi(g.h.Get("Retry-After")); err != nil || ra < 1 {
				t.Fatalf("waiting answer without Retry-After: %q", g.h.Get("Retry-After"))
			}
			if _, err := time.Parse(time.RFC3339, g.h.Get(HeaderNextPollAt)); err != nil {
				t.Fatalf("Pollgate-Next-Poll-At %q: %v", g.h.Get(HeaderNextPollAt), err)
			}
		}
	}
	if strings.Join(states, ",") != "queued,running,succeeded" {
		t.Fatalf("states = %v", states)
	}
	if got := h.op("job_1").Phase; got != rules.PhaseSucceeded {
		t.Fatalf("phase = %s", got)
	}
	// Terminal: answered from the record, the provider is not contacted.
	before := h.prov.pollCount("job_1")
	g := h.poll("job_1")
	if g.code != 200 || g.h.Get(HeaderDecision) != DecisionReplayed || g.json["state"] != "succeeded" {
		t.Fatalf("replay: %d %s %s", g.code, g.h.Get(HeaderDecision), g.body)
	}
	if h.prov.pollCount("job_1") != before {
		t.Fatal("a terminal record contacted the provider")
	}
	// R23: the result call after success is forwarded and recorded.
	r := h.do("GET", "/v1/jobs/job_1/result", "", nil)
	if r.code != 200 || r.h.Get(HeaderDecision) != DecisionForwarded {
		t.Fatalf("result: %d %s", r.code, r.body)
	}
	if acts := h.op("job_1").Actions; len(acts) != 1 || acts[0].Kind != rules.KindResult || acts[0].HTTPStatus != 200 {
		t.Fatalf("actions = %+v", acts)
	}
	// The story reads as R25 wants.
	st := h.stories("job_1")
	if len(st) < 5 || !strings.Contains(st[0], "submitted job job_1") || !strings.Contains(st[len(st)-1], "fetched the result") {
		t.Fatalf("story:\n%s", strings.Join(st, "\n"))
	}
}

// Plain-HTTP absolute-form requests to a contract host are governed too.
func TestPlainHTTPGoverned(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: false})
	h.prov.script("j", state("running"))
	g := h.poll("j")
	if g.code != 200 || g.h.Get(HeaderDecision) != DecisionForwarded {
		t.Fatalf("first poll: %d %q %s", g.code, g.h.Get(HeaderDecision), g.body)
	}
	if op := h.op("j"); op.Origin != rules.OriginFirstStatusCal {
		t.Fatalf("origin = %s, want first_status_call", op.Origin)
	}
	g = h.poll("j")
	if g.code != http.StatusTooManyRequests {
		t.Fatalf("second poll at once: %d, want 429", g.code)
	}
}

// R7, R9: an agent polling in a tight loop gets 429s with Retry-After and
// the provider never sees more requests than the budget.
func TestTightLoopGets429AndBudgetHolds(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true, budget: 4})
	h.prov.script("job_t", state("running"))
	tooEarly, forwarded, escalated := 0, 0, 0
	for i := 0; i < 200; i++ {
		g := h.poll("job_t")
		switch g.h.Get(HeaderDecision) {
		case DecisionTooEarly:
			tooEarly++
			if g.code != 429 {
				t.Fatalf("too_early with status %d", g.code)
			}
			ra, err := strconv.Atoi(g.h.Get("Retry-After"))
			if err != nil || ra < 1 {
				t.Fatalf("Retry-After %q", g.h.Get("Retry-After"))
			}
			if g.h.Get("Cache-Control") != "no-store" {
				t.Fatal("429 without Cache-Control: no-store")
			}
			for _, k := range []string{"error", "next_poll_at", "retry_after_seconds", "status_requests_used", "status_requests_max", "operation_id", "message"} {
				if _, ok := g.json[k]; !ok {
					t.Fatalf("429 body lacks %q: %s", k, g.body)
				}
			}
		case DecisionForwarded:
			forwarded++
		case DecisionEscalated:
			escalated++
		}
		h.clock.Advance(100 * time.Millisecond)
	}
	if n := h.prov.pollCount("job_t"); n > 4 {
		t.Fatalf("provider saw %d status requests, budget 4", n)
	}
	if tooEarly == 0 || escalated == 0 {
		t.Fatalf("tooEarly=%d forwarded=%d escalated=%d", tooEarly, forwarded, escalated)
	}
	op := h.op("job_t")
	if op.Escalation == nil || op.Escalation.Reason != rules.ReasonRequestBudgetExhausted {
		t.Fatalf("escalation = %+v", op.Escalation)
	}
	h.proxy.gate.drain()
	if op := h.op("job_t"); op.Used.EarlyPolls == 0 {
		t.Fatal("early polls not counted")
	}
}

// Early polls answered from memory are still counted in the ledger, one
// each, and never reserve a request.
func TestEarlyPollsCounted(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true})
	h.prov.script("job_e", state("running"))
	if g := h.poll("job_e"); g.code != 200 {
		t.Fatalf("first poll: %d", g.code)
	}
	n := 0
	for i := 0; i < 40; i++ {
		g := h.poll("job_e")
		if g.code != 429 {
			t.Fatalf("early poll %d: %d", i, g.code)
		}
		n++
	}
	h.proxy.gate.drain()
	op := h.op("job_e")
	if op.Used.EarlyPolls != n || op.Used.StatusRequests != 1 || !op.Lease.ExpiresAt.IsZero() {
		t.Fatalf("early polls %d (want %d), status requests %d (want 1), lease %+v", op.Used.EarlyPolls, n, op.Used.StatusRequests, op.Lease)
	}
	h.waitForSlot("job_e")
	if g := h.poll("job_e"); g.code != 200 || g.h.Get(HeaderDecision) != DecisionForwarded {
		t.Fatalf("poll at the slot: %d %q", g.code, g.h.Get(HeaderDecision))
	}
}

// R18: every escalation reason reaches the agent as an escalation body
// whose state ends a legacy loop, with the pollgate object and headers.
func TestEscalationReasons(t *testing.T) {
	cases := []struct {
		name    string
		answers []answer
		opts    harnessOpts
		polls   int
		before  func(h *harness)
		reason  rules.Reason
		state   string // state in the body the agent gets
	}{
		{name: "job_failed", answers: []answer{state("running"), {code: 200, body: `{"state":"failed","error":{"code":"oom"}}`}}, polls: 2, reason: rules.ReasonJobFailed, state: "failed"},
		{name: "job_cancelled", answers: []answer{state("cancelled")}, polls: 1, reason: rules.ReasonJobCancelled, state: "cancelled"},
		{name: "job_expired", answers: []answer{state("expired")}, polls: 1, reason: rules.ReasonJobExpired, state: "expired"},
		{name: "unknown_state", answers: []answer{state("manual_review")}, polls: 1, reason: rules.ReasonUnknownState, state: "failed"},
		{name: "authorization_denied", answers: []answer{{code: 401, body: `{"error":"bad key"}`}}, polls: 1, reason: rules.ReasonAuthorizationDenied, state: "failed"},
		{name: "rate_limited", answers: []answer{{code: 429, body: `{"error":"slow down"}`}}, polls: 2, reason: rules.ReasonRateLimited, state: "failed"},
		{name: "transport_failures_5xx", answers: []answer{{code: 500, body: `oops`}}, polls: 2, reason: rules.ReasonTransportFailuresExhausted, state: "failed"},
		{name: "transport_failures_hangup", answers: []answer{{hangup: true}}, polls: 2, reason: rules.ReasonTransportFailuresExhausted, state: "failed"},
		{name: "invalid_response", answers: []answer{{code: 200, body: `<html>not json</html>`, header: map[string]string{"Content-Type": "text/html"}}}, polls: 1, reason: rules.ReasonInvalidResponse, state: "failed"},
		{name: "invalid_response_too_large", answers: []answer{{code: 200, body: `{"state":"running","pad":"` + strings.Repeat("x", 5000) + `"}`}}, opts: harnessOpts{maxBody: 1024}, polls: 1, reason: rules.ReasonInvalidResponse, state: "failed"},
		{name: "contradiction", answers: []answer{{code: 200, body: `{"state":"running","expires_at":"2026-03-02T10:00:00Z"}`}}, polls: 1, reason: rules.ReasonContradiction, state: "failed"},
		{name: "job_not_found", answers: []answer{{code: 404, body: `{"error":"no such job"}`}}, polls: 3,
			before: func(h *harness) { h.clock.Advance(1500 * time.Millisecond) }, reason: rules.ReasonJobNotFound, state: "failed"},
		{name: "request_budget_exhausted", answers: []answer{state("running")}, opts: harnessOpts{budget: 2}, polls: 2, reason: rules.ReasonRequestBudgetExhausted, state: "failed"},
		{name: "deadline_exceeded", answers: []answer{state("running")}, opts: harnessOpts{deadline: "3s"}, polls: 1,
			before: func(h *harness) { h.clock.Advance(5 * time.Second) }, reason: rules.ReasonDeadlineExceeded, state: "failed"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.opts.tls = true
			h := newHarness(t, tc.opts)
			job := "job_" + tc.name
			h.prov.script(job, tc.answers...)
			var g got
			for i := 0; i < tc.polls; i++ {
				if i > 0 {
					h.waitForSlot(job)
					if tc.before != nil {
						tc.before(h)
					}
				}
				g = h.poll(job)
				if g.h.Get(HeaderDecision) == DecisionEscalated {
					break
				}
			}
			if g.h.Get(HeaderDecision) != DecisionEscalated {
				// deadline: the last poll is refused before sending.
				if tc.before != nil {
					tc.before(h)
				} else {
					h.waitForSlot(job)
				}
				g = h.poll(job)
			}
			if g.code != 200 || g.h.Get(HeaderDecision) != DecisionEscalated {
				t.Fatalf("want an escalation, got %d %q %s", g.code, g.h.Get(HeaderDecision), g.body)
			}
			if got := g.h.Get(HeaderEscalation); got != string(tc.reason) {
				t.Fatalf("Pollgate-Escalation = %q, want %s (%s)", got, tc.reason, g.body)
			}
			if g.json["state"] != tc.state {
				t.Fatalf("state in body = %v, want %s: %s", g.json["state"], tc.state, g.body)
			}
			if g.pg("escalated") != true || g.pg("reason") != string(tc.reason) || g.pg("operation_id") == "" ||
				g.pg("message") == nil || g.pg("options") == nil || g.pg("provider_job_id") != job {
				t.Fatalf("pollgate object: %s", g.body)
			}
			if tc.reason == rules.ReasonAuthorizationDenied {
				for _, o := range g.pg("options").([]any) {
					if o.(map[string]any)["action"] == "extend" {
						t.Fatal("authorization_denied offers another identical request (R18)")
					}
				}
			}
			// Replays: answered from the record, provider untouched.
			n := h.prov.pollCount(job)
			h.clock.Advance(time.Second)
			g2 := h.poll(job)
			if g2.h.Get(HeaderDecision) != DecisionEscalated || g2.h.Get(HeaderEscalation) != string(tc.reason) {
				t.Fatalf("replay: %q %s", g2.h.Get(HeaderDecision), g2.body)
			}
			if h.prov.pollCount(job) != n {
				t.Fatal("escalated job still contacts the provider")
			}
		})
	}
}

// R3: a success state without its required field is not ready: the agent
// sees the first waiting state and a pollgate note.
func TestNotReady(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true})
	h.prov.script("job_nr", state("succeeded"), succeeded())
	g := h.poll("job_nr")
	if g.h.Get(HeaderDecision) != DecisionNotReady || g.json["state"] != "queued" || g.pg("not_ready") != true {
		t.Fatalf("not ready: %q %s", g.h.Get(HeaderDecision), g.body)
	}
	h.waitForSlot("job_nr")
	g = h.poll("job_nr")
	if g.json["state"] != "succeeded" || g.h.Get(HeaderDecision) != DecisionForwarded {
		t.Fatalf("after fields arrived: %s", g.body)
	}
}

// gzip from the provider is classified and answered decompressed.
func TestGzipProviderBody(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true})
	h.prov.script("job_gz", answer{code: 200, body: `{"state":"running"}`, gzip: true})
	g := h.poll("job_gz")
	if g.code != 200 || g.json["state"] != "running" || g.h.Get(HeaderDecision) != DecisionForwarded {
		t.Fatalf("gzip: %d %s", g.code, g.body)
	}
}

// R23: a result call before success is refused with 409, not forwarded.
func TestResultBeforeSuccess(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true})
	h.prov.script("job_r", state("running"))
	h.poll("job_r")
	g := h.do("GET", "/v1/jobs/job_r/result", "", nil)
	if g.code != http.StatusConflict || g.h.Get(HeaderDecision) != DecisionRefused {
		t.Fatalf("result before success: %d %s", g.code, g.body)
	}
	h.prov.mu.Lock()
	acts := len(h.prov.actions)
	h.prov.mu.Unlock()
	if acts != 0 {
		t.Fatal("result call reached the provider before success")
	}
}

// R23: a cancel call is forwarded, recorded, and ends the operation
// job_cancelled when the provider confirms.
func TestCancelRecorded(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true})
	h.prov.script("job_c", state("running"))
	h.poll("job_c")
	g := h.do("POST", "/v1/jobs/job_c/cancel", "", nil)
	if g.code != 200 || g.h.Get(HeaderDecision) != DecisionForwarded {
		t.Fatalf("cancel: %d %s", g.code, g.body)
	}
	op := h.op("job_c")
	if len(op.Actions) != 1 || op.Actions[0].Kind != rules.KindCancel {
		t.Fatalf("actions %+v", op.Actions)
	}
	if op.Phase != rules.PhaseStopped || op.Escalation == nil || op.Escalation.Reason != rules.ReasonJobCancelled {
		t.Fatalf("after confirmed cancel: phase %s escalation %+v", op.Phase, op.Escalation)
	}
	g = h.poll("job_c")
	if g.h.Get(HeaderEscalation) != string(rules.ReasonJobCancelled) || g.json["state"] != "cancelled" {
		t.Fatalf("poll after cancel: %s", g.body)
	}
}

// R20: an identical submission while the first is waiting is refused with
// 409 and not forwarded; with an idempotency key it goes through.
func TestResubmissionBlocked(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true})
	body := `{"input":"same"}`
	if g := h.do("POST", "/v1/jobs", body, nil); g.code != 202 {
		t.Fatalf("first submit: %d", g.code)
	}
	g := h.do("POST", "/v1/jobs", body, nil)
	if g.code != http.StatusConflict || g.h.Get(HeaderEscalation) != string(rules.ReasonResubmissionBlocked) ||
		g.pg("reason") != string(rules.ReasonResubmissionBlocked) {
		t.Fatalf("resubmission: %d %q %s", g.code, g.h.Get(HeaderEscalation), g.body)
	}
	if n := h.prov.submits.Load(); n != 1 {
		t.Fatalf("provider saw %d submissions, want 1", n)
	}
	g = h.do("POST", "/v1/jobs", body, map[string]string{"Idempotency-Key": "k-1"})
	if g.code != 202 {
		t.Fatalf("with idempotency key: %d %s", g.code, g.body)
	}
	if h.op("job_2").IdempotencyKey != "k-1" {
		t.Fatal("idempotency key not stored")
	}
	// A different body is a different request.
	if g := h.do("POST", "/v1/jobs", `{"input":"other"}`, nil); g.code != 202 {
		t.Fatalf("different submission: %d", g.code)
	}
}

// R20, R24: a person may allow one resubmission; it is used once.
func TestResubmissionAllowedOnce(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true})
	body := `{"input":"again"}`
	if g := h.do("POST", "/v1/jobs", body, nil); g.code != 202 {
		t.Fatalf("first submit: %d", g.code)
	}
	first := h.op("job_1")
	_, err := h.bolt.Update(context.Background(), first.ID, h.clock.Now(), func(op *rules.Operation) (audit.Entry, error) {
		op.ResubmissionAllowed = true
		return audit.Entry{Event: "resubmission_allowed", Actor: "test", Story: "allowed one resubmission"}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if g := h.do("POST", "/v1/jobs", body, nil); g.code != 202 {
		t.Fatalf("allowed resubmission: %d %s", g.code, g.body)
	}
	if h.op("job_1").ResubmissionAllowed {
		t.Fatal("the allowance was not used up")
	}
	// job_2 now waits with the same fingerprint: a third copy is blocked.
	if g := h.do("POST", "/v1/jobs", body, nil); g.code != http.StatusConflict {
		t.Fatalf("third submit: %d %s", g.code, g.body)
	}
	if n := h.prov.submits.Load(); n != 2 {
		t.Fatalf("provider saw %d submissions, want 2", n)
	}
}

// R23: a result URL taken from the success body ("GET {result_url}") holds
// no job id; the proxy ties it to the operation that succeeded and records
// the call as an action.
func TestResultURLFromSuccessBody(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true, edit: func(c string) string {
		return strings.Replace(c, "request: GET /v1/jobs/{job_id}/result", "request: GET {result_url}", 1)
	}})
	h.prov.script("job_u", answer{code: 200, body: `{"state":"succeeded","result_url":"` + h.base + `/files/job_u.json"}`})
	if g := h.poll("job_u"); g.json["state"] != "succeeded" {
		t.Fatalf("poll: %s", g.body)
	}
	g := h.do("GET", "/files/job_u.json?download=1", "", nil)
	if g.code != 200 || g.h.Get(HeaderDecision) != DecisionForwarded || g.h.Get(HeaderOperation) == "" {
		t.Fatalf("result call: %d %v %s", g.code, g.h, g.body)
	}
	if acts := h.op("job_u").Actions; len(acts) != 1 || acts[0].Kind != rules.KindResult {
		t.Fatalf("actions = %+v", acts)
	}
	// Another file on the same host is not a governed call.
	if g := h.do("GET", "/files/other.json", "", nil); g.code != 200 || g.h.Get(HeaderDecision) != "" {
		t.Fatalf("unrelated file: %d %q", g.code, g.h.Get(HeaderDecision))
	}
}

// An agent-chosen operation id that already names another job does not
// break the second job: it gets a generated id.
func TestDuplicateAgentOperationID(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true})
	hdr := map[string]string{"Pollgate-Operation": "my-op"}
	if g := h.do("GET", "/v1/jobs/job_a", "", hdr); g.code != 200 || g.h.Get(HeaderOperation) != "my-op" {
		t.Fatalf("first job: %d %q", g.code, g.h.Get(HeaderOperation))
	}
	g := h.do("GET", "/v1/jobs/job_b", "", hdr)
	if g.code != 200 || g.h.Get(HeaderOperation) == "my-op" || g.h.Get(HeaderOperation) == "" {
		t.Fatalf("second job: %d %q %s", g.code, g.h.Get(HeaderOperation), g.body)
	}
	// An invalid id is ignored.
	g = h.do("GET", "/v1/jobs/job_c", "", map[string]string{"Pollgate-Operation": "bad id/../x"})
	if g.code != 200 || !strings.HasPrefix(g.h.Get(HeaderOperation), "op_") {
		t.Fatalf("invalid id: %d %q", g.code, g.h.Get(HeaderOperation))
	}
}
