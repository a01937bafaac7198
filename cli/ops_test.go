package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"pollgate/admin"
	"pollgate/admin/admintest"
	"pollgate/ledger"
	"pollgate/rules"
)

const testToken = "cli-test-token"

// opsServer runs the admin API over a real bbolt ledger on a loopback port.
type opsServer struct {
	srv   *httptest.Server
	store *ledger.BoltStore
	seed  *admintest.Seeder
	dir   string
	now   time.Time
}

func newOpsServer(t *testing.T, key []byte) *opsServer {
	t.Helper()
	c := admintest.Contract(t)
	dir := t.TempDir()
	store := admintest.StoreIn(t, dir, key)
	s := &opsServer{store: store, seed: admintest.NewSeeder(t, store, c), dir: dir, now: admintest.Start.Add(30 * time.Minute)}
	h := admin.New(admin.Config{Store: store, Contract: func() *rules.Contract { return c }, Token: testToken, AuditKey: key,
		Now: func() time.Time { return s.now }, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	s.srv = httptest.NewServer(h)
	t.Cleanup(s.srv.Close)
	return s
}

func (s *opsServer) env() map[string]string {
	return map[string]string{
		"POLLGATE_ADMIN":       strings.TrimPrefix(s.srv.URL, "http://"),
		"POLLGATE_ADMIN_TOKEN": testToken,
		"USER":                 "tester",
	}
}

type result struct {
	code           int
	stdout, stderr string
}

// run executes one pollgate command line as main does.
func run(t *testing.T, vars map[string]string, args ...string) result {
	t.Helper()
	var out, errb bytes.Buffer
	code := Run(context.Background(), args, Env{Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errb,
		Getenv: func(k string) string { return vars[k] }})
	return result{code, out.String(), errb.String()}
}

func TestOpsEndToEnd(t *testing.T) {
	s := newOpsServer(t, nil)
	env := s.env()
	esc := s.seed.Escalated("acme", rules.ReasonRequestBudgetExhausted)
	denied := s.seed.Escalated("acme", rules.ReasonAuthorizationDenied)
	waiting := s.seed.Waiting("globex")

	// list: an aligned table with every operation.
	r := run(t, env, "ops", "list")
	if r.code != 0 {
		t.Fatalf("ops list: %d %s", r.code, r.stderr)
	}
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != 4 || !strings.HasPrefix(lines[0], "OPERATION") {
		t.Fatalf("ops list output:\n%s", r.stdout)
	}
	col := strings.Index(lines[0], "PHASE")
	for _, l := range lines[1:] {
		if !strings.HasPrefix(l[col:], "escalated") && !strings.HasPrefix(l[col:], "waiting") {
			t.Errorf("column PHASE not aligned in %q", l)
		}
	}
	if !strings.Contains(r.stdout, esc.ID) || !strings.Contains(r.stdout, "request_budget_exhausted") || !strings.Contains(r.stdout, waiting.ID) {
		t.Errorf("ops list misses operations:\n%s", r.stdout)
	}

	// list --phase escalated --json: machine-readable, filtered.
	r = run(t, env, "ops", "list", "--phase", "escalated", "--json")
	var lr admin.ListResponse
	if err := json.Unmarshal([]byte(r.stdout), &lr); err != nil || r.code != 0 {
		t.Fatalf("ops list --json: %d %v\n%s", r.code, err, r.stdout)
	}
	if len(lr.Operations) != 2 {
		t.Errorf("--phase escalated: %d operations", len(lr.Operations))
	}
	r = run(t, env, "ops", "list", "--provider", "globex", "--limit", "1", "--json")
	if err := json.Unmarshal([]byte(r.stdout), &lr); err != nil || len(lr.Operations) != 1 || lr.Operations[0].ID != waiting.ID {
		t.Errorf("--provider globex --limit 1: %v %s", err, r.stdout)
	}

	// show: the R18 message, the options with their commands, the R25 story.
	r = run(t, env, "ops", "show", esc.ID)
	if r.code != 0 {
		t.Fatalf("ops show: %d %s", r.code, r.stderr)
	}
	flat := strings.Join(strings.Fields(r.stdout), " ")
	if !strings.Contains(flat, strings.Join(strings.Fields(esc.Escalation.Message), " ")) {
		t.Errorf("ops show lacks the R18 message %q:\n%s", esc.Escalation.Message, r.stdout)
	}
	for _, want := range []string{"phase       escalated (request_budget_exhausted)", "message:",
		"pollgate ops extend " + esc.ID + " --for 15m --requests 4", "story (UTC):", "10:20:00 submitted job", "escalated"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("ops show lacks %q:\n%s", want, r.stdout)
		}
	}

	// extend outside the offered bounds: refused, exit 1, clear reason.
	r = run(t, env, "ops", "extend", esc.ID, "--for", "16m", "--requests", "4")
	if r.code != 1 || !strings.Contains(r.stderr, "extension refused") || !strings.Contains(r.stderr, "exceeds the offered 15m") {
		t.Errorf("extend beyond bounds: %d %q", r.code, r.stderr)
	}
	// authorization_denied: never.
	r = run(t, env, "ops", "extend", denied.ID, "--for", "5m", "--requests", "1")
	if r.code != 1 || !strings.Contains(r.stderr, "authorization_denied") {
		t.Errorf("extend authorization_denied: %d %q", r.code, r.stderr)
	}
	// Usage errors: exit 2.
	for _, args := range [][]string{
		{"ops", "extend", esc.ID},
		{"ops", "extend", "--for", "15m", "--requests", "4"},
		{"ops", "show"},
		{"ops", "frobnicate"},
		{"ops", "list", "--bogus"},
		{"ops"},
	} {
		if r := run(t, env, args...); r.code != 2 {
			t.Errorf("%v: exit %d, want 2 (%s)", args, r.code, r.stderr)
		}
	}
	// Unknown id: exit 1, says so.
	if r := run(t, env, "ops", "show", "op_missing"); r.code != 1 || !strings.Contains(r.stderr, "op_missing not found") {
		t.Errorf("show unknown: %d %q", r.code, r.stderr)
	}

	// Within the bounds: accepted; flags after the id; --by defaults to $USER.
	r = run(t, env, "ops", "extend", esc.ID, "--for", "15m", "--requests", "4", "--note", "provider is slow today")
	if r.code != 0 || !strings.Contains(r.stdout, "extended "+esc.ID+" by 15m with 4 more status requests (approved by tester)") ||
		!strings.Contains(r.stdout, "the next poll is allowed now") {
		t.Fatalf("extend: %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	stored, _ := s.store.GetByID(context.Background(), esc.ID)
	// R24: the deadline moves 15m past the later of the old deadline and now.
	wantDeadline := esc.DeadlineAt
	if wantDeadline.Before(s.now) {
		wantDeadline = s.now
	}
	if stored.Phase != rules.PhaseWaiting || !stored.DeadlineAt.Equal(wantDeadline.Add(15*time.Minute)) || stored.Extensions[0].By != "tester" {
		t.Errorf("stored after extend: %+v", stored)
	}
	r = run(t, env, "ops", "show", esc.ID)
	if !regexp.MustCompile(`10:50:00 extended by 15m by tester with 4 more status requests`).MatchString(r.stdout) {
		t.Errorf("story after extend:\n%s", r.stdout)
	}

	// close: only escalations; the denied one can be closed, once.
	if r := run(t, env, "ops", "close", waiting.ID); r.code != 1 || !strings.Contains(r.stderr, "close refused") {
		t.Errorf("close waiting: %d %q", r.code, r.stderr)
	}
	r = run(t, env, "ops", "close", "--by", "ops-oncall", denied.ID)
	if r.code != 0 || !strings.Contains(r.stdout, "closed "+denied.ID+" (authorization_denied acknowledged by ops-oncall)") {
		t.Errorf("close: %d %q %q", r.code, r.stdout, r.stderr)
	}
	if r := run(t, env, "ops", "close", denied.ID); r.code != 1 || !strings.Contains(r.stderr, "already closed by ops-oncall") {
		t.Errorf("second close: %d %q", r.code, r.stderr)
	}
	// allow-resubmission only for resubmission_blocked.
	blocked := s.seed.ResubmissionBlocked("acme")
	if r := run(t, env, "ops", "allow-resubmission", blocked.ID, "--json"); r.code != 0 || !strings.Contains(r.stdout, `"resubmission_allowed": true`) {
		t.Errorf("allow-resubmission: %d %q %q", r.code, r.stdout, r.stderr)
	}
	if r := run(t, env, "ops", "allow-resubmission", blocked.ID); r.code != 1 {
		t.Errorf("second allow-resubmission: %d", r.code)
	}
}

func TestOpsConnectionAndToken(t *testing.T) {
	s := newOpsServer(t, nil)
	// Wrong token: exit 1 with a hint about the token.
	env := s.env()
	env["POLLGATE_ADMIN_TOKEN"] = "wrong"
	if r := run(t, env, "ops", "list"); r.code != 1 || !strings.Contains(r.stderr, "admin token was refused") {
		t.Errorf("wrong token: %d %q", r.code, r.stderr)
	}
	// Token from the data directory's admin.token.
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "admin.token"), []byte(testToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	env = s.env()
	delete(env, "POLLGATE_ADMIN_TOKEN")
	if r := run(t, env, "ops", "list", "--data", dir); r.code != 0 {
		t.Errorf("token from --data: %d %q", r.code, r.stderr)
	}
	if r := run(t, env, "ops", "list", "--data", t.TempDir()); r.code != 1 || !strings.Contains(r.stderr, "POLLGATE_ADMIN_TOKEN") {
		t.Errorf("no token anywhere: %d %q", r.code, r.stderr)
	}
	// A server that is down: exit 1, with a hint.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	down := ln.Addr().String()
	ln.Close()
	if r := run(t, s.env(), "ops", "list", "--admin", down); r.code != 1 || !strings.Contains(r.stderr, "pollgate serve") {
		t.Errorf("server down: %d %q", r.code, r.stderr)
	}
}

func TestReportCommand(t *testing.T) {
	s := newOpsServer(t, nil)
	w := s.seed.Waiting("acme")
	s.seed.EarlyPoll(w)
	s.seed.Escalated("acme", rules.ReasonDeadlineExceeded)
	s.seed.Succeeded("acme")
	s.seed.Succeeded("globex")
	r := run(t, s.env(), "report")
	if r.code != 0 {
		t.Fatalf("report: %d %s", r.code, r.stderr)
	}
	for _, re := range []string{
		`PROVIDER\s+OPERATIONS\s+SUCCEEDED\s+FAILED\s+ESCALATED\s+WAITING\s+EARLY POLLS\s+MEDIAN\s+P95`,
		`acme\s+3\s+1\s+0\s+1\s+1\s+20\.0% \(1\)\s+2m\s+10m`,
		`globex\s+1\s+1\s+0\s+0\s+0\s+0\.0% \(0\)\s+2m\s+2m`,
		`total\s+4\s+2`,
		`acme: deadline_exceeded 1`,
	} {
		if !regexp.MustCompile(re).MatchString(r.stdout) {
			t.Errorf("report lacks /%s/:\n%s", re, r.stdout)
		}
	}
	r = run(t, s.env(), "report", "--json")
	var rep admin.Report
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || rep.Total.Operations != 4 {
		t.Errorf("report --json: %v %+v", err, rep.Total)
	}
}
