package proxy

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"

	"pollgate/rules"
)

// Pollgate-Decision values (issue 4).
const (
	DecisionForwarded = "forwarded"
	DecisionTooEarly  = "too_early"
	DecisionEscalated = "escalated"
	DecisionReplayed  = "replayed"
	DecisionNotReady  = "not_ready"
	DecisionRefused   = "refused"
)

// Header names on governed answers.
const (
	HeaderOperation   = "Pollgate-Operation"
	HeaderDecision    = "Pollgate-Decision"
	HeaderRequests    = "Pollgate-Requests"
	HeaderNextPollAt  = "Pollgate-Next-Poll-At"
	HeaderEscalation  = "Pollgate-Escalation"
	headerRetryAfter  = "Retry-After"
	headerCacheCtl    = "Cache-Control"
	headerContentType = "Content-Type"
)

// retryAfterSeconds is the Retry-After value for a wait: whole seconds,
// rounded up, at least 1.
func retryAfterSeconds(wait time.Duration) int {
	s := int(math.Ceil(wait.Seconds()))
	if s < 1 {
		s = 1
	}
	return s
}

// ceilSecond rounds t up to a whole second, so an agent that waits until a
// printed time (second precision) is never early.
func ceilSecond(t time.Time) time.Time {
	if t.Truncate(time.Second).Equal(t) {
		return t.UTC()
	}
	return t.Truncate(time.Second).Add(time.Second).UTC()
}

// setGoverned writes the Pollgate-* headers of a governed answer.
func setGoverned(h http.Header, op *rules.Operation, decision string) {
	h.Set(HeaderDecision, decision)
	if op == nil {
		return
	}
	h.Set(HeaderOperation, op.ID)
	h.Set(HeaderRequests, fmt.Sprintf("%d/%d", op.Used.StatusRequests, op.Budget.StatusRequests))
	if !op.NextPollAt.IsZero() && op.Phase == rules.PhaseWaiting {
		h.Set(HeaderNextPollAt, ceilSecond(op.NextPollAt).Format(time.RFC3339))
	}
	if op.Escalation != nil && (decision == DecisionEscalated || decision == DecisionRefused) {
		h.Set(HeaderEscalation, string(op.Escalation.Reason))
	}
}

// boolStates reports whether the provider's state is a JSON boolean
// (e.g. a Google long-running operation's "done").
func boolStates(p *rules.Provider) bool {
	st := p.Status.States
	all := [][]string{st.Waiting, st.Success, st.Failure, st.Cancelled, st.Expired}
	n := 0
	for _, list := range all {
		for _, s := range list {
			if s != "true" && s != "false" {
				return false
			}
			n++
		}
	}
	return n > 0
}

// setState writes value at the state path, as a JSON boolean when the
// provider's state is boolean, else as a string.
func setState(body []byte, p *rules.Provider, value string) ([]byte, error) {
	path := p.Status.State
	if path == "" {
		return body, nil
	}
	isBool := boolStates(p)
	if cur := gjson.GetBytes(body, path); cur.Type == gjson.True || cur.Type == gjson.False {
		isBool = true
	}
	if isBool && (value == "true" || value == "false") {
		return sjson.SetRawBytes(body, path, []byte(value))
	}
	return sjson.SetBytes(body, path, value)
}

// escalationStateValue is the state written into an escalation body: the
// contract's escalation.state_value, default the first failure state.
func escalationStateValue(p *rules.Provider) string {
	if v := p.Escalation.StateValue; v != "" {
		return v
	}
	if len(p.Status.States.Failure) > 0 {
		return p.Status.States.Failure[0]
	}
	return "failed"
}

