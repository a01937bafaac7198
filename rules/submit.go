package rules

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/tidwall/gjson"
)

// Submission is what a provider's answer to a submit call names (R14).
type Submission struct {
	JobID     string
	StatusURL string // absolute; "" when neither the provider nor the contract gives one
}

// ParseSubmission reads the job a submit answer created (R14: take what the
// provider names, never guess). The job id comes from submit.job_id in the
// body; with status_location the status resource comes from
// Operation-Location (preferred) or Location, resolved against requestURL.
// A status URL without a body job id yields the job id by matching the URL
// against status.request. With only a job id, the status URL is built from
// status.request when the job id is its only placeholder. It is an error
// when the answer is not 2xx or names no job.
func ParseSubmission(p *Provider, resp Response, requestURL *url.URL) (Submission, error) {
	if p == nil || p.Submit == nil {
		return Submission{}, errors.New("the contract has no submit call for this provider")
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return Submission{}, fmt.Errorf("submit answered HTTP %d, no job was created", resp.StatusCode)
	}
	var s Submission
	if path := p.Submit.JobID; path != "" && !resp.BodyTooLarge && gjson.ValidBytes(resp.Body) {
		r := gjson.GetBytes(resp.Body, path)
		switch r.Type {
		case gjson.String:
			s.JobID = strings.TrimSpace(r.Str)
		case gjson.Number:
			s.JobID = r.Raw
		}
	}
	if p.Submit.StatusLocation && resp.Header != nil {
		loc := resp.Header.Get("Operation-Location")
		if loc == "" {
			loc = resp.Header.Get("Location")
		}
		if loc != "" {
			u, err := url.Parse(strings.TrimSpace(loc))
			if err != nil {
				return Submission{}, fmt.Errorf("failed to read the status location %q: %w", clip(loc, 120), err)
			}
			if requestURL != nil {
				u = requestURL.ResolveReference(u)
			}
			if !u.IsAbs() || u.Host == "" {
				return Submission{}, fmt.Errorf("status location %q is not absolute and there is no request URL to resolve it", clip(loc, 120))
			}
			s.StatusURL = u.String()
			if s.JobID == "" {
				params, ok := p.StatusParams(u)
				if !ok {
					return Submission{}, fmt.Errorf("status location %s does not match status.request %q (hint: fix base_url or status.request in the contract)", clip(s.StatusURL, 200), p.Status.Request.String())
				}
				s.JobID = params[p.Status.Request.JobIDParam()]
			}
		}
	}
	if s.JobID == "" {
		return Submission{}, errors.New("the submit answer names no job id and no status location (R14: the status URL is never guessed)")
	}
	if s.StatusURL == "" && p.BaseURL != nil && len(p.Status.Request.Placeholders()) == 1 {
		if u, err := p.Status.Request.Expand(map[string]string{p.Status.Request.JobIDParam(): s.JobID}, p.BaseURL); err == nil {
			s.StatusURL = u
		}
	}
	return s, nil
}

// AccountFingerprint is the keyed hash that stands for a credential (R4):
// "acct_" and the first 16 hex digits of HMAC-SHA256(key, credential). The
// credential itself is never stored. An empty credential is "anonymous".
func AccountFingerprint(key []byte, credential string) string {
	if credential == "" {
		return "anonymous"
	}
	m := hmac.New(sha256.New, key)
	m.Write([]byte(credential))
	return "acct_" + hex.EncodeToString(m.Sum(nil))[:16]
}

// RequestFingerprint is the hex SHA-256 over the method, the normalised URL
// (lower-case scheme and host, default port dropped, sorted query) and the
// canonical body (JSON re-encoded with sorted keys; other bodies as sent).
// Two submissions of the same request get the same fingerprint (R4, R20).
func RequestFingerprint(method string, u *url.URL, body []byte) string {
	h := sha256.New()
	h.Write([]byte(strings.ToUpper(method)))
	h.Write([]byte{'\n'})
	if u != nil {
		n := *u
		n.Scheme = strings.ToLower(n.Scheme)
		host := strings.ToLower(n.Hostname())
		if port := n.Port(); port != "" && !(port == "443" && n.Scheme == "https") && !(port == "80" && n.Scheme == "http") {
			host += ":" + port
		}
		n.Host = host
		n.RawQuery = n.Query().Encode()
		n.Fragment = ""
		n.User = nil
		h.Write([]byte(n.String()))
	}
	h.Write([]byte{'\n'})
	h.Write(canonicalBody(body))
	return hex.EncodeToString(h.Sum(nil))
}

