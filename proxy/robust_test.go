package proxy

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pollgate/audit"
	"pollgate/ledger"
	"pollgate/rules"
)

// R21, R7: 50 agents polling one job at once cause at most one upstream
// request per allowed slot, never two in flight.
func TestFiftyAgentsOneJob(t *testing.T) {
	obs := &recordingObserver{}
	h := newHarness(t, harnessOpts{tls: true, budget: 10, observer: obs})
	h.prov.script("job_c50", answer{code: 200, body: `{"state":"running"}`, delay: 30 * time.Millisecond})
	clients := make([]*http.Client, 50)
	for i := range clients {
		clients[i] = h.newClient() // each agent its own connections
	}
	for slot := 1; slot <= 3; slot++ {
		var wg sync.WaitGroup
		var forwarded, early atomic.Int32
		start := make(chan struct{})
		for i := 0; i < 50; i++ {
			wg.Add(1)
			go func(c *http.Client) {
				defer wg.Done()
				<-start
				req, _ := http.NewRequest("GET", h.base+"/v1/jobs/job_c50", nil)
				req.Header.Set("Authorization", "Bearer k")
				resp, err := c.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				switch resp.Header.Get(HeaderDecision) {
				case DecisionForwarded:
					forwarded.Add(1)
				case DecisionTooEarly:
					early.Add(1)
					if resp.StatusCode != 429 {
						t.Errorf("too_early with %d", resp.StatusCode)
					}
				default:
					t.Errorf("unexpected decision %q (%d)", resp.Header.Get(HeaderDecision), resp.StatusCode)
				}
			}(clients[i])
		}
		close(start)
		wg.Wait()
		if forwarded.Load() != 1 || early.Load() != 49 {
			t.Fatalf("slot %d: forwarded=%d early=%d, want 1 and 49", slot, forwarded.Load(), early.Load())
		}
		if n := h.prov.pollCount("job_c50"); n != slot {
			t.Fatalf("after slot %d the provider saw %d requests", slot, n)
		}
		h.waitForSlot("job_c50")
	}
	if m := h.prov.maxIn.Load(); m != 1 {
		t.Fatalf("provider saw %d concurrent requests, want 1", m)
	}
	if obs.early.Load() != 3*49 {
		t.Fatalf("observer saw %d early polls, want %d", obs.early.Load(), 3*49)
	}
}