// escalationPayload is the top-level "pollgate" object of an escalation.
type escalationPayload struct {
	Escalated          bool            `json:"escalated"`
	Reason             rules.Reason    `json:"reason"`
	Message            string          `json:"message"`
	Options            []rules.Option  `json:"options"`
	OperationID        string          `json:"operation_id"`
	ProviderJobID      string          `json:"provider_job_id"`
	LastState          string          `json:"last_state"`
	ElapsedSeconds     int64           `json:"elapsed_seconds"`
	StatusRequestsUsed int             `json:"status_requests_used"`
	StatusRequestsMax  int             `json:"status_requests_max"`
	DeadlineAt         string          `json:"deadline_at"`
	LastHTTPStatus     int             `json:"last_http_status,omitempty"`
	LastHTTPAt         string          `json:"last_http_at,omitempty"`
	ProviderBody       json.RawMessage `json:"provider_body,omitempty"`
}

// escalationBody builds the body an agent gets when its job must stop: the
// provider's body shape (the stored terminal response, if any, else a bare
// object) with escalation.state_value at the state path - so a legacy loop
// waiting for a terminal state ends - plus the "pollgate" object (R18).
// When the provider itself ended the job (phase stopped), its own state
// stays.
func escalationBody(p *rules.Provider, op *rules.Operation) []byte {
	e := op.Escalation
	if e == nil {
		e = &rules.Escalation{Reason: rules.ReasonInvalidResponse, At: op.UpdatedAt}
	}
	pl := escalationPayload{
		Escalated:          true,
		Reason:             e.Reason,
		Message:            e.Message,
		Options:            e.Options,
		OperationID:        op.ID,
		ProviderJobID:      op.JobID,
		LastState:          op.LastState,
		StatusRequestsUsed: op.Used.StatusRequests,
		StatusRequestsMax:  op.Budget.StatusRequests,
		LastHTTPStatus:     op.LastHTTP,
	}
	if pl.Options == nil {
		pl.Options = []rules.Option{}
	}
	if !e.At.IsZero() && !op.StartedAt.IsZero() {
		pl.ElapsedSeconds = int64(e.At.Sub(op.StartedAt).Round(time.Second) / time.Second)
	}
	if !op.DeadlineAt.IsZero() {
		pl.DeadlineAt = op.DeadlineAt.UTC().Format(time.RFC3339)
	}
	if !op.LastHTTPAt.IsZero() {
		pl.LastHTTPAt = op.LastHTTPAt.UTC().Format(time.RFC3339)
	}
	var base []byte
	if t := op.Terminal; t != nil && len(t.Body) > 0 {
		if !t.Truncated && gjson.ValidBytes(t.Body) && gjson.ParseBytes(t.Body).IsObject() {
			base = append([]byte(nil), t.Body...)
			pl.ProviderBody = json.RawMessage(t.Body)
		} else {
			s, _ := json.Marshal(string(t.Body))
			pl.ProviderBody = s
		}
	}
	if base == nil {
		base = []byte("{}")
	}
	state := escalationStateValue(p)
	if op.Phase == rules.PhaseStopped && op.LastState != "" {
		state = op.LastState // the provider's own terminal state
	}
	keep := op.Phase == rules.PhaseStopped && gjson.GetBytes(base, p.Status.State).Exists()
	out := base
	if !keep {
		if b, err := setState(base, p, state); err == nil {
			out = b
		}
	}
	raw, _ := json.Marshal(pl)
	if b, err := sjson.SetRawBytes(out, "pollgate", raw); err == nil {
		out = b
	}
	return append(out, '\n')
}

// escalationResponse is the governed answer for an escalated or stopped
// operation (status code from the contract, default 200).
func escalationResponse(req *http.Request, p *rules.Provider, op *rules.Operation, code int) *http.Response {
	if code == 0 {
		code = p.Escalation.StatusCode
	}
	if code == 0 {
		code = http.StatusOK
	}
	h := http.Header{}
	h.Set(headerContentType, "application/json")
	h.Set(headerCacheCtl, "no-store")
	decision := DecisionEscalated
	if code == http.StatusConflict {
		decision = DecisionRefused
	}
	setGoverned(h, op, decision)
	return bytesResponse(req, code, h, escalationBody(p, op))
}

