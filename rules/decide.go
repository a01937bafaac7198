package rules

import (
	"bytes"
	"fmt"
	"math"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/tidwall/gjson"
)

// Limits of what a decision keeps from a provider answer.
const (
	// MaxStoredBody is the largest body kept in Operation.Terminal.
	MaxStoredBody = 64 << 10
	// maxProviderError bounds Operation.ProviderError.
	maxProviderError = 4 << 10
	// rateLimitFactor raises the local backoff after a 429 without Retry-After (R13).
	rateLimitFactor = 4
)

// State classes as they appear in Decision.StateClass.
const (
	ClassWaiting   = "waiting"
	ClassSuccess   = "success"
	ClassFailure   = "failure"
	ClassCancelled = "cancelled"
	ClassExpired   = "expired"
	ClassUnknown   = "unknown"
)

// NewOperation creates the record of a job (R4) before its first status
// request is sent. The deadline is the policy deadline, or the business
// deadline when set and shorter (R19). A record created from the first
// status call may send that call at once; one created at submission waits
// one backoff step (attempt 0) first.
func NewOperation(p *Provider, c *Contract, id, jobID, account string, origin Origin, now time.Time, rnd Rand) *Operation {
	pol := p.Policy
	deadline := pol.Deadline
	if pol.BusinessDeadline > 0 && pol.BusinessDeadline < deadline {
		deadline = pol.BusinessDeadline
	}
	op := &Operation{
		ID:         id,
		Provider:   p.Name,
		JobID:      jobID,
		Account:    account,
		Origin:     origin,
		StartedAt:  now,
		DeadlineAt: now.Add(deadline),
		Budget: Budget{
			StatusRequests:    pol.MaxStatusRequests,
			TransportFailures: pol.MaxTransportFailures,
			RateLimited:       pol.MaxRateLimited,
		},
		Phase:       PhaseWaiting,
		UpdatedAt:   now,
		NextPollAt:  now,
		DelaySource: DelayLocalBackoff,
	}
	if c != nil {
		op.ContractVersion = c.Hash
	}
	if origin == OriginSubmission {
		op.NextPollAt = now.Add(BackoffDelay(pol.Backoff, 0, rnd))
	}
	return op
}

// BeforeSend is the poll gate for an arriving status call (R7, R9, R10):
// a terminal record is replayed; a reached deadline or a spent request
// budget escalates; a call before NextPollAt is too early (Wait says how
// long); otherwise the call may be sent. For ActSend, Op has the
// reservation applied (Used.StatusRequests+1); for ActTooEarly, Op is
// unchanged (counting early polls is the ledger's Reserve's job). The
// ledger's Reserve performs the same checks atomically.
func BeforeSend(p *Provider, op *Operation, now time.Time) Decision {
	o := op.Clone()
	switch {
	case o.Phase.Terminal():
		return Decision{Action: ActReplay, Op: o, State: o.LastState, Reason: reasonOf(o),
			Story: fmt.Sprintf("status call answered from the %s record", o.Phase)}
	case !now.Before(o.DeadlineAt):
		return EscalateNow(p, op, ReasonDeadlineExceeded, fmt.Sprintf("the deadline %s UTC has passed", Clock(o.DeadlineAt)), now)
	case o.Used.StatusRequests >= o.Budget.StatusRequests:
		return EscalateNow(p, op, ReasonRequestBudgetExhausted, fmt.Sprintf("all %d status requests are used", o.Budget.StatusRequests), now)
	case now.Before(o.NextPollAt):
		wait := o.NextPollAt.Sub(now)
		return Decision{Action: ActTooEarly, Op: o, NextPollAt: o.NextPollAt, DelaySource: o.DelaySource, Wait: wait, State: o.LastState,
			Story: fmt.Sprintf("early poll refused, next poll %s from %s", Clock(o.NextPollAt), sourceText(o.DelaySource))}
	}
	o.Used.StatusRequests++
	o.UpdatedAt = now
	return Decision{Action: ActSend, Op: o, State: o.LastState, NextPollAt: o.NextPollAt, DelaySource: o.DelaySource,
		Story: fmt.Sprintf("status request %d of %d sent", o.Used.StatusRequests, o.Budget.StatusRequests)}
}

