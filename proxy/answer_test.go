package proxy

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/tidwall/gjson"

	"pollgate/rules"
)

func answerProvider(t testing.TB, boolean bool) *rules.Provider {
	states := "waiting: [queued, running]\n        success: [succeeded]\n        failure: [failed]"
	state := "state"
	if boolean {
		states = "waiting: [false]\n        success: [true]"
		state = "done"
	}
	c, err := rules.Parse("p.yaml", []byte(`version: 1
providers:
  - name: p
    base_url: https://api.example.com
    status:
      request: GET /v1/jobs/{job_id}
      state: `+state+`
      states:
        `+states+`
`))
	if err != nil {
		t.Fatal(err)
	}
	return c.Providers[0]
}

func escalatedOp(phase rules.Phase, last string, body []byte, truncated bool) *rules.Operation {
	now := time.Date(2026, 3, 2, 10, 58, 0, 0, time.UTC)
	op := &rules.Operation{ID: "op_1", Provider: "p", JobID: "j1", Phase: phase, LastState: last,
		StartedAt: now.Add(-38 * time.Minute), DeadlineAt: now.Add(2 * time.Minute), LastHTTP: 200, LastHTTPAt: now,
		Used: rules.Counters{StatusRequests: 12}, Budget: rules.Budget{StatusRequests: 12},
		Escalation: &rules.Escalation{Reason: rules.ReasonRequestBudgetExhausted, Message: "m", At: now,
			Options: []rules.Option{{Action: "inspect", Description: "inspect"}}}}
	if body != nil {
		op.Terminal = &rules.StoredResponse{StatusCode: 200, Body: body, Truncated: truncated}
	}
	return op
}

// R18: the escalation body keeps the provider's shape, writes the state
// that ends a legacy loop, and carries the pollgate object.
func TestEscalationBodyShapes(t *testing.T) {
	p := answerProvider(t, false)
	cases := []struct {
		name  string
		op    *rules.Operation
		state string
	}{
		{"provider body", escalatedOp(rules.PhaseEscalated, "running", []byte(`{"id":"j1","state":"running","n":1}`), false), "failed"},
		{"no provider body", escalatedOp(rules.PhaseEscalated, "", nil, false), "failed"},
		{"provider ended it", escalatedOp(rules.PhaseStopped, "failed", []byte(`{"id":"j1","state":"failed","error":"x"}`), false), "failed"},
		{"not json", escalatedOp(rules.PhaseEscalated, "", []byte(`<html>`), false), "failed"},
		{"truncated", escalatedOp(rules.PhaseEscalated, "", []byte(`{"id":"j1","sta`), true), "failed"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := escalationBody(p, tc.op)
			if !json.Valid(b) {
				t.Fatalf("invalid JSON: %s", b)
			}
			if s := gjson.GetBytes(b, "state").String(); s != tc.state {
				t.Fatalf("state %q, want %q: %s", s, tc.state, b)
			}
			pg := gjson.GetBytes(b, "pollgate")
			for _, k := range []string{"escalated", "reason", "message", "options", "operation_id", "provider_job_id", "last_state",
				"elapsed_seconds", "status_requests_used", "status_requests_max", "deadline_at"} {
				if !pg.Get(k).Exists() {
					t.Fatalf("pollgate.%s missing: %s", k, b)
				}
			}
			if pg.Get("elapsed_seconds").Int() != 38*60 {
				t.Fatalf("elapsed %d", pg.Get("elapsed_seconds").Int())
			}
			if tc.op.Terminal != nil && !pg.Get("provider_body").Exists() {
				t.Fatalf("provider_body missing: %s", b)
			}
		})
	}
	// The provider's other fields survive.
	b := escalationBody(p, cases[0].op)
	if gjson.GetBytes(b, "n").Int() != 1 || gjson.GetBytes(b, "pollgate.provider_body.state").String() != "running" {
		t.Fatalf("provider fields lost: %s", b)
	}
}

// A boolean state (Google LRO "done") is written as a JSON boolean.
func TestEscalationBodyBooleanState(t *testing.T) {
	p := answerProvider(t, true)
	p.Escalation.StateValue = "true"
	b := escalationBody(p, escalatedOp(rules.PhaseEscalated, "false", []byte(`{"name":"operations/1","done":false}`), false))
	if r := gjson.GetBytes(b, "done"); r.Type != gjson.True {
		t.Fatalf("done = %s, want JSON true: %s", r.Raw, b)
	}
	nr := notReadyBody(p, escalatedOp(rules.PhaseWaiting, "true", nil, false), []byte(`{"done":true}`), "why")
	if r := gjson.GetBytes(nr, "done"); r.Type != gjson.False {
		t.Fatalf("not ready done = %s, want false: %s", r.Raw, nr)
	}
}

func TestRetryAfterSeconds(t *testing.T) {
	for _, c := range []struct {
		d    time.Duration
		want int
	}{{0, 1}, {-time.Second, 1}, {time.Millisecond, 1}, {time.Second, 1}, {1001 * time.Millisecond, 2}, {119500 * time.Millisecond, 120}} {
		if got := retryAfterSeconds(c.d); got != c.want {
			t.Errorf("retryAfterSeconds(%s) = %d, want %d", c.d, got, c.want)
		}
	}
}

// Whatever a provider sends, the escalation and not-ready bodies are valid
// JSON objects with the pollgate object.
func FuzzEscalationBody(f *testing.F) {
	for _, s := range []string{`{"state":"running"}`, `[]`, `"x"`, `{"state":{"a":1}}`, `{"pollgate":1}`, ``, `{`, `{"state":true}`} {
		f.Add([]byte(s), false)
	}
	p := answerProvider(f, false)
	f.Fuzz(func(t *testing.T, body []byte, truncated bool) {
		for _, ph := range []rules.Phase{rules.PhaseEscalated, rules.PhaseStopped} {
			b := escalationBody(p, escalatedOp(ph, "failed", body, truncated))
			if !json.Valid(b) || !gjson.GetBytes(b, "pollgate.escalated").Bool() {
				t.Fatalf("escalation body for %q: %s", body, b)
			}
		}
		nr := notReadyBody(p, escalatedOp(rules.PhaseWaiting, "succeeded", nil, false), body, "note")
		if !json.Valid(nr) || !gjson.GetBytes(nr, "pollgate.not_ready").Bool() || gjson.GetBytes(nr, "state").String() != "queued" {
			t.Fatalf("not-ready body for %q: %s", body, nr)
		}
	})
}
