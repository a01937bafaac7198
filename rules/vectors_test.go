package rules

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// vector is one recorded provider answer under testdata/vectors/<provider>/
// and what the shipped contract must decide about it.
type vector struct {
	Doc      string            `json:"doc"`       // where the shape comes from
	Now      string            `json:"now"`       // RFC 3339 decision time; default vectorNow
	Elapsed  string            `json:"elapsed"`   // time since the operation started; default 1m
	Status   int               `json:"status"`    // HTTP status code
	Headers  map[string]string `json:"headers"`   // response headers
	Body     json.RawMessage   `json:"body"`      // JSON body
	BodyText *string           `json:"body_text"` // non-JSON body, instead of body
	Expect   struct {
		Action        Action `json:"action"`
		Reason        Reason `json:"reason"`
		Class         string `json:"class"`
		State         string `json:"state"`
		Phase         Phase  `json:"phase"`
		ProviderError string `json:"provider_error"` // substring of Operation.ProviderError
		ResultURL     string `json:"result_url"`
		DelaySource   string `json:"delay_source"`
		Wait          string `json:"wait"` // exact: vectors run with the jitter floor (fixedRand(0))
		Note          string `json:"note"` // substring
		RequestID     string `json:"request_id"`
	} `json:"expect"`
}

const vectorNow = "2024-05-01T10:00:00Z"

// TestProviderVectors runs every recorded response through OnResponse with
// the shipped providers.yaml (R1-R3, R13, R15-R17).
func TestProviderVectors(t *testing.T) {
	c := mustLoad(t, "../providers.yaml")
	dirs, err := os.ReadDir("testdata/vectors")
	if err != nil {
		t.Fatal(err)
	}
	seenStates := map[string]map[string]bool{}
	total := 0
	for _, dir := range dirs {
		p := c.ProviderByName(dir.Name())
		if p == nil {
			t.Errorf("vectors for unknown provider %q", dir.Name())
			continue
		}
		seenStates[p.Name] = map[string]bool{}
		files, _ := filepath.Glob(filepath.Join("testdata/vectors", dir.Name(), "*.json"))
		for _, f := range files {
			total++
			name := dir.Name() + "/" + strings.TrimSuffix(filepath.Base(f), ".json")
			t.Run(name, func(t *testing.T) {
				var v vector
				data, err := os.ReadFile(f)
				if err != nil {
					t.Fatal(err)
				}
				dec := json.NewDecoder(strings.NewReader(string(data)))
				dec.DisallowUnknownFields()
				if err := dec.Decode(&v); err != nil {
					t.Fatalf("bad vector file: %v", err)
				}
				now := mustTime(t, v.Now, vectorNow)
				elapsed := time.Minute
				if v.Elapsed != "" {
					elapsed, _ = time.ParseDuration(v.Elapsed)
				}
				op := NewOperation(p, c, "op_vec", "job_vec", "acct_vec", OriginFirstStatusCal, now.Add(-elapsed), nil)
				op.Used.StatusRequests = 1
				r := Response{StatusCode: v.Status, Header: http.Header{}}
				for k, val := range v.Headers {
					r.Header.Set(k, val)
				}
				if v.BodyText != nil {
					r.Body = []byte(*v.BodyText)
				} else {
					r.Body = v.Body
				}
				d := OnResponse(p, op, r, now, fixedRand(0))
				e := v.Expect
				if d.Action != e.Action || d.Reason != e.Reason {
					t.Fatalf("got %s/%s, want %s/%s (story %q, note %q)", d.Action, d.Reason, e.Action, e.Reason, d.Story, d.Note)
				}
				if e.Class != "" && d.StateClass != e.Class {
					t.Errorf("class %q, want %q", d.StateClass, e.Class)
				}
				if e.State != "" && d.State != e.State {
					t.Errorf("state %q, want %q", d.State, e.State)
				}
				if e.Phase != "" && d.Op.Phase != e.Phase {
					t.Errorf("phase %s, want %s", d.Op.Phase, e.Phase)
				}
				if !strings.Contains(d.Op.ProviderError, e.ProviderError) || (e.ProviderError == "" && d.Op.ProviderError != "") {
					t.Errorf("provider error %q, want %q", d.Op.ProviderError, e.ProviderError)
				}
				if d.Op.ResultURL != e.ResultURL {
					t.Errorf("result url %q, want %q", d.Op.ResultURL, e.ResultURL)
				}
				if e.DelaySource != "" && string(d.DelaySource) != e.DelaySource {
					t.Errorf("delay source %s, want %s", d.DelaySource, e.DelaySource)
				}
				if e.Wait != "" {
					if w, _ := time.ParseDuration(e.Wait); d.Wait != w {
						t.Errorf("wait %v, want %v", d.Wait, w)
					}
				}
				if !strings.Contains(d.Note, e.Note) {
					t.Errorf("note %q, want %q", d.Note, e.Note)
				}
				if e.RequestID != "" && d.Op.LastRequestID != e.RequestID {
					t.Errorf("request id %q, want %q", d.Op.LastRequestID, e.RequestID)
				}
				if d.StateClass != "" && d.State != "" && d.StateClass != ClassUnknown {
					seenStates[p.Name][d.State] = true
				}
			})
		}
	}
	// At least one vector per state of each shipped contract.
	for _, p := range c.Providers {
		st := p.Status.States
		for _, list := range [][]string{st.Waiting, st.Success, st.Failure, st.Cancelled, st.Expired} {
			for _, s := range list {
				if !seenStates[p.Name][s] {
					t.Errorf("provider %s: no vector for state %q", p.Name, s)
				}
			}
		}
	}
	if total < 40 {
		t.Errorf("only %d vectors", total)
	}
}

func mustTime(t *testing.T, s, def string) time.Time {
	t.Helper()
	if s == "" {
		s = def
	}
	tm, err := time.Parse(time.RFC3339, s)
	if err != nil {
		t.Fatal(err)
	}
	return tm
}