func reasonOf(o *Operation) Reason {
	if o.Escalation != nil {
		return o.Escalation.Reason
	}
	return ""
}

// EscalateNow stops the operation with reason (R18) without a provider
// answer, e.g. when Reserve found the deadline or budget spent. why is the
// human explanation ("the deadline 11:00:00 UTC has passed").
func EscalateNow(p *Provider, op *Operation, reason Reason, why string, now time.Time) Decision {
	e := &eval{p: p, o: op.Clone(), now: now}
	e.o.Lease.Holder, e.o.Lease.ExpiresAt = "", time.Time{}
	e.o.UpdatedAt = now
	return e.stop(Decision{State: e.o.LastState}, reason, PhaseEscalated, why, reasonText(reason))
}

// OnResponse decides what a provider's answer to a status request means
// (R1-R3, R5, R6, R10, R13, R15-R17). The precedence is: 401/403, 429,
// 5xx, 404, other non-2xx, unreadable body, state classification. Every
// answer counts one completed poll, records the HTTP result and request id,
// and releases the lease in the returned record.
func OnResponse(p *Provider, op *Operation, resp Response, now time.Time, rnd Rand) Decision {
	e := &eval{p: p, o: op.Clone(), now: now, rnd: rnd, resp: &resp}
	o := e.o
	o.Used.Polls++
	o.LastHTTP = resp.StatusCode
	o.LastHTTPAt = now
	if h := p.Status.RequestIDHeader; h != "" && resp.Header != nil {
		o.LastRequestID = clip(resp.Header.Get(h), 128)
	}
	o.Lease.Holder, o.Lease.ExpiresAt = "", time.Time{}
	o.UpdatedAt = now
	code := resp.StatusCode
	heard := fmt.Sprintf("received %d", code)

	switch {
	case code == 401 || code == 403:
		// R16: repeating with the same credentials only adds noise.
		return e.stop(Decision{}, ReasonAuthorizationDenied, PhaseEscalated,
			fmt.Sprintf("the provider answered %d: the credential may not read this job", code), heard)

	case code == 429:
		// R13: Retry-After is a minimum; without it the delay is raised
		// clearly; the rate-limit budget bounds the whole thing.
		o.Used.RateLimited++
		if o.Used.RateLimited >= budgetOr(o.Budget.RateLimited, p.Policy.MaxRateLimited) {
			return e.stop(Decision{}, ReasonRateLimited, PhaseEscalated,
				fmt.Sprintf("the provider rate-limited %d of %d allowed times", o.Used.RateLimited, budgetOr(o.Budget.RateLimited, p.Policy.MaxRateLimited)), heard)
		}
		d := Decision{Action: ActWait}
		next, src, label := e.afterRetryAfter(&d, rateLimitFactor)
		return e.keepWaiting(d, next, src, heard+label)

	case code >= 500:
		// R17: 5xx spends the transport-failure budget; Retry-After on 503.
		o.Used.TransportFailures++
		if o.Used.TransportFailures >= budgetOr(o.Budget.TransportFailures, p.Policy.MaxTransportFailures) {
			return e.stop(Decision{}, ReasonTransportFailuresExhausted, PhaseEscalated,
				fmt.Sprintf("%d of %d allowed transport failures (last: HTTP %d)", o.Used.TransportFailures, budgetOr(o.Budget.TransportFailures, p.Policy.MaxTransportFailures), code), heard)
		}
		d := Decision{Action: ActWait}
		if code == 503 {
			next, src, label := e.afterRetryAfter(&d, 1)
			return e.keepWaiting(d, next, src, heard+label)
		}
		return e.keepWaiting(d, now.Add(BackoffDelay(p.Policy.Backoff, o.Used.Polls, rnd)), DelayLocalBackoff, heard)

	case code == 404:
		// R15: eventual consistency right after the start, else an
		// integration failure.
		if age := now.Sub(o.StartedAt); age < p.Policy.NotFoundGrace {
			o.Used.NotFound++
			d := Decision{Action: ActWait, Note: fmt.Sprintf("404 %s after the start, inside the not-found grace of %s (R15)", ShortDuration(age.Round(time.Millisecond)), ShortDuration(p.Policy.NotFoundGrace))}
			return e.keepWaiting(d, now.Add(BackoffDelay(p.Policy.Backoff, o.Used.Polls, rnd)), DelayLocalBackoff, heard+" inside the not-found grace")
		}
		return e.stop(Decision{}, ReasonJobNotFound, PhaseEscalated,
			fmt.Sprintf("the provider does not know job %s %s after the start (not-found grace %s)", o.JobID, ShortDuration(now.Sub(o.StartedAt).Round(time.Second)), ShortDuration(p.Policy.NotFoundGrace)), heard)

	case code < 200 || code > 299:
		return e.stop(Decision{}, ReasonInvalidResponse, PhaseEscalated,
			fmt.Sprintf("the status endpoint answered HTTP %d, which the contract does not cover", code), heard)
	}

	// A 2xx only says the endpoint answered (R1); the body decides.
	if resp.BodyTooLarge {
		return e.stop(Decision{}, ReasonInvalidResponse, PhaseEscalated, "the response body exceeded the read limit", heard+", body too large")
	}
	body := bytes.TrimSpace(resp.Body)
	if len(body) == 0 || body[0] != '{' || !gjson.ValidBytes(body) {
		return e.stop(Decision{}, ReasonInvalidResponse, PhaseEscalated, "the response body is not a JSON object", heard+", body not JSON")
	}
	e.body = body
	state, class, why := e.classify()
	o.LastState = state
	d := Decision{State: state, StateClass: class}
	polled := "polled, state " + storyState(state)

	switch class {
	case ClassUnknown:
		// R2: any value outside the table stops the run.
		return e.stop(d, ReasonUnknownState, PhaseEscalated, why, polled)
	case ClassFailure:
		e.keepProviderError()
		return e.stop(d, ReasonJobFailed, PhaseStopped, why, polled)
	case ClassCancelled:
		e.keepProviderError()
		return e.stop(d, ReasonJobCancelled, PhaseStopped, why, polled)
	case ClassExpired:
		e.keepProviderError()
		return e.stop(d, ReasonJobExpired, PhaseStopped, why, polled)
	case ClassSuccess:
		if missing := e.missingRequired(); missing != "" {
			// R3: a success without what the next action needs is not ready.
			d.Action = ActNotReady
			d.Note = fmt.Sprintf("state %q is a success state but %s (R3: not ready yet)", state, missing)
			next, src := e.nextFromGuidance(&d)
			return e.keepWaiting(d, next, src, polled+" but "+missing+", not ready")
		}
		o.Phase = PhaseSucceeded
		o.ResultURL = e.resultURL()
		o.NextPollAt = time.Time{}
		o.Terminal = storeResponse(p, e.resp)
		d.Action = ActSucceed
		d.Op = o
		d.Story = polled + ", succeeded"
		return d
	}

	// Waiting. R3: still waiting after the provider's own expiry is a
	// contradiction, not a reason to keep polling.
	if exp, ok, rej := e.timeHint(p.Status.Hints.ExpiresAt, "expires_at"); ok && !now.Before(exp) {
		return e.stop(d, ReasonContradiction, PhaseEscalated,
			fmt.Sprintf("state %q is still waiting after the job's own expires_at %s UTC", state, exp.UTC().Format(time.DateTime)), polled+" after expires_at")
	} else if rej != "" {
		d.HintRejected = rej
	}
	d.Action = ActWait
	next, src := e.nextFromGuidance(&d)
	return e.keepWaiting(d, next, src, polled)
}

