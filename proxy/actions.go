package proxy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/tidwall/gjson"

	"pollgate/audit"
	"pollgate/ledger"
	"pollgate/rules"
)

// result governs a result call (R23): refused with 409 before the job
// succeeded, forwarded (streamed) and recorded as its own action after.
func (p *Proxy) result(cl *call) *http.Response {
	req, prov := cl.req, cl.prov
	if cl.m.JobID == "" {
		return p.passThrough(req) // not seen succeed here: cannot be tied to a record
	}
	account := rules.AccountFingerprint(p.cfg.AccountKey, req.Header.Get(accountHeader(prov)))
	return p.resultFor(cl, ledger.Key{Provider: prov.Name, Account: account, JobID: cl.m.JobID})
}

// resultFor governs a result call for the operation with key.
func (p *Proxy) resultFor(cl *call, key ledger.Key) *http.Response {
	req, prov := cl.req, cl.prov
	op, err := step(p, "get", func(ctx context.Context) (*rules.Operation, error) {
		return p.cfg.Store.Get(ctx, key)
	})
	if err != nil && !errors.Is(err, ledger.ErrNotFound) {
		return p.ledgerDown(cl, "get", err)
	}
	if op == nil || !(op.Phase == rules.PhaseSucceeded || (op.Phase == rules.PhaseClosed && op.Escalation == nil)) {
		state, phase := "(unknown)", "no record"
		if op != nil {
			state, phase = op.LastState, string(op.Phase)
		}
		resp := jsonResponse(req, http.StatusConflict, map[string]any{
			"error":           "result_not_ready",
			"message":         fmt.Sprintf("job %s has not succeeded (%s, last state %s): fetching its result is allowed only after a status call saw success (R23)", cl.m.JobID, phase, state),
			"provider_job_id": cl.m.JobID,
			"phase":           phase,
		})
		setGoverned(resp.Header, op, DecisionRefused)
		return resp
	}
	up, err := p.send(prov.Name, upstreamRequest(req))
	now := p.cfg.Now()
	rec := rules.ActionRecord{Kind: rules.KindResult, At: now}
	if err != nil {
		rec.Error = errText(err)
	} else {
		rec.HTTPStatus = up.StatusCode
	}
	p.recordAction(cl, op, rec, nil, now)
	if err != nil {
		return errorResponse(req, http.StatusBadGateway, "upstream_unreachable", "the provider did not answer the result call: "+errText(err))
	}
	stripHopResponse(up)
	setGoverned(up.Header, op, DecisionForwarded)
	return up
}

// cancel governs a cancel call (R23): forwarded and recorded as its own
// action; when the provider's answer already shows a cancelled state, the
// operation ends job_cancelled.
func (p *Proxy) cancel(cl *call) *http.Response {
	req, prov := cl.req, cl.prov
	var op *rules.Operation
	if cl.m.JobID != "" {
		account := rules.AccountFingerprint(p.cfg.AccountKey, req.Header.Get(accountHeader(prov)))
		key := ledger.Key{Provider: prov.Name, Account: account, JobID: cl.m.JobID}
		var err error
		op, err = step(p, "get", func(ctx context.Context) (*rules.Operation, error) {
			return p.cfg.Store.Get(ctx, key)
		})
		if err != nil && !errors.Is(err, ledger.ErrNotFound) {
			return p.ledgerDown(cl, "get", err)
		}
	}
	up, err := p.send(prov.Name, upstreamRequest(req))
	now := p.cfg.Now()
	if err != nil {
		if op != nil {
			p.recordAction(cl, op, rules.ActionRecord{Kind: rules.KindCancel, At: now, Error: errText(err)}, nil, now)
		}
		return errorResponse(req, http.StatusBadGateway, "upstream_unreachable", "the provider did not answer the cancel call: "+errText(err))
	}
	stripHopResponse(up)
	if op == nil {
		up.Header.Set(HeaderDecision, DecisionForwarded)
		return up
	}
	body, err := readBody(up, p.cfg.MaxBody)
	if err != nil {
		p.recordAction(cl, op, rules.ActionRecord{Kind: rules.KindCancel, At: now, Error: errText(err)}, nil, now)
		return errorResponse(req, http.StatusBadGateway, "upstream_unreachable", "failed to read the provider's cancel answer: "+errText(err))
	}
	var confirmed *rules.Response
	if up.StatusCode >= 200 && up.StatusCode <= 299 && body.Body != nil {
		state := gjson.GetBytes(body.Body, prov.Status.State).String()
		for _, s := range prov.Status.States.Cancelled {
			if s == state {
				confirmed = &rules.Response{StatusCode: up.StatusCode, Header: up.Header, Body: body.Body, At: now}
				break
			}
		}
	}
	updated := p.recordAction(cl, op, rules.ActionRecord{Kind: rules.KindCancel, At: now, HTTPStatus: up.StatusCode}, confirmed, now)
	if updated == nil {
		updated = op
	}
	h := copyProviderHeader(up.Header)
	setGoverned(h, updated, DecisionForwarded)
	return bytesResponse(req, up.StatusCode, h, body.Body)
}