// R25: the story of the example in RULES.md, replayed with an injected
// clock (a 40-minute operation in milliseconds): 503 with Retry-After is
// honoured, the budget runs out, the operation escalates.
func TestR25StoryReplay(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true, deadline: "40m", budget: 12})
	// Scale: the R25 schedule with base 5s, max 120s; jitter fixed at 0.8.
	h.contract.Providers[0].Policy.Backoff = rules.Backoff{Base: 5 * time.Second, Max: 120 * time.Second, JitterFloor: 0.5}
	h.proxy.rnd = &lockedRand{r: constRand(0.8)}
	h.prov.fixedJob = "exp_71c"
	h.prov.script("exp_71c", state("queued"), answer{code: 503, body: `{"error":"maintenance"}`, header: map[string]string{"Retry-After": "120"}}, state("running"))
	at := func(hms string) {
		tm, err := time.Parse("15:04:05", hms)
		if err != nil {
			t.Fatal(err)
		}
		c := h.clock.Now()
		h.clock.Set(time.Date(c.Year(), c.Month(), c.Day(), tm.Hour(), tm.Minute(), tm.Second(), 0, time.UTC))
	}
	if g := h.do("POST", "/v1/jobs", `{"export":"all"}`, nil); g.code != 202 {
		t.Fatalf("submit: %d %s", g.code, g.body)
	}
	at("10:20:05")
	if g := h.poll("exp_71c"); g.json["state"] != "queued" {
		t.Fatalf("10:20:05: %s", g.body)
	}
	at("10:20:31")
	g := h.poll("exp_71c")
	if g.code != 503 || g.h.Get("Retry-After") != "120" {
		t.Fatalf("10:20:31: %d Retry-After %q", g.code, g.h.Get("Retry-After"))
	}
	// The agent ignores Retry-After: pollgate answers itself.
	at("10:21:00")
	if g := h.poll("exp_71c"); g.code != 429 {
		t.Fatalf("10:21:00 early poll: %d", g.code)
	}
	for _, hms := range []string{"10:22:31", "10:26:00", "10:30:00", "10:34:00", "10:38:00", "10:42:00", "10:46:00", "10:50:00", "10:56:00", "10:58:00"} {
		at(hms)
		g = h.poll("exp_71c")
	}
	if g.h.Get(HeaderEscalation) != string(rules.ReasonRequestBudgetExhausted) {
		t.Fatalf("10:58:00: %s", g.body)
	}
	st := h.stories("exp_71c")
	want := []string{
		"10:20:00 submitted job exp_71c, deadline 11:00:00, budget 12",
		"10:20:05 polled, state queued, next poll 10:20:14 from local backoff",
		"10:20:31 received 503, Retry-After 120, next poll 10:22:31 from provider guidance",
	}
	for i, w := range want {
		if st[i] != w {
			t.Errorf("story line %d:\n got %q\nwant %q", i+1, st[i], w)
		}
	}
	if last := st[len(st)-1]; last != "10:58:00 polled, state running, request budget exhausted, escalated" {
		t.Errorf("last story line %q", last)
	}
	if t.Failed() {
		t.Logf("story:\n%s", strings.Join(st, "\n"))
	}
	if n := h.prov.pollCount("exp_71c"); n != 12 {
		t.Fatalf("provider saw %d status requests, want 12", n)
	}
}

type constRand float64

func (c constRand) Float64() float64 { return float64(c) }

// flakyStore fails every step with ErrUnavailable while down is set.
type flakyStore struct {
	ledger.Store
	down atomic.Bool
}

func (f *flakyStore) err() error {
	if f.down.Load() {
		return fmt.Errorf("failed to reach redis: %w: connection refused", ledger.ErrUnavailable)
	}
	return nil
}

func (f *flakyStore) Reserve(ctx context.Context, key ledger.Key, holder string, lease time.Duration, now time.Time) (ledger.Reservation, error) {
	if err := f.err(); err != nil {
		return ledger.Reservation{}, err
	}
	return f.Store.Reserve(ctx, key, holder, lease, now)
}

func (f *flakyStore) Create(ctx context.Context, op *rules.Operation, e audit.Entry) (*rules.Operation, bool, error) {
	if err := f.err(); err != nil {
		return nil, false, err
	}
	return f.Store.Create(ctx, op, e)
}

func (f *flakyStore) FindSubmission(ctx context.Context, p, a, fp string) (*rules.Operation, error) {
	if err := f.err(); err != nil {
		return nil, err
	}
	return f.Store.FindSubmission(ctx, p, a, fp)
}

func (f *flakyStore) Get(ctx context.Context, k ledger.Key) (*rules.Operation, error) {
	if err := f.err(); err != nil {
		return nil, err
	}
	return f.Store.Get(ctx, k)
}