// OnTransportError decides after a status request that got no HTTP answer
// (refused, DNS, TLS, timeout). It spends the transport-failure budget
// (R17); the reserved status request stays counted (R8). errText is kept,
// clipped, in LastError; queries and user info of URLs in it are removed
// (Go's client errors quote the URL, which may carry an API key).
func OnTransportError(p *Provider, op *Operation, errText string, now time.Time, rnd Rand) Decision {
	e := &eval{p: p, o: op.Clone(), now: now, rnd: rnd}
	o := e.o
	errText = redactURLs(errText)
	o.Used.TransportFailures++
	o.LastError = clip(errText, 256)
	o.Lease.Holder, o.Lease.ExpiresAt = "", time.Time{}
	o.UpdatedAt = now
	label := fmt.Sprintf("transport error (%s)", clip(errText, 80))
	limit := budgetOr(o.Budget.TransportFailures, p.Policy.MaxTransportFailures)
	if o.Used.TransportFailures >= limit {
		return e.stop(Decision{State: o.LastState}, ReasonTransportFailuresExhausted, PhaseEscalated,
			fmt.Sprintf("%d of %d allowed transport failures (last: %s)", o.Used.TransportFailures, limit, clip(errText, 120)), label)
	}
	// Failures back off too: the attempt counts completed polls and failures.
	next := now.Add(BackoffDelay(p.Policy.Backoff, o.Used.Polls+o.Used.TransportFailures, rnd))
	return e.keepWaiting(Decision{Action: ActWait, State: o.LastState}, next, DelayLocalBackoff,
		fmt.Sprintf("%s, %d of %d transport failures", label, o.Used.TransportFailures, limit))
}

