package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"pollgate/audit"
	"pollgate/ledger"
	"pollgate/rules"
)

// submit governs a submission (R4, R14, R20): a repeated identical request
// while the earlier operation is still waiting or escalated is refused
// unless it carries the contract's idempotency header (or a person allowed
// one resubmission); otherwise it is forwarded and, on 2xx, the operation
// record is created before the answer reaches the agent.
func (p *Proxy) submit(cl *call) *http.Response {
	req, prov := cl.req, cl.prov
	var body []byte
	if req.Body != nil && req.Body != http.NoBody {
		b, large, rest, err := peekBody(req.Body, p.cfg.MaxBody)
		if err != nil {
			return errorResponse(req, http.StatusBadRequest, "bad_request", "failed to read the request body: "+errText(err))
		}
		req.Body = rest
		if large {
			// Too large to fingerprint: forwarded, the record comes with the
			// first status call.
			cl.logger().Warn("submission body larger than --max-body; forwarded without a request fingerprint", "max_body", p.cfg.MaxBody)
			return p.passThrough(req)
		}
		body = b
	}
	account := rules.AccountFingerprint(p.cfg.AccountKey, req.Header.Get(accountHeader(prov)))
	fp := rules.RequestFingerprint(req.Method, matchURL(req.URL), body)
	idem := ""
	if prov.Submit != nil && prov.Submit.IdempotencyHeader != "" {
		idem = req.Header.Get(prov.Submit.IdempotencyHeader)
	}
	now := p.cfg.Now()
	if idem == "" {
		prev, err := step(p, "find_submission", func(ctx context.Context) (*rules.Operation, error) {
			return p.cfg.Store.FindSubmission(ctx, prov.Name, account, fp)
		})
		switch {
		case errors.Is(err, ledger.ErrNotFound):
		case err != nil:
			return p.ledgerDown(cl, "find_submission", err)
		case prev.Phase == rules.PhaseWaiting || prev.Phase == rules.PhaseEscalated:
			if resp := p.resubmission(cl, prev, now); resp != nil {
				return resp
			}
		}
	} else if err := p.ping(); err != nil {
		return p.ledgerDown(cl, "ping", err)
	}

	up, err := p.send(prov.Name, upstreamRequest(req))
	if err != nil {
		return errorResponse(req, http.StatusBadGateway, "upstream_unreachable", "the provider did not answer the submission: "+errText(err))
	}
	if up.StatusCode < 200 || up.StatusCode > 299 || isStream(up.Header) {
		stripHopResponse(up)
		h := up.Header
		h.Set(HeaderDecision, DecisionForwarded)
		return up
	}
	peek, large, rest, err := peekBody(up.Body, p.cfg.MaxBody)
	if err != nil {
		return errorResponse(req, http.StatusBadGateway, "upstream_unreachable", "failed to read the provider's submission answer: "+errText(err))
	}
	up.Body = rest
	stripHopResponse(up)
	rr := rules.Response{StatusCode: up.StatusCode, Header: up.Header, At: now, BodyTooLarge: large}
	if !large {
		rr.Body = peek
	}
	sub, err := rules.ParseSubmission(prov, rr, matchURL(req.URL))
	if err != nil {
		cl.logger().Warn("submission answer names no job; no record until the first status call", "err", err)
		up.Header.Set(HeaderDecision, DecisionForwarded)
		return up
	}
	now = p.cfg.Now()
	op := rules.NewOperation(prov, cl.c, opID(req), sub.JobID, account, rules.OriginSubmission, now, p.rnd)
	op.RequestFingerprint = fp
	op.IdempotencyKey = idem
	op.StatusURL = sub.StatusURL
	e := entry(op, "created", nil, now)
	e.Decision = "submitted"
	e.Story = rules.CreatedStory(op)
	cr, err := p.create(cl, op, e)
	if err != nil {
		// The job exists at the provider; the agent must learn its id.
		cl.logger().Error("submission forwarded but its record could not be created; it will be created on the first status call",
			"job", sub.JobID, "err", err)
		up.Header.Set(HeaderDecision, DecisionForwarded)
		return up
	}
	if cr.new {
		cl.logger().Info("operation created", "op", cr.op.ID, "job", cr.op.JobID, "deadline", cr.op.DeadlineAt)
	}
	setGoverned(up.Header, cr.op, DecisionForwarded)
	return up
}

// resubmission handles an identical submission while prev still waits or
// escalated. It returns nil when the submission may go ahead (a person
// allowed one resubmission), else the 409 refusal.
func (p *Proxy) resubmission(cl *call, prev *rules.Operation, now time.Time) *http.Response {
	if prev.ResubmissionAllowed {
		_, err := step(p, "update", func(ctx context.Context) (*rules.Operation, error) {
			return p.cfg.Store.Update(ctx, prev.ID, now, func(op *rules.Operation) (audit.Entry, error) {
				if !op.ResubmissionAllowed {
					return audit.Entry{}, ledger.ErrConflict
				}
				op.ResubmissionAllowed = false
				op.UpdatedAt = now
				e := entry(op, "resubmission_used", nil, now)
				e.Decision = DecisionForwarded
				e.Story = "identical submission forwarded once, as a person allowed"
				return e, nil
			})
		})
		if err == nil {
			return nil
		}
		if !errors.Is(err, ledger.ErrConflict) {
			return p.ledgerDown(cl, "update", err)
		}
		// Someone else used the one allowed resubmission: refuse.
	}
	why := fmt.Sprintf("an identical submission already created operation %s (job %s, %s) and the request carries no idempotency key", prev.ID, prev.JobID, prev.Phase)
	d := rules.EscalateNow(cl.prov, prev, rules.ReasonResubmissionBlocked, why, now)
	_, err := step(p, "update", func(ctx context.Context) (*rules.Operation, error) {
		return p.cfg.Store.Update(ctx, prev.ID, now, func(op *rules.Operation) (audit.Entry, error) {
			op.UpdatedAt = now
			e := entry(op, "resubmission_blocked", nil, now)
			e.Decision = DecisionRefused
			e.Reason = string(rules.ReasonResubmissionBlocked)
			e.Story = "identical submission refused (no idempotency key), resubmission blocked"
			return e, nil
		})
	})
	if err != nil && !errors.Is(err, ledger.ErrConflict) {
		cl.logger().Warn("failed to record a refused resubmission", "op", prev.ID, "err", err)
	}
	view := d.Op
	view.Terminal = nil // nothing was forwarded: no provider body
	resp := escalationResponse(cl.req, cl.prov, view, http.StatusConflict)
	resp.Header.Set(HeaderEscalation, string(rules.ReasonResubmissionBlocked))
	return resp
}

func (p *Proxy) ping() error {
	_, err := step(p, "ping", func(ctx context.Context) (struct{}, error) {
		return struct{}{}, p.cfg.Store.Ping(ctx)
	})
	return err
}
