package admin_test

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"pollgate/admin"
	"pollgate/admin/admintest"
	"pollgate/audit"
	"pollgate/ledger"
	"pollgate/rules"
)

const token = "s3cret-admin-token"

type fixture struct {
	srv   *httptest.Server
	store *ledger.BoltStore
	seed  *admintest.Seeder
	now   time.Time
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	c := admintest.Contract(t)
	store := admintest.Store(t, nil)
	f := &fixture{store: store, seed: admintest.NewSeeder(t, store, c), now: admintest.Start.Add(30 * time.Minute)}
	h := admin.New(admin.Config{Store: store, Contract: func() *rules.Contract { return c }, Token: token,
		Now: func() time.Time { return f.now }, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	f.srv = httptest.NewServer(h)
	t.Cleanup(f.srv.Close)
	return f
}

// do sends a request with the admin token and decodes the JSON answer into out.
func (f *fixture) do(t *testing.T, method, path, body string, out any) int {
	t.Helper()
	return f.doToken(t, token, method, path, body, out)
}

func (f *fixture) doToken(t *testing.T, tok, method, path, body string, out any) int {
	t.Helper()
	req, _ := http.NewRequest(method, f.srv.URL+path, strings.NewReader(body))
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			t.Fatalf("%s %s: %d, body not JSON: %v: %s", method, path, resp.StatusCode, err, raw)
		}
	}
	return resp.StatusCode
}

func TestTokenRequired(t *testing.T) {
	f := newFixture(t)
	for _, tok := range []string{"", "wrong", token + "x", strings.ToUpper(token)} {
		var e admin.Error
		if code := f.doToken(t, tok, "GET", "/api/operations", "", &e); code != http.StatusUnauthorized {
			t.Errorf("token %q: status %d, want 401", tok, code)
		}
		if e.Error == "" || !strings.Contains(e.Hint, "POLLGATE_ADMIN_TOKEN") {
			t.Errorf("token %q: error body %+v", tok, e)
		}
	}
	// Every endpoint is behind the token, also unknown ones and POSTs.
	for _, p := range []string{"/api/report", "/api/audit/export", "/api/nope"} {
		if code := f.doToken(t, "", "GET", p, "", nil); code != http.StatusUnauthorized {
			t.Errorf("%s without token: %d", p, code)
		}
	}
	if code := f.doToken(t, "", "POST", "/api/operations/x/extend", `{}`, nil); code != http.StatusUnauthorized {
		t.Errorf("extend without token: %d", code)
	}
	if code := f.do(t, "GET", "/api/operations", "", nil); code != http.StatusOK {
		t.Errorf("right token: %d", code)
	}
	// A handler configured without a token refuses everything (fails closed).
	h := admin.New(admin.Config{Store: f.store, Contract: func() *rules.Contract { return nil }})
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("GET", "/api/operations", nil)
	req.Header.Set("Authorization", "Bearer ")
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusUnauthorized {
		t.Errorf("no token configured: %d, want 401", rec.Code)
	}
}