var urlInText = regexp.MustCompile(`[a-zA-Z][a-zA-Z0-9+.-]*://[^\s"']+`)

// redactURLs drops user info, query and fragment of every URL in s.
func redactURLs(s string) string {
	return urlInText.ReplaceAllStringFunc(s, func(raw string) string {
		u, err := url.Parse(raw)
		if err != nil {
			return "[url]"
		}
		u.User, u.RawQuery, u.Fragment, u.ForceQuery = nil, "", "", false
		return u.String()
	})
}

// Story returns the decision's audit story line (R25).
func Story(d Decision) string { return d.Story }

// ---------------------------------------------------------------------------

// eval carries one decision's inputs.
type eval struct {
	p    *Provider
	o    *Operation
	now  time.Time
	rnd  Rand
	resp *Response
	body []byte
}

func budgetOr(v, fallback int) int {
	if v > 0 {
		return v
	}
	return fallback
}

// classify applies the state table (R2). It returns the state as text,
// its class and, for non-waiting classes, why the run stops.
func (e *eval) classify() (state, class, why string) {
	st := e.p.Status
	r := gjson.GetBytes(e.body, st.State)
	switch {
	case !r.Exists() || r.Type == gjson.Null:
		if st.StateDefault == "" {
			return "", ClassUnknown, fmt.Sprintf("the state field %s is missing", st.State)
		}
		state = st.StateDefault
	case r.Type == gjson.String:
		state = r.Str
	case r.Type == gjson.True:
		state = "true"
	case r.Type == gjson.False:
		state = "false"
	case r.Type == gjson.Number:
		state = r.Raw
	default:
		return clip(r.Raw, 64), ClassUnknown, fmt.Sprintf("the state field %s holds %s, not a value", st.State, kindOf(r))
	}
	tab := st.States
	switch {
	case contains(tab.Waiting, state):
		return state, ClassWaiting, ""
	case contains(tab.Success, state):
		for _, path := range st.SuccessForbids {
			if f := gjson.GetBytes(e.body, path); present(f) {
				if st.Error == "" || !present(gjson.GetBytes(e.body, st.Error)) {
					e.o.ProviderError = clip(f.Raw, maxProviderError)
				}
				return state, ClassFailure, fmt.Sprintf("state %q came with %s, which marks a failure", state, path)
			}
		}
		return state, ClassSuccess, ""
	case contains(tab.Failure, state):
		return state, ClassFailure, fmt.Sprintf("the provider reports state %q (failure)", state)
	case contains(tab.Cancelled, state):
		return state, ClassCancelled, fmt.Sprintf("the provider reports state %q (cancelled); it is not resubmitted without a person", state)
	case contains(tab.Expired, state):
		return state, ClassExpired, fmt.Sprintf("the provider reports state %q (expired); it is not resubmitted without a person", state)
	}
	return clip(state, 64), ClassUnknown, fmt.Sprintf("state %q is not in the contract's state table", clip(state, 64))
}

