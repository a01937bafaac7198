package proxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"regexp"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/elazarl/goproxy"

	"pollgate/audit"
	"pollgate/ledger"
	"pollgate/rules"
)

// opIDPattern validates an agent-supplied Pollgate-Operation header.
var opIDPattern = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// call is one request on a contract host, as seen by the round tripper.
type call struct {
	req  *http.Request
	c    *rules.Contract
	m    rules.Match
	prov *rules.Provider
	base *slog.Logger // the proxy's logger; logger() adds provider and kind
}

// logger returns the call's child logger. It is built only when a call
// logs (rare paths), not for every governed request.
func (cl *call) logger() *slog.Logger {
	return cl.base.With("provider", cl.prov.Name, "kind", string(cl.m.Kind))
}

// roundTrip is the ctx.RoundTripper installed for contract hosts (MITM'd
// and plain HTTP). It never returns an error - goproxy would drop the
// agent's connection without an answer - and it recovers from panics.
func (p *Proxy) roundTrip(req *http.Request, _ *goproxy.ProxyCtx) (resp *http.Response, err error) {
	defer func() {
		if v := recover(); v != nil {
			p.log.Error("panic in governed round trip", "method", req.Method, "host", req.URL.Host,
				"panic", fmt.Sprint(v), "stack", string(debug.Stack()))
			resp, err = errorResponse(req, http.StatusBadGateway, "internal_error",
				"pollgate failed while handling this call; it was logged (hint: report it with the log line)"), nil
		}
	}()
	agentOpID := req.Header.Get(HeaderOperation)
	req.Header.Del(HeaderOperation) // ours, never forwarded
	c := p.cfg.Contract()
	m, ok := c.Match(req.Method, matchURL(req.URL))
	if !ok || (m.Kind == rules.KindResult && m.JobID == "") {
		// A result URL taken from a success body ("GET {results_url}",
		// "GET /v1/files/{output_file_id}/content") is known only from
		// the operation that succeeded.
		if key, found := p.results.lookup(req.URL); found && req.Method == http.MethodGet {
			if prov := c.ProviderByName(key.Provider); prov != nil {
				cl := &call{req: req, c: c, m: rules.Match{Provider: prov, Kind: rules.KindResult, JobID: key.JobID}, prov: prov, base: p.log}
				resp = p.resultFor(cl, key)
				if d := resp.Header.Get(HeaderDecision); d != "" {
					p.obs.Governed(prov.Name, rules.KindResult, d)
				}
				return resp, nil
			}
		}
		return p.passThrough(req), nil
	}
	cl := &call{req: req, c: c, m: m, prov: m.Provider, base: p.log}
	if agentOpID != "" && opIDPattern.MatchString(agentOpID) {
		req.Header.Set(HeaderOperation, agentOpID) // read back by opID, stripped before forwarding
	}
	switch m.Kind {
	case rules.KindStatus:
		resp = p.status(cl)
	case rules.KindSubmit:
		resp = p.submit(cl)
	case rules.KindResult:
		resp = p.result(cl)
	case rules.KindCancel:
		resp = p.cancel(cl)
	default:
		resp = p.passThrough(req)
	}
	if resp == nil { // never hand goproxy a nil response
		resp = errorResponse(req, http.StatusBadGateway, "internal_error", "pollgate produced no answer")
	}
	if d := resp.Header.Get(HeaderDecision); d != "" {
		p.obs.Governed(cl.prov.Name, m.Kind, d)
	}
	return resp, nil
}

// matchURL strips a default port so https://h:443/x matches https://h/x.
func matchURL(u *url.URL) *url.URL {
	if (u.Scheme == "https" && u.Port() == "443") || (u.Scheme == "http" && u.Port() == "80") {
		v := *u
		v.Host = u.Hostname()
		return &v
	}
	return u
}

// opID is the operation id for a new record: the agent's valid
// Pollgate-Operation header, else a generated one.
func opID(req *http.Request) string {
	if id := req.Header.Get(HeaderOperation); id != "" {
		return id
	}
	return "op_" + randomHex(10)
}

// upstreamRequest prepares req for the provider: detached from the agent's
// cancellation (a reserved request is completed and committed even if the
// agent hangs up), without pollgate's own headers.
func upstreamRequest(req *http.Request) *http.Request {
	out := req.Clone(context.WithoutCancel(req.Context()))
	out.Header.Del(HeaderOperation)
	out.RequestURI = ""
	return out
}