func TestListPaginationAndFilters(t *testing.T) {
	f := newFixture(t)
	want := map[string]bool{}
	for range 3 {
		want[f.seed.Waiting("acme").ID] = true
	}
	want[f.seed.Escalated("acme", rules.ReasonDeadlineExceeded).ID] = true
	want[f.seed.Escalated("globex", rules.ReasonRequestBudgetExhausted).ID] = true
	want[f.seed.Succeeded("globex").ID] = true

	got := map[string]bool{}
	cursor, pages := "", 0
	for {
		var lr admin.ListResponse
		if code := f.do(t, "GET", "/api/operations?limit=2&cursor="+cursor, "", &lr); code != 200 {
			t.Fatalf("page %d: %d", pages, code)
		}
		pages++
		if len(lr.Operations) > 2 {
			t.Fatalf("page of %d items with limit 2", len(lr.Operations))
		}
		for _, op := range lr.Operations {
			if op.ID == "" || got[op.ID] {
				t.Fatalf("missing or repeated operation_id %q", op.ID)
			}
			got[op.ID] = true
		}
		if lr.NextCursor == "" {
			break
		}
		cursor = lr.NextCursor
	}
	if pages != 3 || len(got) != len(want) {
		t.Errorf("%d pages, %d operations; want 3 pages, %d operations", pages, len(got), len(want))
	}

	var lr admin.ListResponse
	f.do(t, "GET", "/api/operations?phase=escalated", "", &lr)
	if len(lr.Operations) != 2 {
		t.Errorf("phase=escalated: %d operations, want 2", len(lr.Operations))
	}
	for _, op := range lr.Operations {
		if op.Phase != rules.PhaseEscalated || op.Escalation == nil {
			t.Errorf("phase filter returned %s", op.Phase)
		}
	}
	f.do(t, "GET", "/api/operations?provider=globex", "", &lr)
	if len(lr.Operations) != 2 {
		t.Errorf("provider=globex: %d operations, want 2", len(lr.Operations))
	}
	f.do(t, "GET", "/api/operations?provider=globex&phase=succeeded", "", &lr)
	if len(lr.Operations) != 1 || lr.Operations[0].Terminal == nil || lr.Operations[0].Terminal.Body != nil {
		t.Errorf("succeeded list item should carry the terminal status without its body: %+v", lr.Operations)
	}

	for _, q := range []string{"phase=finished", "limit=0", "limit=abc", "limit=5000", "cursor=***"} {
		var e admin.Error
		if code := f.do(t, "GET", "/api/operations?"+q, "", &e); code != http.StatusBadRequest || e.Error == "" || e.Hint == "" {
			t.Errorf("%s: %d %+v, want 400 with error and hint", q, code, e)
		}
	}
}

func TestShowStoryAndAudit(t *testing.T) {
	f := newFixture(t)
	op := f.seed.Escalated("acme", rules.ReasonRequestBudgetExhausted)
	var sr admin.ShowResponse
	if code := f.do(t, "GET", "/api/operations/"+op.ID, "", &sr); code != 200 {
		t.Fatalf("show: %d", code)
	}
	if sr.Operation == nil || sr.Operation.ID != op.ID || sr.Operation.Escalation == nil {
		t.Fatalf("show returned %+v", sr.Operation)
	}
	// R25: one line per audit entry, "15:04:05 <story>".
	line := regexp.MustCompile(`^\d\d:\d\d:\d\d \S`)
	if len(sr.Story) != 3 {
		t.Fatalf("story has %d lines, want 3 (created, polled, escalated): %q", len(sr.Story), sr.Story)
	}
	for _, l := range sr.Story {
		if !line.MatchString(l) {
			t.Errorf("story line %q is not '15:04:05 <story>'", l)
		}
	}
	if !strings.HasPrefix(sr.Story[0], "10:20:00 submitted job") || !strings.HasPrefix(sr.Story[2], "10:30:00 ") ||
		!strings.Contains(sr.Story[2], "escalated") {
		t.Errorf("story: %q", sr.Story)
	}
	// R18: the message names the operation, the reason and the options.
	for _, want := range []string{op.ID, "request_budget_exhausted", "extend"} {
		if !strings.Contains(sr.Message, want) {
			t.Errorf("message %q lacks %q", sr.Message, want)
		}
	}

	var ar admin.AuditResponse
	if code := f.do(t, "GET", "/api/operations/"+op.ID+"/audit", "", &ar); code != 200 || len(ar.Entries) != 3 {
		t.Fatalf("audit: %d, %d entries", code, len(ar.Entries))
	}
	prev := audit.ZeroHash
	for i, e := range ar.Entries {
		if e.Seq != int64(i+1) || e.Prev != prev || len(e.Hash) != 64 || e.OperationID != op.ID || e.Story == "" {
			t.Errorf("entry %d: %+v", i, e)
		}
		prev = e.Hash
	}
	if ar.Entries[2].Event != "escalated" || ar.Entries[2].Reason != "request_budget_exhausted" {
		t.Errorf("last entry: %+v", ar.Entries[2].Entry)
	}

	for _, p := range []string{"/api/operations/op_nope", "/api/operations/op_nope/audit"} {
		var e admin.Error
		if code := f.do(t, "GET", p, "", &e); code != http.StatusNotFound || !strings.Contains(e.Error, "op_nope") {
			t.Errorf("%s: %d %+v", p, code, e)
		}
	}
}

