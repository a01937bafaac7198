package admin

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"pollgate/audit"
	"pollgate/ledger"
	"pollgate/rules"
)

// ListResponse is the body of GET /api/operations.
type ListResponse struct {
	Operations []*rules.Operation `json:"operations"`
	NextCursor string             `json:"next_cursor"`
}

// ShowResponse is the body of GET /api/operations/{id}.
type ShowResponse struct {
	Operation *rules.Operation `json:"operation"`
	// Story holds the R25 story, one "15:04:05 <story>" line (UTC) per audit entry.
	Story []string `json:"story"`
	// Message is the R18 escalation message, when the operation escalated.
	Message string `json:"message,omitempty"`
}

// OperationResponse is the body of a successful extend, close or
// allow-resubmission: the record after the step.
type OperationResponse struct {
	Operation *rules.Operation `json:"operation"`
}

// AuditEntry is one decoded entry of GET /api/operations/{id}/audit.
type AuditEntry struct {
	Seq       int64  `json:"seq"`
	Hash      string `json:"hash"`
	Prev      string `json:"prev"`
	Encrypted bool   `json:"encrypted,omitempty"`
	// Unreadable says why the entry could not be decoded (e.g. encrypted and
	// no key); the entry fields are then empty.
	Unreadable string `json:"unreadable,omitempty"`
	audit.Entry
}

// AuditResponse is the body of GET /api/operations/{id}/audit.
type AuditResponse struct {
	Entries []AuditEntry `json:"entries"`
}

// ExtendRequest is the body of POST /api/operations/{id}/extend.
type ExtendRequest struct {
	Duration       string `json:"duration"` // Go duration, e.g. "15m"
	StatusRequests int    `json:"status_requests"`
	By             string `json:"by"`
	Note           string `json:"note,omitempty"`
}

// ActionRequest is the (optional) body of close and allow-resubmission.
type ActionRequest struct {
	By   string `json:"by,omitempty"`
	Note string `json:"note,omitempty"`
}

var knownPhases = map[rules.Phase]bool{
	rules.PhaseWaiting: true, rules.PhaseSucceeded: true, rules.PhaseStopped: true,
	rules.PhaseEscalated: true, rules.PhaseClosed: true,
}

const maxPageLimit = 1000

func (s *server) list(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := ledger.Filter{Phase: rules.Phase(q.Get("phase")), Provider: q.Get("provider"), Cursor: q.Get("cursor")}
	if f.Phase != "" && !knownPhases[f.Phase] {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("unknown phase %q", f.Phase),
			"use one of waiting, succeeded, stopped, escalated, closed")
		return
	}
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > maxPageLimit {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("invalid limit %q", l), fmt.Sprintf("use a number from 1 to %d", maxPageLimit))
			return
		}
		f.Limit = n
	}
	page, err := s.cfg.Store.List(r.Context(), f)
	if err != nil {
		if f.Cursor != "" && !errors.Is(err, ledger.ErrUnavailable) {
			writeError(w, http.StatusBadRequest, "invalid cursor: "+err.Error(), "pass the next_cursor of the previous page unchanged")
			return
		}
		s.storeError(w, r, err)
		return
	}
	resp := ListResponse{Operations: make([]*rules.Operation, 0, len(page.Operations)), NextCursor: page.Next}
	for _, op := range page.Operations {
		resp.Operations = append(resp.Operations, listed(op))
	}
	writeJSON(w, http.StatusOK, resp)
}

// listed drops the stored terminal body from a list item (it can be large;
// GET /api/operations/{id} has it).
func listed(op *rules.Operation) *rules.Operation {
	if op.Terminal == nil || len(op.Terminal.Body) == 0 {
		return op
	}
	c := *op
	t := *op.Terminal
	t.Body = nil
	c.Terminal = &t
	return &c
}

func (s *server) show(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	op, err := s.cfg.Store.GetByID(r.Context(), id)
	if err != nil {
		s.storeError(w, r, err)
		return
	}
	envs, err := s.cfg.Store.Audit(r.Context(), id)
	if err != nil {
		s.storeError(w, r, err)
		return
	}
	resp := ShowResponse{Operation: op, Story: make([]string, 0, len(envs))}
	for _, env := range envs {
		resp.Story = append(resp.Story, s.storyLine(env))
	}
	if op.Escalation != nil {
		resp.Message = op.Escalation.Message
	}
	writeJSON(w, http.StatusOK, resp)
}

// StoryLine formats one audit entry as a line of the R25 story.
func StoryLine(e audit.Entry) string {
	story := e.Story
	if story == "" {
		story = e.Event
	}
	if e.Actor != "" && !strings.Contains(story, e.Actor) {
		story += " (by " + e.Actor + ")"
	}
	return rules.Clock(e.Time) + " " + story
}