// notReadyBody rewrites a success answer without its required fields (R3):
// the state becomes the first waiting state and a "pollgate" note says why,
// so the agent never sees a success it could act on.
func notReadyBody(p *rules.Provider, op *rules.Operation, body []byte, note string) []byte {
	if !gjson.ValidBytes(body) || !gjson.ParseBytes(body).IsObject() {
		body = []byte("{}")
	}
	orig := gjson.GetBytes(body, p.Status.State).String()
	waiting := "waiting"
	if len(p.Status.States.Waiting) > 0 {
		waiting = p.Status.States.Waiting[0]
	}
	out, err := setState(append([]byte(nil), body...), p, waiting)
	if err != nil {
		out = body
	}
	pl := map[string]any{
		"not_ready":      true,
		"note":           note,
		"operation_id":   op.ID,
		"provider_state": orig,
	}
	if !op.NextPollAt.IsZero() {
		pl["next_poll_at"] = ceilSecond(op.NextPollAt).Format(time.RFC3339)
	}
	raw, _ := json.Marshal(pl)
	if b, err := sjson.SetRawBytes(out, "pollgate", raw); err == nil {
		out = b
	}
	return out
}

// tooEarlyResponse is the 429 for a poll before its slot or while another
// poll of the same job is in flight (R7, R21).
func tooEarlyResponse(req *http.Request, op *rules.Operation, wait time.Duration, now time.Time, busy bool) *http.Response {
	secs := retryAfterSeconds(wait)
	next := ceilSecond(now.Add(wait))
	msg := fmt.Sprintf("too early: the next status request for job %s is allowed at %s; retry after %d s", op.JobID, next.Format(time.RFC3339), secs)
	if busy {
		msg = fmt.Sprintf("another status request for job %s is in flight; retry after %d s", op.JobID, secs)
	}
	resp := jsonResponse(req, http.StatusTooManyRequests, map[string]any{
		"error":                "too_early",
		"next_poll_at":         next.Format(time.RFC3339),
		"retry_after_seconds":  secs,
		"status_requests_used": op.Used.StatusRequests,
		"status_requests_max":  op.Budget.StatusRequests,
		"operation_id":         op.ID,
		"message":              msg,
	})
	setGoverned(resp.Header, op, DecisionTooEarly)
	resp.Header.Set(HeaderNextPollAt, next.Format(time.RFC3339))
	resp.Header.Set(headerRetryAfter, strconv.Itoa(secs))
	return resp
}

// unavailableResponse is the fail-closed answer when the ledger cannot be
// reached: nothing was forwarded uncounted.
func unavailableResponse(req *http.Request, cause error) *http.Response {
	msg := "pollgate's ledger is unavailable, so this governed call was not forwarded (it could not be counted)"
	c := "ledger unavailable"
	if cause != nil {
		c = cause.Error()
	}
	resp := jsonResponse(req, http.StatusServiceUnavailable, map[string]any{
		"error":               "ledger_unavailable",
		"message":             msg,
		"cause":               c,
		"retry_after_seconds": ledgerRetryAfter,
	})
	resp.Header.Set(headerRetryAfter, strconv.Itoa(ledgerRetryAfter))
	resp.Header.Set(HeaderDecision, DecisionRefused)
	return resp
}

// ledgerRetryAfter is the Retry-After of a fail-closed 503, in seconds.
const ledgerRetryAfter = 5

// copyProviderHeader copies a provider's response headers for a rebuilt
// answer (the body length and encoding are set by bytesResponse).
func copyProviderHeader(src http.Header) http.Header {
	h := make(http.Header, len(src)+6)
	for k, vs := range src {
		switch strings.ToLower(k) {
		case "content-length", "content-encoding", "transfer-encoding":
			continue
		}
		h[k] = append([]string(nil), vs...)
	}
	return h
}