func TestExtendBounds(t *testing.T) {
	f := newFixture(t)
	op := f.seed.Escalated("acme", rules.ReasonRequestBudgetExhausted)
	before, _ := f.store.GetByID(t.Context(), op.ID)
	path := "/api/operations/" + op.ID + "/extend"

	cases := []struct {
		name, body string
		code       int
		errHas     string
	}{
		{"bad json", `{"duration":`, 400, "invalid JSON"},
		{"unknown field", `{"duration":"15m","status_requests":4,"by":"al","minutes":3}`, 400, "unknown field"},
		{"bad duration", `{"duration":"soon","status_requests":4,"by":"al"}`, 400, "invalid duration"},
		{"negative duration", `{"duration":"-5m","status_requests":4,"by":"al"}`, 400, "invalid duration"},
		{"no requests", `{"duration":"15m","status_requests":0,"by":"al"}`, 400, "status_requests"},
		{"no by", `{"duration":"15m","status_requests":4}`, 400, "by"},
		{"duration above offer", `{"duration":"16m","status_requests":4,"by":"al"}`, 409, "exceeds the offered 15m"},
		{"requests above offer", `{"duration":"15m","status_requests":5,"by":"al"}`, 409, "exceed the offered 4"},
	}
	for _, c := range cases {
		var e admin.Error
		if code := f.do(t, "POST", path, c.body, &e); code != c.code || !strings.Contains(e.Error, c.errHas) {
			t.Errorf("%s: %d %+v, want %d containing %q", c.name, code, e, c.code, c.errHas)
		}
	}
	// Nothing changed after the refusals.
	if after, _ := f.store.GetByID(t.Context(), op.ID); after.AuditCount != before.AuditCount || after.Phase != rules.PhaseEscalated {
		t.Fatalf("refused extensions changed the record: %+v", after)
	}
	var e admin.Error
	if code := f.do(t, "POST", "/api/operations/op_nope/extend", `{"duration":"15m","status_requests":4,"by":"al"}`, &e); code != 404 {
		t.Errorf("unknown id: %d %+v", code, e)
	}

	// Within the bounds: R24, a new authorization; the next poll is allowed at once.
	var or admin.OperationResponse
	if code := f.do(t, "POST", path, `{"duration":"10m","status_requests":3,"by":"alice","note":"provider is slow today"}`, &or); code != 200 {
		t.Fatalf("extend: %d", code)
	}
	n := or.Operation
	if n.Phase != rules.PhaseWaiting || n.Escalation != nil || !n.DeadlineAt.Equal(laterOf(before.DeadlineAt, f.now).Add(10*time.Minute)) ||
		n.Budget.StatusRequests != before.Budget.StatusRequests+3 || n.NextPollAt.After(f.now) ||
		n.DelaySource != rules.DelayManualExtension || len(n.Extensions) != 1 || n.Extensions[0].By != "alice" {
		t.Errorf("extended record: %+v", n)
	}
	var sr admin.ShowResponse
	f.do(t, "GET", "/api/operations/"+op.ID, "", &sr)
	last := sr.Story[len(sr.Story)-1]
	if !strings.Contains(last, "extended by 10m by alice with 3 more status requests") || !strings.Contains(last, "provider is slow today") {
		t.Errorf("story after extension: %q", last)
	}

	// Not escalated any more: refused.
	if code := f.do(t, "POST", path, `{"duration":"10m","status_requests":3,"by":"alice"}`, &e); code != 409 || !strings.Contains(e.Error, "not escalated") {
		t.Errorf("extend a waiting operation: %d %+v", code, e)
	}
}

