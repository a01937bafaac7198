package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"pollgate/admin"
	"pollgate/notify"
)

const operatorContract = `version: 1
defaults:
  policy:
    deadline: 30s
    max_status_requests: %d
    backoff: {base: 500ms, max: 500ms, jitter_floor: 0.5}
    lease: 2s
    extension: {duration: 15m, status_requests: 2, max_extensions: 1}
  notify:
    webhook: %s
providers:
  - name: e2e
    base_url: %s
    account_header: Authorization
    status:
      request: GET /v1/jobs/{job_id}
      state: state
      states:
        waiting: [queued, running]
        success: [succeeded]
        failure: [failed]
    escalation:
      state_value: failed
`

// hookReceiver records the escalation webhooks it receives.
type hookReceiver struct {
	mu   sync.Mutex
	msgs []notify.Message
}

func (h *hookReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var m notify.Message
	if err := json.NewDecoder(r.Body).Decode(&m); err != nil {
		http.Error(w, err.Error(), 400)
		return
	}
	h.mu.Lock()
	h.msgs = append(h.msgs, m)
	h.mu.Unlock()
}

func (h *hookReceiver) got() []notify.Message {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]notify.Message(nil), h.msgs...)
}

// eventually polls cond every 50ms for up to 15s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(15 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// adminGet fetches an admin path with the server's token.
func adminGet(t *testing.T, addr, token, path string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest("GET", "http://"+addr+path, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func scrapeMetric(t *testing.T, addr, token, name string, labels map[string]string) float64 {
	t.Helper()
	code, body := adminGet(t, addr, token, "/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d", code)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	fam := fams[name]
	if fam == nil {
		return 0
	}
	sum := 0.0
next:
	for _, m := range fam.Metric {
		for _, l := range m.Label {
			if want, ok := labels[l.GetName()]; ok && want != l.GetValue() {
				continue next
			}
		}
		sum += metricValue(m)
	}
	return sum
}

func metricValue(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	}
	return 0
}

// The operators' surface inside the real binary: an agent's naive loop is
// escalated, the webhook hears about it, `pollgate ops` extends within the
// offered bounds (and refuses beyond them), the agent's next poll goes
// through at once, /metrics counts it all, a live contract reload (valid,
// then invalid) changes the active version without touching the existing
// operation's budget, and the audit export verifies.
func TestOperatorSurfaceEndToEnd(t *testing.T) {
	bin := e2ePollgateBinary(t)
	prov := newE2EProvider(t)
	hooks := &hookReceiver{}
	hookSrv := httptest.NewServer(hooks)
	defer hookSrv.Close()

	dir := t.TempDir()
	config := filepath.Join(dir, "providers.yaml")
	writeContract := func(budget int) {
		if err := os.WriteFile(config, []byte(fmt.Sprintf(operatorContract, budget, hookSrv.URL+"/hook", prov.URL)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	writeContract(2)
	data := filepath.Join(dir, "data")
	srv := e2eStartServe(t, bin, config, data, prov.CAFile)
	tokenBytes, err := os.ReadFile(filepath.Join(data, "admin.token"))
	if err != nil {
		t.Fatal(err)
	}
	token := strings.TrimSpace(string(tokenBytes))
	pollgate := func(args ...string) (int, string, string) {
		cmd := exec.Command(bin, args...)
		cmd.Env = append(e2eBaseEnv(), "POLLGATE_ADMIN="+srv.admin, "POLLGATE_DATA="+data, "USER=e2e-operator")
		var out, errb strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return code, out.String(), errb.String()
	}

	// A naive loop polls until pollgate escalates (budget 2).
	client := e2eClient(t, data, srv.listen)
	jobURL := prov.URL + "/v1/jobs/job_ops"
	var opID string
	eventually(t, "the escalation", func() bool {
		resp, _ := e2eGetJob(t, client, jobURL)
		opID = resp.Header.Get("Pollgate-Operation")
		if resp.Header.Get("Pollgate-Decision") == "escalated" {
			return true
		}
		time.Sleep(100 * time.Millisecond)
		return false
	})
	if resp, _ := e2eGetJob(t, client, jobURL); resp.Header.Get("Pollgate-Escalation") != "request_budget_exhausted" {
		t.Fatalf("escalation header %q", resp.Header.Get("Pollgate-Escalation"))
	}

	// The webhook receives the R18 message with its options.
	eventually(t, "the webhook", func() bool { return len(hooks.got()) > 0 })
	m := hooks.got()[0]
	if m.OperationID != opID || m.Reason != "request_budget_exhausted" || len(m.Options) == 0 || !strings.Contains(m.Text, opID) {
		t.Errorf("webhook message: %+v", m)
	}

	// The admin API is behind the token.
	if code, _ := adminGet(t, srv.admin, "", "/api/operations"); code != 401 {
		t.Errorf("admin API without token: %d", code)
	}

	// ops list / show through the real binary.
	code, out, errs := pollgate("ops", "list", "--phase", "escalated")
	if code != 0 || !strings.Contains(out, opID) || !strings.Contains(out, "request_budget_exhausted") {
		t.Fatalf("ops list: %d\n%s%s", code, out, errs)
	}
	code, out, _ = pollgate("ops", "show", opID)
	if code != 0 || !strings.Contains(out, "pollgate ops extend "+opID+" --for 15m --requests 2") || !strings.Contains(out, "escalated") {
		t.Fatalf("ops show: %d\n%s", code, out)
	}

	// Beyond the offered bounds: refused; within: accepted.
	if code, _, errs := pollgate("ops", "extend", opID, "--for", "1h", "--requests", "2"); code != 1 || !strings.Contains(errs, "exceeds the offered") {
		t.Errorf("extend beyond bounds: %d %s", code, errs)
	}
	code, out, errs = pollgate("ops", "extend", opID, "--for", "10m", "--requests", "2", "--note", "e2e")
	if code != 0 || !strings.Contains(out, "approved by e2e-operator") {
		t.Fatalf("extend: %d %s %s", code, out, errs)
	}
	// The next poll is allowed at once and reaches the provider.
	before := prov.pollCount("job_ops")
	resp, _ := e2eGetJob(t, client, jobURL)
	if resp.Header.Get("Pollgate-Decision") != "forwarded" || prov.pollCount("job_ops") != before+1 {
		t.Errorf("poll after extension: %s, provider polls %d -> %d", resp.Header.Get("Pollgate-Decision"), before, prov.pollCount("job_ops"))
	}
	var shown admin.ShowResponse
	_, out, _ = pollgate("ops", "show", opID, "--json")
	if err := json.Unmarshal([]byte(out), &shown); err != nil {
		t.Fatal(err)
	}
	extended := shown.Operation

	// close: acknowledged; agents keep getting the escalation body.
	closedURL := prov.URL + "/v1/jobs/job_closed"
	var closedID string
	eventually(t, "the second escalation", func() bool {
		resp, _ := e2eGetJob(t, client, closedURL)
		closedID = resp.Header.Get("Pollgate-Operation")
		time.Sleep(100 * time.Millisecond)
		return resp.Header.Get("Pollgate-Decision") == "escalated"
	})
	if code, out, errs := pollgate("ops", "close", closedID, "--note", "not needed any more"); code != 0 || !strings.Contains(out, "closed "+closedID) {
		t.Fatalf("ops close: %d %s %s", code, out, errs)
	}
	before = prov.pollCount("job_closed")
	resp, body := e2eGetJob(t, client, closedURL)
	if resp.Header.Get("Pollgate-Decision") != "escalated" || body["state"] != "failed" || prov.pollCount("job_closed") != before {
		t.Errorf("poll after close: %s %v (provider polls %d -> %d)", resp.Header.Get("Pollgate-Decision"), body, before, prov.pollCount("job_closed"))
	}

	// Metrics, scraped and parsed.
	tok := token
	if v := scrapeMetric(t, srv.admin, tok, "pollgate_escalations_total", map[string]string{"provider": "e2e", "reason": "request_budget_exhausted"}); v != 2 {
		t.Errorf("escalations metric %v", v)
	}
	if v := scrapeMetric(t, srv.admin, tok, "pollgate_governed_requests_total", map[string]string{"decision": "forwarded"}); v < 2 {
		t.Errorf("forwarded metric %v, want >= 2", v)
	}
	eventually(t, "the delivered notification metric", func() bool {
		return scrapeMetric(t, srv.admin, tok, "pollgate_notifications_total", map[string]string{"outcome": "delivered"}) == 2
	})
	_, raw := adminGet(t, srv.admin, tok, "/metrics")
	for _, line := range strings.Split(string(raw), "\n") {
		if line != "" && !strings.HasPrefix(line, "#") && !strings.HasPrefix(line, "pollgate_") {
			t.Errorf("metric without the pollgate_ prefix: %s", line)
		}
		if strings.Contains(line, "job_ops") || strings.Contains(line, opID) || strings.Contains(line, "https://") {
			t.Errorf("metric label holds a job id, operation id or URL: %s", line)
		}
	}
	hash1 := readyHash(t, srv.admin)
	if v := scrapeMetric(t, srv.admin, tok, "pollgate_contract_info", map[string]string{"hash": hash1}); v != 1 {
		t.Errorf("contract_info{hash=%s} = %v", hash1, v)
	}

	// Live reload: a valid edit changes the active version (/readyz and the
	// metric) but not the existing operation's deadline or budget. An agent
	// keeps polling meanwhile; every answer stays governed.
	stopTraffic := make(chan struct{})
	trafficDone := make(chan []string)
	go func() {
		var bad []string
		n := 0
		for {
			select {
			case <-stopTraffic:
				if n == 0 {
					bad = append(bad, "no traffic ran during the reloads")
				}
				trafficDone <- bad
				return
			default:
			}
			req, _ := http.NewRequest("GET", prov.URL+"/v1/jobs/job_bg", nil)
			req.Header.Set("Authorization", "Bearer sk-bg")
			resp, err := client.Do(req)
			if err != nil {
				bad = append(bad, err.Error())
				continue
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			n++
			if d := resp.Header.Get("Pollgate-Decision"); d == "" || resp.StatusCode >= 500 {
				bad = append(bad, fmt.Sprintf("%d decision %q", resp.StatusCode, d))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	writeContract(9)
	eventually(t, "the reload", func() bool { return readyHash(t, srv.admin) != hash1 })
	hash2 := readyHash(t, srv.admin)
	if v := scrapeMetric(t, srv.admin, tok, "pollgate_contract_info", map[string]string{"hash": hash2}); v != 1 {
		t.Errorf("contract_info after reload: %v", v)
	}
	time.Sleep(600 * time.Millisecond)
	e2eGetJob(t, client, jobURL) // traffic under the new contract
	_, out, _ = pollgate("ops", "show", opID, "--json")
	if err := json.Unmarshal([]byte(out), &shown); err != nil {
		t.Fatal(err)
	}
	if shown.Operation.Budget != extended.Budget || !shown.Operation.DeadlineAt.Equal(extended.DeadlineAt) {
		t.Errorf("reload changed the operation: budget %+v -> %+v, deadline %v -> %v",
			extended.Budget, shown.Operation.Budget, extended.DeadlineAt, shown.Operation.DeadlineAt)
	}
	// An invalid edit is rejected, logged, and the active contract stays.
	if err := os.WriteFile(config, []byte("version: 1\nproviders: nope\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the rejected reload", func() bool {
		return scrapeMetric(t, srv.admin, tok, "pollgate_contract_reloads_total", map[string]string{"outcome": "error"}) == 1
	})
	if h := readyHash(t, srv.admin); h != hash2 {
		t.Errorf("invalid edit replaced the contract: %s", h)
	}
	if !strings.Contains(srv.stderr.String(), "contract reload rejected") {
		t.Errorf("rejection not logged:\n%s", srv.stderr.String())
	}
	close(stopTraffic)
	if bad := <-trafficDone; len(bad) > 0 {
		t.Errorf("traffic during the reloads: %v", bad)
	}

	// The audit export from the running server verifies offline.
	export := filepath.Join(dir, "audit.jsonl")
	if code, _, errs := pollgate("audit", "export", "--out", export); code != 0 {
		t.Fatalf("audit export: %d %s", code, errs)
	}
	if code, out, _ := pollgate("audit", "verify", export); code != 0 || !strings.Contains(out, "every chain intact") {
		t.Errorf("audit verify: %d %s", code, out)
	}
	code, out, _ = pollgate("report")
	if code != 0 || !strings.Contains(out, "e2e") {
		t.Errorf("report: %d %s", code, out)
	}
}

func readyHash(t *testing.T, addr string) string {
	t.Helper()
	_, body := adminGet(t, addr, "", "/readyz")
	var r struct {
		Contract string `json:"contract"`
	}
	json.Unmarshal(body, &r)
	return r.Contract
}