func canonicalBody(body []byte) []byte {
	t := bytes.TrimSpace(body)
	if len(t) == 0 || (t[0] != '{' && t[0] != '[') || !json.Valid(t) {
		return body
	}
	dec := json.NewDecoder(bytes.NewReader(t))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return body
	}
	out, err := json.Marshal(v) // maps marshal with sorted keys
	if err != nil {
		return body
	}
	return out
}

// ExtendRequest is a person's approval of more time and budget (R24).
type ExtendRequest struct {
	Duration       time.Duration
	StatusRequests int
	By, Note       string
}

// ErrExtensionRefused is wrapped by every Extend refusal.
var ErrExtensionRefused = errors.New("extension refused")

// Extend applies an approved extension (R24) to an escalated operation whose
// escalation offered "extend", within that option's bounds and while
// extensions remain; never for authorization_denied. The result has a new
// deadline (the later of the old deadline and now, plus duration), the status-request budget raised by the
// requested count, room for at least one more transport failure and 429,
// phase waiting, no escalation, and a next poll allowed now.
func Extend(p *Provider, op *Operation, req ExtendRequest, now time.Time) (*Operation, error) {
	refuse := func(format string, a ...any) (*Operation, error) {
		return nil, fmt.Errorf("%w: %s", ErrExtensionRefused, fmt.Sprintf(format, a...))
	}
	if op == nil {
		return refuse("no operation")
	}
	if op.Phase != PhaseEscalated || op.Escalation == nil {
		return refuse("operation %s is %s, not escalated", op.ID, op.Phase)
	}
	if op.Escalation.Reason == ReasonAuthorizationDenied {
		return refuse("authorization_denied is never extended: the same credential would be refused again")
	}
	var offer *Option
	for i := range op.Escalation.Options {
		if op.Escalation.Options[i].Action == "extend" {
			offer = &op.Escalation.Options[i]
		}
	}
	if offer == nil {
		return refuse("the escalation (%s) offers no extension", op.Escalation.Reason)
	}
	maxExt := p.Policy.Extension.MaxExtensions
	if len(op.Extensions) >= maxExt {
		return refuse("all %d extensions are used", maxExt)
	}
	offerDur := offer.Duration
	if offerDur == 0 && offer.DurationText != "" {
		offerDur, _ = time.ParseDuration(offer.DurationText)
	}
	switch {
	case req.Duration <= 0 || req.StatusRequests <= 0:
		return refuse("duration and status requests must both be positive")
	case req.Duration > offerDur:
		return refuse("duration %s exceeds the offered %s", req.Duration, offerDur)
	case req.StatusRequests > offer.StatusRequests:
		return refuse("%d status requests exceed the offered %d", req.StatusRequests, offer.StatusRequests)
	}
	o := op.Clone()
	// "Extend by 15m" moves the deadline 15 minutes past the later of the
	// old deadline and now: an extension never shortens the time left.
	base := op.DeadlineAt
	if base.Before(now) {
		base = now
	}
	o.DeadlineAt = base.Add(req.Duration)
	o.Budget.StatusRequests += req.StatusRequests
	if o.Budget.StatusRequests < o.Used.StatusRequests+req.StatusRequests {
		o.Budget.StatusRequests = o.Used.StatusRequests + req.StatusRequests
	}
	if o.Budget.TransportFailures <= o.Used.TransportFailures {
		o.Budget.TransportFailures = o.Used.TransportFailures + 1
	}
	if o.Budget.RateLimited <= o.Used.RateLimited {
		o.Budget.RateLimited = o.Used.RateLimited + 1
	}
	o.Phase = PhaseWaiting
	o.Escalation = nil
	o.Terminal = nil
	o.NextPollAt = now
	o.DelaySource = DelayManualExtension
	o.Lease.Holder, o.Lease.ExpiresAt = "", time.Time{}
	o.UpdatedAt = now
	o.Extensions = append(o.Extensions, Extension{
		By: req.By, Note: clip(req.Note, 500), At: now,
		Duration: req.Duration, StatusRequests: req.StatusRequests, NewDeadline: o.DeadlineAt,
	})
	return o, nil
}