// send performs one upstream round trip and reports it to the observer.
func (p *Proxy) send(prov string, req *http.Request) (*http.Response, error) {
	start := time.Now()
	resp, err := p.tr.RoundTrip(req)
	code := 0
	if err == nil {
		code = resp.StatusCode
	}
	p.obs.Upstream(prov, code, time.Since(start))
	return resp, err
}

// errText describes a transport error without the request URL, whose
// query may hold a key (?key=...) that must not reach the ledger or logs.
func errText(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Op + ": " + ue.Err.Error()
	}
	return err.Error()
}

// passThrough forwards a request on a contract host that no template
// governs (or that cannot be governed), streaming the answer.
func (p *Proxy) passThrough(req *http.Request) *http.Response {
	resp, err := p.send("", upstreamRequest(req))
	if err != nil {
		return errorResponse(req, http.StatusBadGateway, "upstream_unreachable", "the provider did not answer: "+errText(err))
	}
	stripHopResponse(resp)
	return resp
}

func (p *Proxy) ledgerCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), p.cfg.LedgerTimeout)
}

// step runs one ledger step with a timeout and reports it to the observer.
func step[T any](p *Proxy, name string, fn func(ctx context.Context) (T, error)) (T, error) {
	ctx, cancel := p.ledgerCtx()
	defer cancel()
	start := time.Now()
	v, err := fn(ctx)
	p.obs.Ledger(name, time.Since(start), err)
	return v, err
}

// entry builds the audit entry of a committed decision (R25). The ledger
// fills the identity and counter fields from the committed record.
func entry(op *rules.Operation, event string, d *rules.Decision, now time.Time) audit.Entry {
	e := audit.Entry{
		Time:        now,
		OperationID: op.ID,
		Provider:    op.Provider,
		JobID:       op.JobID,
		Event:       event,
		State:       op.LastState,
		HTTPStatus:  op.LastHTTP,
		NextPollAt:  op.NextPollAt,
		DelaySource: string(op.DelaySource),
		Used:        op.Used.StatusRequests,
		Max:         op.Budget.StatusRequests,
		DeadlineAt:  op.DeadlineAt,
	}
	if d != nil {
		e.Decision = string(d.Action)
		e.Story = d.Story
		if d.State != "" {
			e.State = d.State
		}
		if d.Action == rules.ActEscalate {
			e.Reason = string(d.Reason)
			e.NextPollAt = time.Time{}
			e.DelaySource = ""
		}
	}
	return e
}

// status governs one status call (R9, R21): answer from the record when the
// job has ended, 429 when too early or busy, escalate when the deadline or
// budget is spent, else reserve, forward once, classify, commit, answer.
func (p *Proxy) status(cl *call) *http.Response {
	req, prov := cl.req, cl.prov
	if cl.m.JobID == "" {
		return p.passThrough(req)
	}
	account := rules.AccountFingerprint(p.cfg.AccountKey, req.Header.Get(accountHeader(prov)))
	key := ledger.Key{Provider: prov.Name, Account: account, JobID: cl.m.JobID}
	now := p.cfg.Now()
	if snap, wait, early := p.gate.check(key, now); early {
		p.gate.record(earlyPoll{key: key, at: now, lease: prov.Policy.Lease})
		p.obs.EarlyPoll(prov.Name)
		return tooEarlyResponse(req, snap, wait, now, false)
	}
	res, err := p.reserve(key, prov, now)
	if err != nil {
		return p.ledgerDown(cl, "reserve", err)
	}
	if res.Outcome == ledger.NotFound {
		// Legacy agents: the record is created on the first status call.
		op := rules.NewOperation(prov, cl.c, opID(req), cl.m.JobID, account, rules.OriginFirstStatusCal, now, p.rnd)
		op.StatusURL = req.URL.String()
		e := entry(op, "created", nil, now)
		e.Story = rules.CreatedStory(op)
		if _, err := p.create(cl, op, e); err != nil {
			return p.ledgerDown(cl, "create", err)
		}
		if res, err = p.reserve(key, prov, now); err != nil {
			return p.ledgerDown(cl, "reserve", err)
		}
		if res.Outcome == ledger.NotFound {
			return p.ledgerDown(cl, "reserve", errors.New("the record just created is missing"))
		}
	}
	switch res.Outcome {
	case ledger.Terminal:
		p.indexResult(prov, res.Op, cl.m.Params)
		return p.replay(req, prov, res.Op)
	case ledger.TooEarly, ledger.Busy:
		if res.Outcome == ledger.TooEarly {
			p.gate.remember(key, res.Op)
		}
		p.obs.EarlyPoll(prov.Name)
		return tooEarlyResponse(req, res.Op, res.Wait, now, res.Outcome == ledger.Busy)
	case ledger.DeadlineReached, ledger.BudgetExhausted:
		return p.escalateBeforeSend(cl, key, res, now)
	case ledger.Reserved:
		return p.poll(cl, res)
	}
	return p.ledgerDown(cl, "reserve", fmt.Errorf("unexpected reserve outcome %q", res.Outcome))
}