// Ledger unavailable: governed calls fail closed with 503 + Retry-After and
// are never forwarded uncounted; tunnelled traffic is unaffected.
func TestLedgerDownFailsClosed(t *testing.T) {
	var fs *flakyStore
	h := newHarness(t, harnessOpts{tls: true, store: func(s ledger.Store) ledger.Store {
		fs = &flakyStore{Store: s}
		return fs
	}})
	other := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "tunnelled")
	}))
	defer other.Close()

	fs.down.Store(true)
	for _, c := range []struct{ method, path, body string }{
		{"GET", "/v1/jobs/job_d", ""},
		{"POST", "/v1/jobs", `{"x":1}`},
		{"GET", "/v1/jobs/job_d/result", ""},
	} {
		g := h.do(c.method, c.path, c.body, nil)
		if g.code != 503 || g.h.Get("Retry-After") == "" || g.json["error"] != "ledger_unavailable" ||
			!strings.Contains(fmt.Sprint(g.json["cause"]), "connection refused") {
			t.Fatalf("%s %s with the ledger down: %d %v %s", c.method, c.path, g.code, g.h, g.body)
		}
	}
	if n := h.prov.pollCount("job_d"); n != 0 {
		t.Fatalf("provider saw %d status requests while the ledger was down", n)
	}
	if n := h.prov.submits.Load(); n != 0 {
		t.Fatalf("provider saw %d submissions while the ledger was down", n)
	}

	// Another port is not a contract host: tunnelled, its own certificate.
	pool := h.ca.Pool()
	pool.AddCert(other.Certificate())
	c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(h.proxyURL), TLSClientConfig: &tls.Config{RootCAs: pool}}}
	resp, err := c.Get(other.URL)
	if err != nil {
		t.Fatalf("tunnel with the ledger down: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "tunnelled" {
		t.Fatalf("tunnel body %q", b)
	}
	if !resp.TLS.PeerCertificates[0].Equal(other.Certificate()) {
		t.Fatal("a non-contract host was MITM'd")
	}

	fs.down.Store(false)
	if g := h.poll("job_d"); g.code != 200 || g.h.Get(HeaderDecision) != DecisionForwarded {
		t.Fatalf("after recovery: %d %s", g.code, g.body)
	}
}

// panicObserver panics once in the governed path.
type panicObserver struct {
	NopObserver
	armed atomic.Bool
}

func (p *panicObserver) Upstream(string, int, time.Duration) {
	if p.armed.CompareAndSwap(true, false) {
		panic("observer exploded")
	}
}

// A panic inside the governed path (and inside the CONNECT handler) does
// not kill the process: the agent gets an answer, the next call works.
func TestPanicDoesNotKillProxy(t *testing.T) {
	obs := &panicObserver{}
	h := newHarness(t, harnessOpts{tls: true, observer: obs})
	obs.armed.Store(true)
	g := h.poll("job_p")
	if g.code != http.StatusBadGateway || g.json["error"] != "internal_error" {
		t.Fatalf("panicking call: %d %s", g.code, g.body)
	}
	if g := h.poll("job_q"); g.code != 200 {
		t.Fatalf("after a panic: %d %s", g.code, g.body)
	}
	// A contract that panics while a CONNECT is handled.
	var boom atomic.Bool
	orig := h.contract
	h.proxy.cfg.Contract = func() *rules.Contract {
		if boom.CompareAndSwap(true, false) {
			panic("contract exploded")
		}
		return orig
	}
	boom.Store(true)
	c := h.newClient()
	if _, err := c.Get(h.base + "/v1/jobs/job_q"); err == nil {
		t.Fatal("CONNECT with a panicking handler succeeded")
	}
	if g := h.poll("job_r"); g.code != 200 {
		t.Fatalf("after a CONNECT panic: %d %s", g.code, g.body)
	}
}

// Upstream TLS is verified: a provider whose certificate the proxy does not
// trust is a transport failure (502), never an unverified request.
func TestUpstreamTLSVerified(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true})
	h.proxy.tr.TLSClientConfig.RootCAs = x509.NewCertPool() // trusts nothing
	g := h.poll("job_v")
	if g.code != http.StatusBadGateway || g.h.Get(HeaderDecision) != DecisionForwarded {
		t.Fatalf("untrusted upstream: %d %s", g.code, g.body)
	}
	if n := h.prov.pollCount("job_v"); n != 0 {
		t.Fatal("request reached an unverified upstream")
	}
	if op := h.op("job_v"); op.Used.TransportFailures != 1 {
		t.Fatalf("transport failures = %d, want 1", op.Used.TransportFailures)
	}
}

// recordingObserver counts what the proxy reports.
type recordingObserver struct {
	NopObserver
	early     atomic.Int32
	escalated atomic.Int32
	governed  sync.Map
}