func (s *server) storyLine(env audit.Envelope) string {
	e, err := audit.DecodeEntry(env, s.cfg.AuditKey)
	if err != nil {
		return fmt.Sprintf("--:--:-- entry %d unreadable: %v", env.Seq, err)
	}
	return StoryLine(e)
}

func (s *server) auditEntries(w http.ResponseWriter, r *http.Request) {
	envs, err := s.cfg.Store.Audit(r.Context(), r.PathValue("id"))
	if err != nil {
		s.storeError(w, r, err)
		return
	}
	resp := AuditResponse{Entries: make([]AuditEntry, 0, len(envs))}
	for _, env := range envs {
		ae := AuditEntry{Seq: env.Seq, Hash: env.Hash, Prev: env.Prev, Encrypted: env.Encrypted}
		e, err := audit.DecodeEntry(env, s.cfg.AuditKey)
		if err != nil {
			ae.Unreadable = err.Error()
		} else {
			ae.Entry = e
		}
		resp.Entries = append(resp.Entries, ae)
	}
	writeJSON(w, http.StatusOK, resp)
}

// decodeBody reads a small JSON body strictly. An empty body is allowed
// when optional is set.
func decodeBody(w http.ResponseWriter, r *http.Request, v any, optional bool) bool {
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<10))
	if err != nil {
		writeError(w, http.StatusBadRequest, "failed to read the request body: "+err.Error(), "")
		return false
	}
	if optional && len(strings.TrimSpace(string(body))) == 0 {
		return true
	}
	dec := json.NewDecoder(strings.NewReader(string(body)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		writeError(w, http.StatusBadRequest, "invalid JSON body: "+err.Error(),
			`send e.g. {"duration":"15m","status_requests":4,"by":"alice","note":"provider is slow today"}`)
		return false
	}
	return true
}

func (s *server) extend(w http.ResponseWriter, r *http.Request) {
	var req ExtendRequest
	if !decodeBody(w, r, &req, false) {
		return
	}
	d, err := time.ParseDuration(req.Duration)
	if err != nil || d <= 0 {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("invalid duration %q", req.Duration),
			`use a positive Go duration such as "15m" or "1h30m"`)
		return
	}
	if req.StatusRequests <= 0 {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("invalid status_requests %d", req.StatusRequests),
			"give the number of additional status requests, e.g. 4")
		return
	}
	by := strings.TrimSpace(req.By)
	if by == "" {
		writeError(w, http.StatusBadRequest, "missing \"by\": an extension is a new authorization and names who gave it",
			`add "by":"<your name>" (pollgate ops extend uses $USER)`)
		return
	}
	now := s.cfg.Now()
	contract := s.cfg.Contract()
	op, err := s.cfg.Store.Update(r.Context(), r.PathValue("id"), now, func(op *rules.Operation) (audit.Entry, error) {
		p := providerOf(contract, op)
		if p == nil {
			return audit.Entry{}, fmt.Errorf("%w: provider %q is no longer in the contract", ledger.ErrConflict, op.Provider)
		}
		reason := ""
		if op.Escalation != nil {
			reason = string(op.Escalation.Reason)
		}
		n, err := rules.Extend(p, op, rules.ExtendRequest{Duration: d, StatusRequests: req.StatusRequests, By: by, Note: req.Note}, now)
		if err != nil {
			return audit.Entry{}, err
		}
		*op = *n
		story := fmt.Sprintf("extended by %s by %s with %d more status requests (%s), new deadline %s, budget %d, next poll allowed now",
			rules.ShortDuration(d), by, req.StatusRequests, reason, rules.Clock(n.DeadlineAt), n.Budget.StatusRequests)
		if req.Note != "" {
			story += ": " + oneLine(req.Note, 200)
		}
		return audit.Entry{
			Time: now, Event: "extended", Decision: "extend", Actor: by, Reason: reason,
			NextPollAt: now, DelaySource: string(rules.DelayManualExtension), DeadlineAt: n.DeadlineAt, State: n.LastState,
			Story: story,
		}, nil
	})
	if err != nil {
		s.storeError(w, r, err)
		return
	}
	s.cfg.Logger.Info("operation extended", "op", op.ID, "provider", op.Provider, "by", by,
		"duration", d, "status_requests", req.StatusRequests, "deadline", op.DeadlineAt)
	writeJSON(w, http.StatusOK, OperationResponse{Operation: op})
}

