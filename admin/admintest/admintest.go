// Package admintest builds fixtures for tests of the operators' surface: a
// small contract, a real bbolt ledger in a temporary directory, and
// operations driven through the rules decision core into the phases an
// operator meets (waiting, escalated for a given reason, succeeded). It is
// imported only by tests.
package admintest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"pollgate/audit"
	"pollgate/ledger"
	"pollgate/rules"
)

// ContractYAML has two providers; acme offers one extension of at most 15m
// and 4 status requests and has a cancel call.
const ContractYAML = `version: 1
defaults:
  policy:
    deadline: 40m
    max_status_requests: 12
    extension: {duration: 15m, status_requests: 4, max_extensions: 1}
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
    cancel:
      request: POST /v1/jobs/{job_id}/cancel
  - name: globex
    base_url: https://api.globex.test
    status:
      request: GET /v2/tasks/{task_id}
      state: state
      states:
        waiting: [pending]
        success: [complete]
        failure: [error]
`

// Start is the clock origin of every fixture: 2026-12-02 10:20:00 UTC.
var Start = time.Date(2026, 12, 2, 10, 20, 0, 0, time.UTC)

// Contract parses ContractYAML.
func Contract(t testing.TB) *rules.Contract {
	t.Helper()
	c, err := rules.Parse("providers.yaml", []byte(ContractYAML))
	if err != nil {
		t.Fatalf("fixture contract: %v", err)
	}
	return c
}

// Store opens a bbolt ledger in a temporary directory (closed at cleanup).
func Store(t testing.TB, key []byte) *ledger.BoltStore {
	t.Helper()
	return StoreIn(t, t.TempDir(), key)
}