// recordAction appends a result or cancel call to the operation (R23). When
// cancelled holds a provider answer confirming the cancellation, an
// operation that is still waiting or escalated ends job_cancelled.
func (p *Proxy) recordAction(cl *call, op *rules.Operation, rec rules.ActionRecord, cancelled *rules.Response, now time.Time) *rules.Operation {
	updated, err := step(p, "update", func(ctx context.Context) (*rules.Operation, error) {
		return p.cfg.Store.Update(ctx, op.ID, now, func(o *rules.Operation) (audit.Entry, error) {
			o.Actions = append(o.Actions, rec)
			o.UpdatedAt = now
			e := entry(o, "action", nil, now)
			e.Decision = DecisionForwarded
			e.HTTPStatus = rec.HTTPStatus
			what := "fetched the result"
			if rec.Kind == rules.KindCancel {
				what = "cancel call"
			}
			switch {
			case rec.Error != "":
				e.Story = fmt.Sprintf("%s failed: %s", what, rec.Error)
			default:
				e.Story = fmt.Sprintf("%s, HTTP %d", what, rec.HTTPStatus)
			}
			if cancelled != nil && (o.Phase == rules.PhaseWaiting || o.Phase == rules.PhaseEscalated) {
				state := gjson.GetBytes(cancelled.Body, cl.prov.Status.State).String()
				d := rules.EscalateNow(cl.prov, o, rules.ReasonJobCancelled, "the provider confirmed the cancel call (state "+state+")", now)
				n := d.Op
				n.Phase = rules.PhaseStopped
				n.LastState = state
				n.Terminal = &rules.StoredResponse{StatusCode: cancelled.StatusCode, Body: bytes.Clone(cancelled.Body)}
				if len(n.Terminal.Body) > rules.MaxStoredBody {
					n.Terminal.Body, n.Terminal.Truncated = n.Terminal.Body[:rules.MaxStoredBody], true
				}
				*o = *n
				e.Event = "escalated"
				e.Decision = string(rules.ActEscalate)
				e.Reason = string(rules.ReasonJobCancelled)
				e.State = state
				e.NextPollAt = time.Time{}
				e.Story = fmt.Sprintf("%s, HTTP %d, state %s, job cancelled, stopped", what, rec.HTTPStatus, state)
			}
			return e, nil
		})
	})
	if err != nil {
		cl.logger().Error("failed to record an action", "op", op.ID, "kind", rec.Kind, "err", err)
		return nil
	}
	p.gate.remember(ledger.KeyOf(updated), updated)
	if updated.Phase == rules.PhaseStopped && op.Phase != rules.PhaseStopped {
		p.obs.Escalated(updated.Clone())
	}
	return updated
}