func TestExtendLimitsPerReason(t *testing.T) {
	f := newFixture(t)
	body := `{"duration":"15m","status_requests":4,"by":"al"}`
	// R18: authorization_denied never offers another identical request.
	denied := f.seed.Escalated("acme", rules.ReasonAuthorizationDenied)
	var e admin.Error
	if code := f.do(t, "POST", "/api/operations/"+denied.ID+"/extend", body, &e); code != 409 || !strings.Contains(e.Error, "authorization_denied") {
		t.Errorf("authorization_denied: %d %+v", code, e)
	}
	// max_extensions is 1: after one extension and a new escalation, refused.
	op := f.seed.Escalated("acme", rules.ReasonDeadlineExceeded)
	if code := f.do(t, "POST", "/api/operations/"+op.ID+"/extend", body, nil); code != 200 {
		t.Fatalf("first extension: %d", code)
	}
	cur, _ := f.store.GetByID(t.Context(), op.ID)
	p := admintest.Contract(t).ProviderByName("acme")
	d := rules.EscalateNow(p, cur, rules.ReasonDeadlineExceeded, "again", f.now.Add(16*time.Minute))
	if _, err := f.store.Escalate(t.Context(), ledger.KeyOf(cur), d.Op, audit.Entry{Event: "escalated", Story: d.Story}); err != nil {
		t.Fatal(err)
	}
	if code := f.do(t, "POST", "/api/operations/"+op.ID+"/extend", body, &e); code != 409 {
		t.Errorf("second extension with max_extensions 1: %d %+v", code, e)
	}
}

func TestCloseAndAllowResubmission(t *testing.T) {
	f := newFixture(t)
	op := f.seed.Escalated("acme", rules.ReasonUnknownState)
	var or admin.OperationResponse
	if code := f.do(t, "POST", "/api/operations/"+op.ID+"/close", `{"by":"bob"}`, &or); code != 200 {
		t.Fatalf("close: %d", code)
	}
	if or.Operation.Phase != rules.PhaseClosed || or.Operation.ClosedBy != "bob" || !or.Operation.ClosedAt.Equal(f.now) ||
		or.Operation.Escalation == nil {
		t.Errorf("closed record: %+v", or.Operation)
	}
	var e admin.Error
	if code := f.do(t, "POST", "/api/operations/"+op.ID+"/close", ``, &e); code != 409 || !strings.Contains(e.Error, "already closed by bob") {
		t.Errorf("second close: %d %+v", code, e)
	}
	waiting := f.seed.Waiting("acme")
	if code := f.do(t, "POST", "/api/operations/"+waiting.ID+"/close", ``, &e); code != 409 {
		t.Errorf("close a waiting operation: %d", code)
	}
	if code := f.do(t, "POST", "/api/operations/op_nope/close", ``, &e); code != 404 {
		t.Errorf("close unknown: %d", code)
	}

	// R20: the proxy records a blocked identical submission on the waiting
	// operation; a person may let one through, once.
	blocked := f.seed.ResubmissionBlocked("acme")
	if code := f.do(t, "POST", "/api/operations/"+blocked.ID+"/allow-resubmission", `{"by":"carol"}`, &or); code != 200 || !or.Operation.ResubmissionAllowed ||
		or.Operation.Phase != rules.PhaseWaiting {
		t.Fatalf("allow-resubmission: %d %+v", code, or.Operation)
	}
	if code := f.do(t, "POST", "/api/operations/"+blocked.ID+"/allow-resubmission", ``, &e); code != 409 || !strings.Contains(e.Error, "already allowed") {
		t.Errorf("second allow-resubmission before use: %d %+v", code, e)
	}
	f.seed.UseResubmission(blocked)
	if code := f.do(t, "POST", "/api/operations/"+blocked.ID+"/allow-resubmission", ``, &e); code != 409 || !strings.Contains(e.Error, "already allowed once") {
		t.Errorf("allow-resubmission after the allowed one was used: %d %+v", code, e)
	}
	if code := f.do(t, "POST", "/api/operations/"+waiting.ID+"/allow-resubmission", ``, &e); code != 409 || !strings.Contains(e.Error, "no resubmission") {
		t.Errorf("allow-resubmission without a blocked submission: %d %+v", code, e)
	}
	escBlocked := f.seed.Escalated("acme", rules.ReasonResubmissionBlocked)
	if code := f.do(t, "POST", "/api/operations/"+escBlocked.ID+"/allow-resubmission", ``, &or); code != 200 {
		t.Errorf("allow-resubmission for an escalated resubmission_blocked: %d", code)
	}
	var sr admin.ShowResponse
	f.do(t, "GET", "/api/operations/"+blocked.ID, "", &sr)
	if story := strings.Join(sr.Story, "\n"); !strings.Contains(story, "one resubmission of the same request allowed by carol") {
		t.Errorf("story: %s", story)
	}
}