func kindOf(r gjson.Result) string {
	if r.IsArray() {
		return "an array"
	}
	return "an object"
}

// present reports a field that exists and is not null.
func present(r gjson.Result) bool { return r.Exists() && r.Type != gjson.Null }

// missingRequired returns "" when every success_requires field is present
// and valid, else a short description of the first one that is not (R3).
// Valid: present, not null, not an empty string/array/object; a field used
// as a result URL must be an absolute http(s) URL.
func (e *eval) missingRequired() string {
	urlField := ""
	if e.p.Result != nil {
		urlField = e.p.Result.Request.FieldURL
	}
	for _, path := range e.p.Status.SuccessRequires {
		r := gjson.GetBytes(e.body, path)
		switch {
		case !present(r):
			return path + " is missing"
		case r.Type == gjson.String && strings.TrimSpace(r.Str) == "":
			return path + " is empty"
		case (r.IsArray() || r.IsObject()) && len(r.Array()) == 0 && len(r.Map()) == 0:
			return path + " is empty"
		case path == urlField && !isHTTPURL(r.Str):
			return path + " is not an absolute http(s) URL"
		}
	}
	return ""
}

// resultURL is the first success_requires field when it holds a URL.
func (e *eval) resultURL() string {
	if len(e.p.Status.SuccessRequires) == 0 {
		return ""
	}
	r := gjson.GetBytes(e.body, e.p.Status.SuccessRequires[0])
	if r.Type == gjson.String && isHTTPURL(r.Str) {
		return r.Str
	}
	return ""
}

func isHTTPURL(s string) bool {
	u, err := url.Parse(s)
	return err == nil && (u.Scheme == "https" || u.Scheme == "http") && u.Host != ""
}

func (e *eval) keepProviderError() {
	if e.p.Status.Error == "" {
		return
	}
	if r := gjson.GetBytes(e.body, e.p.Status.Error); present(r) {
		e.o.ProviderError = clip(r.Raw, maxProviderError)
	}
}

// retryAfter reads and validates the response's Retry-After header.
func (e *eval) retryAfter() (d time.Duration, ok bool, rejected string) {
	if e.resp == nil || e.resp.Header == nil {
		return 0, false, ""
	}
	v := e.resp.Header.Get("Retry-After")
	if v == "" {
		return 0, false, ""
	}
	d, err := ParseRetryAfter(v, e.now)
	if err != nil {
		return 0, false, err.Error() + "; ignored"
	}
	return d, true, ""
}

// afterRetryAfter schedules after a 429 or 503 (R13): the provider's
// Retry-After is a minimum over the local backoff; without one the local
// backoff is multiplied by factor. It returns a story label.
func (e *eval) afterRetryAfter(d *Decision, factor int) (time.Time, DelaySource, string) {
	backoff := BackoffDelay(e.p.Policy.Backoff, e.o.Used.Polls, e.rnd)
	ra, ok, rej := e.retryAfter()
	if rej != "" {
		d.HintRejected = rej
	}
	if ok {
		label := fmt.Sprintf(", Retry-After %d", int64(math.Ceil(ra.Seconds())))
		if ra >= backoff {
			return e.now.Add(ra), DelayProviderRetryAfter, label
		}
		return e.now.Add(backoff), DelayLocalBackoff, label
	}
	if factor > 1 {
		d.Note = fmt.Sprintf("no usable Retry-After: delay raised %dx (R13)", factor)
		return e.now.Add(backoff * time.Duration(factor)), DelayLocalBackoff, fmt.Sprintf(" without Retry-After, delay raised %dx", factor)
	}
	return e.now.Add(backoff), DelayLocalBackoff, ""
}