func (r *recordingObserver) EarlyPoll(string)           { r.early.Add(1) }
func (r *recordingObserver) Escalated(*rules.Operation) { r.escalated.Add(1) }
func (r *recordingObserver) Governed(p string, k rules.Kind, d string) {
	v, _ := r.governed.LoadOrStore(string(k)+"/"+d, new(atomic.Int32))
	v.(*atomic.Int32).Add(1)
}

// coalescingStore implements EarlyPollCounter on top of Reserve (n calls),
// recording how the proxy used it.
type coalescingStore struct {
	ledger.Store
	calls, polls atomic.Int32
}

func (c *coalescingStore) AddEarlyPolls(ctx context.Context, key ledger.Key, n int, now time.Time) error {
	c.calls.Add(1)
	c.polls.Add(int32(n))
	for i := 0; i < n; i++ {
		res, err := c.Store.Reserve(ctx, key, "counter", time.Second, now)
		if err != nil {
			return err
		}
		if res.Outcome != ledger.TooEarly {
			return fmt.Errorf("early-poll count got %s", res.Outcome)
		}
	}
	return nil
}

// With a store that can add several early polls in one step, early polls
// of one job are coalesced, and every one is still counted.
func TestEarlyPollsCoalesced(t *testing.T) {
	var cs *coalescingStore
	h := newHarness(t, harnessOpts{tls: true, store: func(s ledger.Store) ledger.Store {
		cs = &coalescingStore{Store: s}
		return cs
	}})
	h.prov.script("job_co", state("running"))
	h.poll("job_co")
	var wg sync.WaitGroup
	var n atomic.Int32
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := h.newClient()
			for j := 0; j < 10; j++ {
				req, _ := http.NewRequest("GET", h.base+"/v1/jobs/job_co", nil)
				req.Header.Set("Authorization", "Bearer sk-test-secret")
				resp, err := c.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == 429 {
					n.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	h.proxy.gate.drain()
	op := h.op("job_co")
	// The second poll went to the ledger (Reserve counts it); the rest were
	// answered from memory and counted through AddEarlyPolls.
	if op.Used.EarlyPolls != int(n.Load()) {
		t.Fatalf("early polls counted %d, answered %d", op.Used.EarlyPolls, n.Load())
	}
	if cs.polls.Load() == 0 || cs.calls.Load() > cs.polls.Load() {
		t.Fatalf("AddEarlyPolls: %d calls for %d polls", cs.calls.Load(), cs.polls.Load())
	}
	if op.Used.StatusRequests != 1 {
		t.Fatalf("status requests %d, want 1", op.Used.StatusRequests)
	}
}

// A transport error kept in the ledger never carries the request URL (its
// query may hold an API key).
func TestErrTextDropsURL(t *testing.T) {
	_, err := http.Get("http://127.0.0.1:1/v1/jobs/x?key=AIzaSECRET")
	if err == nil {
		t.Skip("port 1 answered")
	}
	if s := errText(err); strings.Contains(s, "AIzaSECRET") || strings.Contains(s, "/v1/jobs") {
		t.Fatalf("errText kept the URL: %q", s)
	}
}

// Hop-by-hop headers (and headers named in Connection) are not forwarded in
// either direction; pollgate's own request header never reaches the provider.
func TestHopByHopStripped(t *testing.T) {
	h := newHarness(t, harnessOpts{tls: true})
	g := h.do("GET", "/echo", "", map[string]string{
		"Connection": "X-Custom", "X-Custom": "v", "Keep-Alive": "300", "Te": "trailers",
		"Pollgate-Operation": "op-x", "X-Keep": "yes",
	})
	if g.code != 200 {
		t.Fatalf("echo: %d", g.code)
	}
	if string(g.body) != `["X-Keep"]` {
		t.Fatalf("provider saw %s, want only X-Keep", g.body)
	}
	if g.h.Get("X-Hop") != "" || g.h.Get("Keep-Alive") != "" || g.h.Get("X-End") != "kept" {
		t.Fatalf("response headers: %v", g.h)
	}
}
