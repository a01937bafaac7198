package rules

import (
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// R13: the Retry-After parser never panics, never returns a negative wait,
// and reads plain digits as seconds.
func FuzzParseRetryAfter(f *testing.F) {
	for _, s := range []string{"0", "120", "-1", "1.5", "Sun, 06 Nov 1994 08:49:37 GMT", "Sunday, 06-Nov-94 08:49:37 GMT",
		"Sun Nov  6 08:49:37 1994", "", " ", "99999999999", "Fri, 31 Dec 9999 23:59:59 GMT", "Mon, 01 Jan 0001 00:00:00 GMT"} {
		f.Add(s)
	}
	now := time.Date(1994, 11, 6, 8, 49, 0, 0, time.UTC)
	f.Fuzz(func(t *testing.T, s string) {
		d, err := ParseRetryAfter(s, now)
		if err != nil {
			if d != 0 {
				t.Fatalf("error with a wait %v", d)
			}
			return
		}
		if d < 0 || d > maxRetryAfter {
			t.Fatalf("ParseRetryAfter(%q) = %v", s, d)
		}
		if v := strings.TrimSpace(s); isDigits(v) {
			n, _ := strconv.ParseInt(v, 10, 64)
			if d != time.Duration(n)*time.Second {
				t.Fatalf("ParseRetryAfter(%q) = %v, want %ds", s, d, n)
			}
		}
	})
}

// The contract loader never panics; it either returns a usable contract or
// a ValidationError whose every problem names the file.
func FuzzParseContract(f *testing.F) {
	for _, p := range []string{"../providers.yaml", "testdata/example.yaml"} {
		if data, err := os.ReadFile(p); err == nil {
			f.Add(data)
		}
	}
	f.Add([]byte("version: 1\nproviders: [{name: a, base_url: 'https://a', status: {request: 'GET /{x}', state: s, states: {waiting: [w], success: [s]}}}]\n"))
	f.Add([]byte("version: 1\nproviders:\n  - &a {name: a}\n  - *a\n"))
	f.Add([]byte("{"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse("fuzz.yaml", data)
		if err != nil {
			var ve *ValidationError
			if !errors.As(err, &ve) || len(ve.Problems) == 0 {
				t.Fatalf("error without problems: %v", err)
			}
			for _, p := range ve.Problems {
				if p.File != "fuzz.yaml" || p.Msg == "" {
					t.Fatalf("problem without file or message: %+v", p)
				}
			}
			return
		}
		if c.Version != 1 || len(c.Providers) == 0 || len(c.Hash) != 12 {
			t.Fatalf("accepted contract is incomplete: %+v", c)
		}
		for _, p := range c.Providers {
			if p.BaseURL == nil || p.Status.Request.IsZero() || p.Status.State == "" || len(p.Status.States.Waiting) == 0 || len(p.Status.States.Success) == 0 {
				t.Fatalf("accepted provider is incomplete: %+v", p)
			}
			if p.Policy.Backoff.Base > p.Policy.Backoff.Max || p.Policy.MaxStatusRequests < 1 {
				t.Fatalf("accepted policy is invalid: %+v", p.Policy)
			}
			// Everything accepted must be matchable back from its own expansion.
			params := map[string]string{}
			for _, n := range p.Status.Request.Placeholders() {
				params[n] = "x1"
			}
			u, err := p.Status.Request.Expand(params, p.BaseURL)
			if err != nil {
				t.Fatalf("expand %q: %v", p.Status.Request, err)
			}
			_ = u
		}
		_ = c.Hosts()
	})
}

// Body classification never panics, whatever the provider sends, and the
// decision is always one of the documented, self-consistent outcomes.
func FuzzOnResponse(f *testing.F) {
	files, _ := filepath.Glob("testdata/vectors/*/*.json")
	for _, file := range files {
		if data, err := os.ReadFile(file); err == nil {
			f.Add(200, string(data), "")
		}
	}
	f.Add(200, `{"state":"queued","poll_after_seconds":1e308,"next_check_at":"9999-12-31T23:59:59Z","expires_at":-1}`, "")
	f.Add(200, `{"state":"succeeded","result_url":"http://[::1"}`, "")
	f.Add(429, ``, "Fri, 31 Dec 9999 23:59:59 GMT")
	f.Add(503, `{}`, "-5")
	f.Add(200, `{"state":["a"]}`, "1")
	f.Add(404, `null`, "")
	c, err := Load("testdata/example.yaml")
	if err != nil {
		f.Fatal(err)
	}
	p := c.ProviderByName("example-exports")
	valid := map[Action]bool{ActWait: true, ActNotReady: true, ActSucceed: true, ActEscalate: true}
	f.Fuzz(func(t *testing.T, code int, body, retryAfter string) {
		op := NewOperation(p, c, "op", "j", "a", OriginFirstStatusCal, t0, nil)
		op.Used.StatusRequests = 1
		h := http.Header{}
		if retryAfter != "" {
			h.Set("Retry-After", retryAfter)
		}
		at := t0.Add(10 * time.Second)
		d := OnResponse(p, op, Response{StatusCode: code, Header: h, Body: []byte(body)}, at, fixedRand(0.5))
		if !valid[d.Action] || d.Op == nil || d.Story == "" {
			t.Fatalf("bad decision %+v", d)
		}
		if d.Op.Used.Polls != 1 {
			t.Fatalf("polls %d", d.Op.Used.Polls)
		}
		switch d.Action {
		case ActEscalate:
			if d.Op.Escalation == nil || d.Reason == "" || !d.Op.Phase.Terminal() || d.Op.Terminal == nil {
				t.Fatalf("escalation incomplete: %+v", d.Op)
			}
		case ActSucceed:
			if d.Op.Phase != PhaseSucceeded {
				t.Fatalf("succeed with phase %s", d.Op.Phase)
			}
		default:
			// R10: a waiting decision always leaves a poll before the deadline.
			if d.Wait < 0 || !d.NextPollAt.Before(d.Op.DeadlineAt) || d.Op.Phase != PhaseWaiting || d.NextPollAt.Before(at) {
				t.Fatalf("waiting decision out of bounds: wait %v next %v deadline %v", d.Wait, d.NextPollAt, d.Op.DeadlineAt)
			}
		}
	})
}