// nextFromGuidance schedules after a waiting (or not-ready) 2xx answer:
// Retry-After is a minimum over the local backoff (R13); validated poll
// hints are followed (R6); otherwise local backoff (R5). A hint beyond the
// deadline is rejected and the wait ends at the deadline, which escalates.
func (e *eval) nextFromGuidance(d *Decision) (time.Time, DelaySource) {
	backoff := e.now.Add(BackoffDelay(e.p.Policy.Backoff, e.o.Used.Polls, e.rnd))
	var rejected []string
	if d.HintRejected != "" {
		rejected = append(rejected, d.HintRejected)
	}
	next, src := time.Time{}, DelaySource("")

	hints := e.p.Status.Hints
	if hints.PollAfterSeconds != "" {
		r := gjson.GetBytes(e.body, hints.PollAfterSeconds)
		if present(r) {
			secs, err := hintSeconds(r)
			switch {
			case err != nil:
				rejected = append(rejected, fmt.Sprintf("poll_after_seconds %s rejected: %v", clip(r.Raw, 32), err))
			case !e.now.Add(secs).Before(e.o.DeadlineAt):
				rejected = append(rejected, fmt.Sprintf("poll_after_seconds %s rejected: it reaches past the deadline %s UTC", clip(r.Raw, 32), Clock(e.o.DeadlineAt)))
				next, src = e.o.DeadlineAt, DelayProviderPollHint
			default:
				if t := e.now.Add(secs); t.After(next) {
					next, src = t, DelayProviderPollHint
				}
			}
		}
	}
	if hints.NextCheckAt != "" {
		t, ok, rej := e.timeHint(hints.NextCheckAt, "next_check_at")
		switch {
		case rej != "":
			rejected = append(rejected, rej)
		case ok && t.Before(e.now):
			rejected = append(rejected, fmt.Sprintf("next_check_at %s rejected: it is in the past", t.UTC().Format(time.RFC3339)))
		case ok && !t.Before(e.o.DeadlineAt):
			rejected = append(rejected, fmt.Sprintf("next_check_at %s rejected: it is past the deadline %s UTC", t.UTC().Format(time.RFC3339), Clock(e.o.DeadlineAt)))
			next, src = e.o.DeadlineAt, DelayProviderPollHint
		case ok && t.After(next):
			next, src = t, DelayProviderPollHint
		}
	}
	if ra, ok, rej := e.retryAfter(); rej != "" {
		rejected = append(rejected, rej)
	} else if ok {
		// Retry-After is a minimum: never earlier than it, and never
		// earlier than the local backoff when no hint speaks.
		floor := e.now.Add(ra)
		if next.IsZero() {
			if floor.After(backoff) {
				next, src = floor, DelayProviderRetryAfter
			} else {
				next, src = backoff, DelayLocalBackoff
			}
		} else if floor.After(next) {
			next, src = floor, DelayProviderRetryAfter
		}
	}
	if next.IsZero() {
		next, src = backoff, DelayLocalBackoff
	}
	d.HintRejected = strings.Join(rejected, "; ")
	return next, src
}

// hintSeconds reads a poll-after hint: a non-negative finite number of
// seconds, as a JSON number or a numeric string.
func hintSeconds(r gjson.Result) (time.Duration, error) {
	var f float64
	switch r.Type {
	case gjson.Number:
		f = r.Num
	case gjson.String:
		v, err := strconv.ParseFloat(strings.TrimSpace(r.Str), 64)
		if err != nil {
			return 0, fmt.Errorf("not a number")
		}
		f = v
	default:
		return 0, fmt.Errorf("not a number")
	}
	switch {
	case math.IsNaN(f) || math.IsInf(f, 0):
		return 0, fmt.Errorf("not a finite number")
	case f < 0:
		return 0, fmt.Errorf("negative")
	case f > maxRetryAfter.Seconds():
		return 0, fmt.Errorf("too large")
	}
	return time.Duration(f * float64(time.Second)), nil
}