// StoreIn opens a bbolt ledger in dir (closed at cleanup).
func StoreIn(t testing.TB, dir string, key []byte) *ledger.BoltStore {
	t.Helper()
	s, err := ledger.OpenBolt(dir, ledger.BoltOptions{NoSync: true, AuditKey: key, LockTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatalf("open ledger: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// Seeder creates operations with a story through the decision core.
type Seeder struct {
	T        testing.TB
	Store    ledger.Store
	Contract *rules.Contract
	rnd      *rand.Rand
	n        int
}

// NewSeeder returns a Seeder over store and c.
func NewSeeder(t testing.TB, store ledger.Store, c *rules.Contract) *Seeder {
	return &Seeder{T: t, Store: store, Contract: c, rnd: rand.New(rand.NewPCG(7, 9))}
}

// Waiting creates a waiting operation of provider that was polled once
// (its first waiting state) at Start+5s.
func (s *Seeder) Waiting(provider string) *rules.Operation {
	s.T.Helper()
	ctx := context.Background()
	p := s.Contract.ProviderByName(provider)
	if p == nil {
		s.T.Fatalf("fixture: no provider %q", provider)
	}
	s.n++
	id := fmt.Sprintf("op_%s_%02d", provider, s.n)
	op := rules.NewOperation(p, s.Contract, id, fmt.Sprintf("job_%02d", s.n), "acct_fp", rules.OriginSubmission, Start, s.rnd)
	op, _, err := s.Store.Create(ctx, op, audit.Entry{Time: Start, Event: "created", DeadlineAt: op.DeadlineAt,
		Story: rules.CreatedStory(op)})
	if err != nil {
		s.T.Fatalf("fixture create: %v", err)
	}
	at := Start.Add(5 * time.Second)
	res, err := s.Store.Reserve(ctx, ledger.KeyOf(op), "fixture", time.Minute, at)
	if err != nil {
		s.T.Fatalf("fixture reserve: %v", err)
	}
	if res.Outcome != ledger.Reserved {
		// Submission records wait one backoff step first; poll when allowed.
		at = res.Op.NextPollAt
		if res, err = s.Store.Reserve(ctx, ledger.KeyOf(op), "fixture", time.Minute, at); err != nil || res.Outcome != ledger.Reserved {
			s.T.Fatalf("fixture reserve at %v: %v %v", at, res.Outcome, err)
		}
	}
	d := rules.OnResponse(p, res.Op, rules.Response{StatusCode: 200, Body: []byte(statusBody(p, p.Status.States.Waiting[0])), At: at}, at, s.rnd)
	if d.Action != rules.ActWait {
		s.T.Fatalf("fixture: waiting state answered %s (%s)", d.Action, d.Story)
	}
	op, err = s.Store.Complete(ctx, res, d.Op, audit.Entry{Time: at, Event: "polled", Decision: string(d.Action), State: d.State,
		HTTPStatus: 200, NextPollAt: d.NextPollAt, DelaySource: string(d.DelaySource), Story: d.Story})
	if err != nil {
		s.T.Fatalf("fixture complete: %v", err)
	}
	return op
}

func statusBody(p *rules.Provider, state string) string {
	return fmt.Sprintf(`{%q:%q}`, p.Status.State, state)
}

// Escalated creates an operation that escalated with reason at Start+10m.
func (s *Seeder) Escalated(provider string, reason rules.Reason) *rules.Operation {
	s.T.Helper()
	op := s.Waiting(provider)
	p := s.Contract.ProviderByName(provider)
	at := Start.Add(10 * time.Minute)
	d := rules.EscalateNow(p, op, reason, "fixture: "+string(reason), at)
	out, err := s.Store.Escalate(context.Background(), ledger.KeyOf(op), d.Op,
		audit.Entry{Time: at, Event: "escalated", Decision: string(d.Action), Reason: string(reason), Story: d.Story})
	if err != nil {
		s.T.Fatalf("fixture escalate: %v", err)
	}
	if out.Phase != rules.PhaseEscalated {
		s.T.Fatalf("fixture escalate: phase %s", out.Phase)
	}
	return out
}

// Succeeded creates an operation whose job finished (state done) at Start+2m.
func (s *Seeder) Succeeded(provider string) *rules.Operation {
	s.T.Helper()
	ctx := context.Background()
	op := s.Waiting(provider)
	p := s.Contract.ProviderByName(provider)
	at := Start.Add(2 * time.Minute)
	res, err := s.Store.Reserve(ctx, ledger.KeyOf(op), "fixture", time.Minute, at)
	if err != nil || res.Outcome != ledger.Reserved {
		s.T.Fatalf("fixture reserve: %v %v", res.Outcome, err)
	}
	success := p.Status.States.Success[0]
	d := rules.OnResponse(p, res.Op, rules.Response{StatusCode: 200, Body: []byte(statusBody(p, success)), At: at}, at, s.rnd)
	if d.Action != rules.ActSucceed {
		s.T.Fatalf("fixture: %s answered %s (%s)", success, d.Action, d.Story)
	}
	out, err := s.Store.Complete(ctx, res, d.Op, audit.Entry{Time: at, Event: "polled", Decision: string(d.Action), State: d.State,
		HTTPStatus: 200, Story: d.Story})
	if err != nil {
		s.T.Fatalf("fixture complete: %v", err)
	}
	return out
}

// EarlyPoll counts one early poll on op (a Reserve before its slot).
func (s *Seeder) EarlyPoll(op *rules.Operation) {
	s.T.Helper()
	res, err := s.Store.Reserve(context.Background(), ledger.KeyOf(op), "fixture", time.Minute, Start)
	if err != nil || res.Outcome != ledger.TooEarly {
		s.T.Fatalf("fixture early poll: %v %v", res.Outcome, err)
	}
}

// ResubmissionBlocked creates a waiting operation and records a refused
// identical submission on it, as the proxy does (R20): an audit entry
// "resubmission_blocked", the phase unchanged.
func (s *Seeder) ResubmissionBlocked(provider string) *rules.Operation {
	s.T.Helper()
	op := s.Waiting(provider)
	at := Start.Add(time.Minute)
	out, err := s.Store.Update(context.Background(), op.ID, at, func(o *rules.Operation) (audit.Entry, error) {
		return audit.Entry{Time: at, Event: "resubmission_blocked", Decision: "refused", Reason: string(rules.ReasonResubmissionBlocked),
			Story: "identical submission refused (no idempotency key), resubmission blocked"}, nil
	})
	if err != nil {
		s.T.Fatalf("fixture resubmission blocked: %v", err)
	}
	return out
}

// UseResubmission consumes an allowed resubmission, as the proxy does when
// the identical submission arrives.
func (s *Seeder) UseResubmission(op *rules.Operation) {
	s.T.Helper()
	at := Start.Add(2 * time.Minute)
	_, err := s.Store.Update(context.Background(), op.ID, at, func(o *rules.Operation) (audit.Entry, error) {
		if !o.ResubmissionAllowed {
			return audit.Entry{}, ledger.ErrConflict
		}
		o.ResubmissionAllowed = false
		return audit.Entry{Time: at, Event: "resubmission_used", Story: "identical submission forwarded once, as a person allowed"}, nil
	})
	if err != nil {
		s.T.Fatalf("fixture use resubmission: %v", err)
	}
}