type created struct {
	op  *rules.Operation
	new bool
}

// create stores a new record. When the agent's Pollgate-Operation id
// already names another job, the record gets a generated id instead.
func (p *Proxy) create(cl *call, op *rules.Operation, e audit.Entry) (created, error) {
	do := func() (created, error) {
		return step(p, "create", func(ctx context.Context) (created, error) {
			o, n, err := p.cfg.Store.Create(ctx, op, e)
			return created{o, n}, err
		})
	}
	cr, err := do()
	if errors.Is(err, ledger.ErrConflict) {
		cl.logger().Warn("operation id from Pollgate-Operation names another job; using a generated id", "id", op.ID)
		op.ID = "op_" + randomHex(10)
		e.OperationID = op.ID
		cr, err = do()
	}
	return cr, err
}

func accountHeader(p *rules.Provider) string {
	if p.AccountHeader != "" {
		return p.AccountHeader
	}
	return rules.DefaultAccountHeader
}

func (p *Proxy) reserve(key ledger.Key, prov *rules.Provider, now time.Time) (ledger.Reservation, error) {
	return step(p, "reserve", func(ctx context.Context) (ledger.Reservation, error) {
		return p.cfg.Store.Reserve(ctx, key, p.cfg.HolderID, prov.Policy.Lease, now)
	})
}

// ledgerDown answers 503 for a governed call the ledger could not count.
func (p *Proxy) ledgerDown(cl *call, stepName string, err error) *http.Response {
	cl.logger().Error("ledger step failed; governed call refused (fail closed)", "step", stepName, "err", err)
	return unavailableResponse(cl.req, err)
}

// replay answers a status call from a terminal record without contacting
// the provider: the escalation body, or the stored terminal response.
func (p *Proxy) replay(req *http.Request, prov *rules.Provider, op *rules.Operation) *http.Response {
	if op.Escalation != nil {
		return escalationResponse(req, prov, op, 0)
	}
	code, h, body := http.StatusOK, http.Header{}, []byte(nil)
	if t := op.Terminal; t != nil {
		code = t.StatusCode
		for k, v := range t.Header {
			h.Set(k, v)
		}
		body = t.Body
	}
	if code == 0 {
		code = http.StatusOK
	}
	h.Set(headerCacheCtl, "no-store")
	setGoverned(h, op, DecisionReplayed)
	return bytesResponse(req, code, h, body)
}

// escalateBeforeSend commits the escalation Reserve found (deadline or
// budget) and answers with the escalation body.
func (p *Proxy) escalateBeforeSend(cl *call, key ledger.Key, res ledger.Reservation, now time.Time) *http.Response {
	d := rules.BeforeSend(cl.prov, res.Op, now)
	if d.Action != rules.ActEscalate {
		reason, why := rules.ReasonDeadlineExceeded, "the deadline has passed"
		if res.Outcome == ledger.BudgetExhausted {
			reason, why = rules.ReasonRequestBudgetExhausted, "all status requests are used"
		}
		d = rules.EscalateNow(cl.prov, res.Op, reason, why, now)
	}
	stored, err := step(p, "escalate", func(ctx context.Context) (*rules.Operation, error) {
		return p.cfg.Store.Escalate(ctx, key, d.Op, entry(d.Op, "escalated", &d, now))
	})
	if err != nil {
		return p.ledgerDown(cl, "escalate", err)
	}
	if !stored.Phase.Terminal() {
		// A poll of this job is still in flight; its answer decides.
		wait := stored.Lease.ExpiresAt.Sub(now)
		if wait <= 0 {
			wait = time.Second
		}
		return tooEarlyResponse(cl.req, stored, wait, now, true)
	}
	if stored.Escalation != nil && stored.Escalation.At.Equal(now) {
		p.obs.Escalated(stored.Clone())
		cl.logger().Info("operation escalated", "op", stored.ID, "reason", stored.Escalation.Reason)
	}
	return p.replay(cl.req, cl.prov, stored)
}