// R27: the report measures success - every job ends in a terminal result or a
// bounded escalation, the share of early polls shows whether agents respect
// the waiting instructions, and the time to a terminal result is reported.
func TestReport(t *testing.T) {
	f := newFixture(t)
	w := f.seed.Waiting("acme")
	f.seed.EarlyPoll(w)
	f.seed.EarlyPoll(w)
	f.seed.Escalated("acme", rules.ReasonDeadlineExceeded)
	f.seed.Escalated("acme", rules.ReasonDeadlineExceeded)
	f.seed.Escalated("acme", rules.ReasonUnknownState)
	f.seed.Succeeded("acme")
	f.seed.Succeeded("globex")

	var rep admin.Report
	if code := f.do(t, "GET", "/api/report", "", &rep); code != 200 {
		t.Fatalf("report: %d", code)
	}
	if len(rep.Providers) != 2 || rep.Providers[0].Provider != "acme" || rep.Providers[1].Provider != "globex" {
		t.Fatalf("providers: %+v", rep.Providers)
	}
	a := rep.Providers[0]
	if a.Operations != 5 || a.Succeeded != 1 || a.Waiting != 1 || a.EscalatedTotal != 3 ||
		a.Escalated["deadline_exceeded"] != 2 || a.Escalated["unknown_state"] != 1 {
		t.Errorf("acme outcomes: %+v", a)
	}
	// 5 operations polled once each (+1 for the success) = 6 requests; 2 early polls.
	if a.StatusRequests != 6 || a.EarlyPolls != 2 || a.EarlyPollShare != 0.25 {
		t.Errorf("acme polls: sent %d early %d share %v", a.StatusRequests, a.EarlyPolls, a.EarlyPollShare)
	}
	// Terminal after 2m (success) and 10m (three escalations): median 10m, p95 10m.
	if a.Terminal != 4 || a.MedianSeconds != 600 || a.P95Seconds != 600 {
		t.Errorf("acme times: terminal %d median %v p95 %v", a.Terminal, a.MedianSeconds, a.P95Seconds)
	}
	if g := rep.Providers[1]; g.Succeeded != 1 || g.MedianSeconds != 120 {
		t.Errorf("globex: %+v", g)
	}
	if rep.Total.Operations != 6 || rep.Total.Succeeded != 2 {
		t.Errorf("total: %+v", rep.Total)
	}
}

func TestExportVerifies(t *testing.T) {
	f := newFixture(t)
	f.seed.Escalated("acme", rules.ReasonDeadlineExceeded)
	f.seed.Succeeded("globex")
	req, _ := http.NewRequest("GET", f.srv.URL+"/api/audit/export", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/x-ndjson" {
		t.Fatalf("export: %s %s", resp.Status, resp.Header.Get("Content-Type"))
	}
	rep, err := audit.Verify(bytes.NewReader(body))
	if err != nil || !rep.OK() || rep.Operations != 2 || rep.Entries != 6 {
		t.Errorf("verify: %+v %v", rep, err)
	}
}

func TestMetricsAndUnknownEndpoints(t *testing.T) {
	f := newFixture(t)
	var e admin.Error
	if code := f.do(t, "GET", "/api/nothing", "", &e); code != 404 || e.Hint == "" {
		t.Errorf("unknown endpoint: %d %+v", code, e)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewCounter(prometheus.CounterOpts{Name: "pollgate_test_total", Help: "test"}))
	h := admin.New(admin.Config{Store: f.store, Contract: func() *rules.Contract { return nil }, Token: token, Registry: reg})
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if rec.Code != http.StatusUnauthorized {
		t.Errorf("/metrics without token: %d", rec.Code)
	}
	rec = httptest.NewRecorder()
	req := httptest.NewRequest("GET", "/metrics", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	h.ServeHTTP(rec, req)
	if rec.Code != 200 || !strings.Contains(rec.Body.String(), "pollgate_test_total 0") {
		t.Errorf("/metrics: %d %s", rec.Code, rec.Body.String())
	}
}

// laterOf returns the later of two times (an extension counts from the later
// of the old deadline and now, R24).
func laterOf(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