// timeHint reads a timestamp hint at path: ok when present and valid;
// rejected says why a present value was unusable.
func (e *eval) timeHint(path, name string) (t time.Time, ok bool, rejected string) {
	if path == "" || e.body == nil {
		return time.Time{}, false, ""
	}
	r := gjson.GetBytes(e.body, path)
	if !present(r) {
		return time.Time{}, false, ""
	}
	if r.Type != gjson.String && r.Type != gjson.Number {
		return time.Time{}, false, fmt.Sprintf("%s %s rejected: not a timestamp", name, clip(r.Raw, 32))
	}
	t, err := parseTimestamp(r.Str, r.Type == gjson.Number, r.Num)
	if err != nil {
		return time.Time{}, false, fmt.Sprintf("%s rejected: %v", name, err)
	}
	return t, true, ""
}

// keepWaiting commits a schedule, unless no allowed poll remains: when the
// next poll would be at or after the deadline, or the request budget is
// spent, it escalates now instead of at the next poll (R10).
func (e *eval) keepWaiting(d Decision, next time.Time, src DelaySource, label string) Decision {
	o := e.o
	if d.Action == "" {
		d.Action = ActWait
	}
	if !next.Before(o.DeadlineAt) {
		why := fmt.Sprintf("no poll is allowed before the deadline %s UTC (the next one would be at %s)", Clock(o.DeadlineAt), Clock(next))
		return e.stop(d, ReasonDeadlineExceeded, PhaseEscalated, why, label)
	}
	if o.Used.StatusRequests >= o.Budget.StatusRequests {
		why := fmt.Sprintf("all %d status requests are used and the job is not finished", o.Budget.StatusRequests)
		return e.stop(d, ReasonRequestBudgetExhausted, PhaseEscalated, why, label)
	}
	o.NextPollAt = next
	o.DelaySource = src
	d.Op = o
	d.NextPollAt = next
	d.DelaySource = src
	d.Wait = next.Sub(e.now)
	d.Story = fmt.Sprintf("%s, next poll %s from %s", label, Clock(next), sourceText(src))
	return d
}

// stop ends polling with an escalation (R18). phase is PhaseEscalated, or
// PhaseStopped when the provider itself ended the job.
func (e *eval) stop(d Decision, reason Reason, phase Phase, why, label string) Decision {
	o := e.o
	o.Phase = phase
	o.NextPollAt = time.Time{}
	if e.resp != nil {
		o.Terminal = storeResponse(e.p, e.resp)
	}
	o.Escalation = &Escalation{Reason: reason, At: e.now}
	o.Escalation.Options = EscalationOptions(e.p, o, reason)
	o.Escalation.Message = escalationMessage(e.p, o, reason, why, e.now)
	d.Action = ActEscalate
	d.Reason = reason
	d.Op = o
	d.NextPollAt = time.Time{}
	d.Wait = 0
	d.DelaySource = ""
	end := "escalated"
	if phase == PhaseStopped {
		end = "stopped"
	}
	if label == reasonText(reason) {
		d.Story = label + ", " + end
	} else {
		d.Story = label + ", " + reasonText(reason) + ", " + end
	}
	return d
}

func reasonText(r Reason) string { return strings.ReplaceAll(string(r), "_", " ") }

func sourceText(s DelaySource) string {
	switch s {
	case DelayProviderRetryAfter:
		return "provider guidance"
	case DelayProviderPollHint:
		return "provider hint"
	case DelayManualExtension:
		return "manual extension"
	default:
		return "local backoff"
	}
}

func storyState(s string) string {
	if s == "" {
		return "(none)"
	}
	return clip(s, 64)
}

// storeResponse keeps a terminal answer for replay: status, Content-Type
// and the request id header, and up to MaxStoredBody bytes of body.
func storeResponse(p *Provider, r *Response) *StoredResponse {
	sr := &StoredResponse{StatusCode: r.StatusCode, Truncated: r.BodyTooLarge}
	if r.Header != nil {
		hs := map[string]string{}
		if v := r.Header.Get("Content-Type"); v != "" {
			hs["Content-Type"] = v
		}
		if h := p.Status.RequestIDHeader; h != "" {
			if v := r.Header.Get(h); v != "" {
				hs[h] = clip(v, 128)
			}
		}
		if len(hs) > 0 {
			sr.Header = hs
		}
	}
	body := r.Body
	if len(body) > MaxStoredBody {
		body = body[:MaxStoredBody]
		sr.Truncated = true
	}
	sr.Body = append([]byte(nil), body...)
	return sr
}