// poll forwards the one reserved status request, classifies the answer,
// commits the decision and answers the agent.
func (p *Proxy) poll(cl *call, res ledger.Reservation) *http.Response {
	req, prov := cl.req, cl.prov
	up, err := p.send(prov.Name, upstreamRequest(req))
	now := p.cfg.Now()
	var d rules.Decision
	var body bodyRead
	var upResp *http.Response
	if err == nil {
		upResp = up
		body, err = readBody(up, p.cfg.MaxBody)
	}
	if err != nil {
		d = rules.OnTransportError(prov, res.Op, errText(err), now, p.rnd)
	} else {
		d = rules.OnResponse(prov, res.Op, rules.Response{
			StatusCode:   upResp.StatusCode,
			Header:       upResp.Header,
			Body:         body.Body,
			BodyTooLarge: body.TooLarge,
			At:           now,
		}, now, p.rnd)
	}
	committed, cerr := step(p, "complete", func(ctx context.Context) (*rules.Operation, error) {
		return p.cfg.Store.Complete(ctx, res, d.Op, entry(d.Op, "polled", &d, now))
	})
	if cerr != nil {
		if errors.Is(cerr, ledger.ErrFenceLost) || errors.Is(cerr, ledger.ErrConflict) {
			cl.logger().Warn("status answer not committed: the operation changed while the request was in flight",
				"op", res.Op.ID, "err", cerr)
			if cur, gerr := step(p, "get", func(ctx context.Context) (*rules.Operation, error) {
				return p.cfg.Store.Get(ctx, res.Key)
			}); gerr == nil && cur.Phase.Terminal() {
				return p.replay(req, prov, cur)
			}
			return tooEarlyResponse(req, res.Op, time.Second, now, true)
		}
		return p.ledgerDown(cl, "complete", cerr)
	}
	p.gate.remember(res.Key, committed)
	p.indexResult(prov, committed, cl.m.Params)
	if d.Action == rules.ActEscalate {
		p.obs.Escalated(committed.Clone())
		cl.logger().Info("operation escalated", "op", committed.ID, "reason", d.Reason, "story", d.Story)
		return escalationResponse(req, prov, committed, 0)
	}
	if upResp == nil {
		// Transport failure, budget not yet spent: 502 the agent can retry later.
		resp := jsonResponse(req, http.StatusBadGateway, map[string]any{
			"error":                "upstream_unreachable",
			"message":              "the provider did not answer (counted as a transport failure); the next poll is allowed at " + ceilSecond(d.NextPollAt).Format(time.RFC3339),
			"operation_id":         committed.ID,
			"next_poll_at":         ceilSecond(d.NextPollAt).Format(time.RFC3339),
			"transport_failures":   committed.Used.TransportFailures,
			"status_requests_used": committed.Used.StatusRequests,
			"status_requests_max":  committed.Budget.StatusRequests,
		})
		setGoverned(resp.Header, committed, DecisionForwarded)
		resp.Header.Set(headerRetryAfter, strconv.Itoa(retryAfterSeconds(d.NextPollAt.Sub(now))))
		return resp
	}
	h := copyProviderHeader(upResp.Header)
	switch d.Action {
	case rules.ActNotReady:
		setGoverned(h, committed, DecisionNotReady)
		h.Set(headerRetryAfter, strconv.Itoa(retryAfterSeconds(d.NextPollAt.Sub(now))))
		h.Set(headerCacheCtl, "no-store")
		h.Set(headerContentType, "application/json")
		return bytesResponse(req, upResp.StatusCode, h, notReadyBody(prov, committed, body.Body, d.Note))
	case rules.ActWait:
		setGoverned(h, committed, DecisionForwarded)
		h.Set(headerRetryAfter, strconv.Itoa(retryAfterSeconds(d.NextPollAt.Sub(now))))
	default:
		setGoverned(h, committed, DecisionForwarded)
	}
	return bytesResponse(req, upResp.StatusCode, h, body.Body)
}