func (s *server) close(w http.ResponseWriter, r *http.Request) {
	var req ActionRequest
	if !decodeBody(w, r, &req, true) {
		return
	}
	by := actor(req.By)
	now := s.cfg.Now()
	op, err := s.cfg.Store.Update(r.Context(), r.PathValue("id"), now, func(op *rules.Operation) (audit.Entry, error) {
		switch {
		case op.Phase == rules.PhaseClosed:
			return audit.Entry{}, fmt.Errorf("%w: operation %s was already closed by %s at %s", ledger.ErrConflict,
				op.ID, op.ClosedBy, op.ClosedAt.UTC().Format(time.RFC3339))
		case (op.Phase != rules.PhaseEscalated && op.Phase != rules.PhaseStopped) || op.Escalation == nil:
			return audit.Entry{}, fmt.Errorf("%w: operation %s is %s; only an escalated or stopped operation can be closed", ledger.ErrConflict, op.ID, op.Phase)
		}
		op.Phase = rules.PhaseClosed
		op.ClosedAt = now
		op.ClosedBy = by
		story := fmt.Sprintf("closed by %s (%s acknowledged); agents keep getting the escalation", by, op.Escalation.Reason)
		if req.Note != "" {
			story += ": " + oneLine(req.Note, 200)
		}
		return audit.Entry{Time: now, Event: "closed", Decision: "close", Actor: by, Reason: string(op.Escalation.Reason),
			State: op.LastState, Story: story}, nil
	})
	if err != nil {
		s.storeError(w, r, err)
		return
	}
	s.cfg.Logger.Info("operation closed", "op", op.ID, "provider", op.Provider, "by", by)
	writeJSON(w, http.StatusOK, OperationResponse{Operation: op})
}

// allowResubmission lets the next identical submission of an operation's
// request through once (R20). The proxy refuses such a submission with a
// resubmission_blocked escalation body and records "resubmission_blocked" in
// the existing operation's audit chain (the operation itself keeps its
// phase); an operation escalated with that reason qualifies too. A person
// may allow it once per operation.
func (s *server) allowResubmission(w http.ResponseWriter, r *http.Request) {
	var req ActionRequest
	if !decodeBody(w, r, &req, true) {
		return
	}
	id := r.PathValue("id")
	envs, err := s.cfg.Store.Audit(r.Context(), id)
	if err != nil {
		s.storeError(w, r, err)
		return
	}
	blocked, allowedBefore := false, false
	for _, env := range envs {
		e, err := audit.DecodeEntry(env, s.cfg.AuditKey)
		if err != nil {
			continue
		}
		switch {
		case e.Event == eventResubmissionAllowed:
			allowedBefore = true
		case e.Event == "resubmission_blocked" || e.Reason == string(rules.ReasonResubmissionBlocked):
			blocked = true
		}
	}
	by := actor(req.By)
	now := s.cfg.Now()
	op, err := s.cfg.Store.Update(r.Context(), id, now, func(op *rules.Operation) (audit.Entry, error) {
		escalatedBlocked := op.Escalation != nil && op.Escalation.Reason == rules.ReasonResubmissionBlocked
		switch {
		case !blocked && !escalatedBlocked:
			return audit.Entry{}, fmt.Errorf("%w: no resubmission of operation %s was blocked (it is %s); only a request refused as resubmission_blocked can be allowed once",
				ledger.ErrConflict, op.ID, op.Phase)
		case op.ResubmissionAllowed:
			return audit.Entry{}, fmt.Errorf("%w: one resubmission of operation %s is already allowed and not used yet", ledger.ErrConflict, op.ID)
		case allowedBefore:
			return audit.Entry{}, fmt.Errorf("%w: a resubmission of operation %s was already allowed once", ledger.ErrConflict, op.ID)
		}
		op.ResubmissionAllowed = true
		story := fmt.Sprintf("one resubmission of the same request allowed by %s", by)
		if req.Note != "" {
			story += ": " + oneLine(req.Note, 200)
		}
		return audit.Entry{Time: now, Event: eventResubmissionAllowed, Decision: "allow_resubmission", Actor: by,
			Reason: string(rules.ReasonResubmissionBlocked), State: op.LastState, Story: story}, nil
	})
	if err != nil {
		s.storeError(w, r, err)
		return
	}
	s.cfg.Logger.Info("resubmission allowed", "op", op.ID, "provider", op.Provider, "by", by)
	writeJSON(w, http.StatusOK, OperationResponse{Operation: op})
}

const eventResubmissionAllowed = "resubmission_allowed"

func (s *server) export(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Disposition", `attachment; filename="pollgate-audit.jsonl"`)
	if err := s.cfg.Store.Export(r.Context(), w); err != nil {
		// Headers may be gone already; the verifier will report the
		// truncated export, and the log says why.
		s.cfg.Logger.Error("audit export failed", "err", err)
		if errors.Is(err, ledger.ErrUnavailable) {
			http.Error(w, "", http.StatusServiceUnavailable)
		}
	}
}

func providerOf(c *rules.Contract, op *rules.Operation) *rules.Provider {
	if c == nil {
		return nil
	}
	return c.ProviderByName(op.Provider)
}

func actor(by string) string {
	if by = strings.TrimSpace(by); by != "" {
		return oneLine(by, 100)
	}
	return "admin-api"
}

func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > n {
		s = s[:n] + "..."
	}
	return s
}