// noExtend lists the reasons for which more of the same polling cannot help.
var noExtend = map[Reason]bool{
	ReasonAuthorizationDenied: true,
	ReasonJobFailed:           true,
	ReasonJobCancelled:        true,
	ReasonJobExpired:          true,
	ReasonResubmissionBlocked: true,
}

// providerTerminal lists the reasons after which the job has ended at the
// provider (so cancelling it there is pointless).
var providerTerminal = map[Reason]bool{
	ReasonJobFailed:    true,
	ReasonJobCancelled: true,
	ReasonJobExpired:   true,
}

// EscalationOptions computes the bounded options of an escalation (R18):
// "extend" with the policy's concrete duration and request count while
// extensions remain and the reason allows it; "cancel_at_provider" only when
// the contract has a cancel call and the job has not ended at the provider;
// "allow_resubmission" for resubmission_blocked; "inspect" always.
func EscalationOptions(p *Provider, o *Operation, reason Reason) []Option {
	var opts []Option
	ext := p.Policy.Extension
	if !noExtend[reason] && len(o.Extensions) < ext.MaxExtensions && ext.Duration > 0 && ext.StatusRequests > 0 {
		left := ext.MaxExtensions - len(o.Extensions)
		times := "once"
		if left > 1 {
			times = fmt.Sprintf("once (%d extensions left)", left)
		}
		opts = append(opts, Option{
			Action:         "extend",
			Duration:       ext.Duration,
			DurationText:   ext.Duration.String(),
			StatusRequests: ext.StatusRequests,
			Description:    fmt.Sprintf("extend %s by %s with %d more status requests", times, ShortDuration(ext.Duration), ext.StatusRequests),
		})
	}
	if p.Cancel != nil && !providerTerminal[reason] {
		opts = append(opts, Option{Action: "cancel_at_provider", Description: "cancel the job at the provider (" + p.Cancel.Request.String() + ")"})
	}
	if reason == ReasonResubmissionBlocked {
		opts = append(opts, Option{Action: "allow_resubmission", Description: "allow one resubmission of the same request"})
	}
	opts = append(opts, Option{Action: "inspect", Description: "inspect the operation record and its audit log"})
	return opts
}

// escalationMessage is the human message of R18: operation, provider job,
// last state, elapsed time, requests used of max, last HTTP result and its
// time, why it stopped and the options. It never holds credentials or
// response bodies.
func escalationMessage(p *Provider, o *Operation, reason Reason, why string, now time.Time) string {
	var b strings.Builder
	fmt.Fprintf(&b, "operation %s (provider %s, job %s) stopped: %s: %s. ", o.ID, p.Name, orNone(o.JobID), reason, why)
	fmt.Fprintf(&b, "last state %s; elapsed %s since %s UTC; status requests used %d of %d; ",
		orNone(clip(o.LastState, 64)), ShortDuration(now.Sub(o.StartedAt).Round(time.Second)), Clock(o.StartedAt), o.Used.StatusRequests, o.Budget.StatusRequests)
	switch {
	case o.LastHTTP != 0:
		fmt.Fprintf(&b, "last HTTP result %d at %s UTC", o.LastHTTP, Clock(o.LastHTTPAt))
	case o.LastError != "":
		b.WriteString("no HTTP result yet (last transport error: " + clip(o.LastError, 80) + ")")
	default:
		b.WriteString("no HTTP result yet")
	}
	if o.LastError != "" && o.LastHTTP != 0 {
		b.WriteString("; last transport error: " + clip(o.LastError, 80))
	}
	b.WriteString(". options: ")
	var ds []string
	for _, opt := range o.Escalation.Options {
		ds = append(ds, opt.Description)
	}
	b.WriteString(strings.Join(ds, "; "))
	b.WriteString(".")
	return b.String()
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}
