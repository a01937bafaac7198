package proxy

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pollgate/audit"
	"pollgate/ca"
	"pollgate/ledger"
	"pollgate/rules"
)

// fakeClock is the injected clock of the proxy under test.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 3, 2, 10, 20, 0, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if t.After(c.now) {
		c.now = t
	}
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// answer is one scripted provider response.
type answer struct {
	code   int
	body   string
	header map[string]string
	hangup bool // close the connection without an answer (transport error)
	gzip   bool
	delay  time.Duration
}

func state(s string) answer {
	return answer{code: 200, body: fmt.Sprintf(`{"job_id":"%%s","state":%q}`, s)}
}

func succeeded() answer {
	return answer{code: 200, body: `{"job_id":"%s","state":"succeeded","result_url":"https://files.example/r.json"}`}
}

// fakeProvider is a scripted async-job API: POST /v1/jobs submits,
// GET /v1/jobs/{id} answers from the job's script (the last answer repeats),
// GET /v1/jobs/{id}/result and POST /v1/jobs/{id}/cancel are actions.
type fakeProvider struct {
	srv *httptest.Server

	mu       sync.Mutex
	scripts  map[string][]answer
	polls    map[string]int
	actions  []string
	inFlight atomic.Int32
	maxIn    atomic.Int32
	submits  atomic.Int32
	nextJob  atomic.Int32
	authSeen []string
	fixedJob string // job id for the next submission, "" = job_<n>
}

func newFakeProvider(t *testing.T, useTLS bool) *fakeProvider {
	f := &fakeProvider{scripts: map[string][]answer{}, polls: map[string]int{}}
	h := http.HandlerFunc(f.serve)
	if useTLS {
		f.srv = httptest.NewTLSServer(h)
	} else {
		f.srv = httptest.NewServer(h)
	}
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeProvider) script(job string, answers ...answer) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.scripts[job] = answers
}

func (f *fakeProvider) pollCount(job string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.polls[job]
}

func (f *fakeProvider) serve(w http.ResponseWriter, r *http.Request) {
	n := f.inFlight.Add(1)
	defer f.inFlight.Add(-1)
	for {
		m := f.maxIn.Load()
		if n <= m || f.maxIn.CompareAndSwap(m, n) {
			break
		}
	}
	f.mu.Lock()
	f.authSeen = append(f.authSeen, r.Header.Get("Authorization"))
	f.mu.Unlock()
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	switch {
	case r.Method == "POST" && r.URL.Path == "/v1/jobs":
		f.submits.Add(1)
		io.Copy(io.Discard, r.Body)
		id := fmt.Sprintf("job_%d", f.nextJob.Add(1))
		if f.fixedJob != "" {
			id = f.fixedJob
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusAccepted)
		fmt.Fprintf(w, `{"job_id":%q,"state":"queued"}`, id)
	case r.Method == "GET" && len(parts) == 3 && parts[0] == "v1" && parts[1] == "jobs":
		job := parts[2]
		f.mu.Lock()
		sc := f.scripts[job]
		i := f.polls[job]
		f.polls[job]++
		f.mu.Unlock()
		a := state("running")
		if len(sc) > 0 {
			a = sc[min(i, len(sc)-1)]
		}
		f.write(w, job, a)
	case r.Method == "GET" && len(parts) == 4 && parts[3] == "result":
		f.mu.Lock()
		f.actions = append(f.actions, "result "+parts[2])
		f.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"job_id":%q,"output":"the result"}`, parts[2])
	case r.URL.Path == "/echo":
		var seen []string
		for _, k := range []string{"Connection", "X-Custom", "Keep-Alive", "Proxy-Authorization", "Pollgate-Operation", "Te", "X-Keep"} {
			if r.Header.Get(k) != "" {
				seen = append(seen, k)
			}
		}
		w.Header().Set("Connection", "X-Hop")
		w.Header().Set("X-Hop", "1")
		w.Header().Set("Keep-Alive", "timeout=5")
		w.Header().Set("X-End", "kept")
		fmt.Fprintf(w, "%q", seen)
	case r.Method == "GET" && len(parts) == 2 && parts[0] == "files":
		f.mu.Lock()
		f.actions = append(f.actions, "file "+parts[1])
		f.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"file":%q}`, parts[1])
	case r.Method == "POST" && len(parts) == 4 && parts[3] == "cancel":
		f.mu.Lock()
		f.actions = append(f.actions, "cancel "+parts[2])
		f.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"job_id":%q,"state":"cancelled"}`, parts[2])
	default:
		http.NotFound(w, r)
	}
}

func (f *fakeProvider) write(w http.ResponseWriter, job string, a answer) {
	if a.delay > 0 {
		time.Sleep(a.delay)
	}
	if a.hangup {
		hj, ok := w.(http.Hijacker)
		if ok {
			c, _, err := hj.Hijack()
			if err == nil {
				c.Close()
				return
			}
		}
		panic(http.ErrAbortHandler)
	}
	body := a.body
	if strings.Contains(body, "%s") {
		body = fmt.Sprintf(body, job)
	}
	for k, v := range a.header {
		w.Header().Set(k, v)
	}
	if w.Header().Get("Content-Type") == "" {
		w.Header().Set("Content-Type", "application/json")
	}
	w.Header().Set("X-Request-Id", "req-"+job)
	if a.gzip {
		var buf bytes.Buffer
		zw := newGzip(&buf)
		zw.Write([]byte(body))
		zw.Close()
		w.Header().Set("Content-Encoding", "gzip")
		w.WriteHeader(a.code)
		w.Write(buf.Bytes())
		return
	}
	w.WriteHeader(a.code)
	io.WriteString(w, body)
}

const testContract = `version: 1
defaults:
  policy:
    deadline: %s
    max_status_requests: %d
    max_transport_failures: 2
    max_rate_limited: 2
    backoff: {base: 500ms, max: 2s, jitter_floor: 0.5}
    not_found_grace: 1s
    lease: 5s
    extension: {duration: 10s, status_requests: 2, max_extensions: 1}
providers:
  - name: fake
    base_url: %s
    account_header: Authorization
    submit:
      request: POST /v1/jobs
      job_id: job_id
      idempotency_header: Idempotency-Key
    status:
      request: GET /v1/jobs/{job_id}
      state: state
      states:
        waiting: [queued, running]
        success: [succeeded]
        failure: [failed]
        cancelled: [cancelled]
        expired: [expired]
      success_requires: [result_url]
      hints:
        poll_after_seconds: poll_after_seconds
        expires_at: expires_at
      error: error
      request_id_header: X-Request-Id
    result:
      request: GET /v1/jobs/{job_id}/result
    cancel:
      request: POST /v1/jobs/{job_id}/cancel
    escalation:
      status_code: 200
      state_value: failed
`

type harnessOpts struct {
	tls      bool
	deadline string
	budget   int
	store    func(ledger.Store) ledger.Store // wraps the bbolt store (fault injection)
	observer Observer
	maxBody  int64
	edit     func(contract string) string // changes the test contract text
}

// harness is a fake provider, a bbolt ledger, the proxy on 127.0.0.1:0 and
// an agent client that trusts only the test CA.
type harness struct {
	t        *testing.T
	prov     *fakeProvider
	clock    *fakeClock
	store    ledger.Store
	bolt     *ledger.BoltStore
	ca       *ca.Authority
	proxy    *Proxy
	proxyURL *url.URL
	client   *http.Client
	contract *rules.Contract
	base     string
}

func newHarness(t *testing.T, o harnessOpts) *harness {
	t.Helper()
	if o.deadline == "" {
		o.deadline = "30s"
	}
	if o.budget == 0 {
		o.budget = 6
	}
	h := &harness{t: t, clock: newClock()}
	h.prov = newFakeProvider(t, o.tls)
	h.base = h.prov.srv.URL
	text := fmt.Sprintf(testContract, o.deadline, o.budget, h.base)
	if o.edit != nil {
		text = o.edit(text)
	}
	c, err := rules.Parse("providers.yaml", []byte(text))
	if err != nil {
		t.Fatalf("test contract: %v", err)
	}
	h.contract = c
	b, err := ledger.OpenBolt(t.TempDir(), ledger.BoltOptions{NoSync: true, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	h.bolt = b
	h.store = b
	if o.store != nil {
		h.store = o.store(b)
	}
	h.ca, err = ca.New(ca.Options{})
	if err != nil {
		t.Fatal(err)
	}
	var roots *x509.CertPool
	if o.tls {
		roots = x509.NewCertPool()
		roots.AddCert(h.prov.srv.Certificate())
	}
	p, err := New(Config{
		Contract:      func() *rules.Contract { return h.contract },
		Store:         h.store,
		CA:            h.ca,
		UpstreamRoots: roots,
		Now:           h.clock.Now,
		Rand:          rand.New(rand.NewPCG(1, 2)),
		Logger:        quietLogger(),
		Observer:      o.observer,
		MaxBody:       o.maxBody,
		AccountKey:    []byte("0123456789abcdef0123456789abcdef"),
		HolderID:      "test",
		IdleTimeout:   30 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	h.proxy = p
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: p.Handler(), ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(p.WrapListener(ln))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		p.Close()
	})
	h.proxyURL, _ = url.Parse("http://" + ln.Addr().String())
	h.client = h.newClient()
	return h
}

func (h *harness) newClient() *http.Client {
	return &http.Client{
		Transport: &http.Transport{
			Proxy:               http.ProxyURL(h.proxyURL),
			TLSClientConfig:     &tls.Config{RootCAs: h.ca.Pool()},
			MaxIdleConnsPerHost: 64,
		},
		Timeout: 20 * time.Second,
	}
}

func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// got is a decoded agent-side answer.
type got struct {
	code int
	h    http.Header
	body []byte
	json map[string]any
	tls  *tls.ConnectionState
}

func (g got) pg(key string) any {
	m, _ := g.json["pollgate"].(map[string]any)
	return m[key]
}

func (h *harness) do(method, path string, body string, hdr map[string]string) got {
	h.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, h.base+path, rd)
	if err != nil {
		h.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer sk-test-secret")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := h.client.Do(req)
	if err != nil {
		h.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		h.t.Fatal(err)
	}
	g := got{code: resp.StatusCode, h: resp.Header, body: b, tls: resp.TLS}
	_ = json.Unmarshal(b, &g.json)
	return g
}

func (h *harness) poll(job string) got {
	h.t.Helper()
	return h.do("GET", "/v1/jobs/"+job, "", nil)
}

// op returns the stored record of a job.
func (h *harness) op(job string) *rules.Operation {
	h.t.Helper()
	page, err := h.bolt.List(context.Background(), ledger.Filter{})
	if err != nil {
		h.t.Fatal(err)
	}
	for _, op := range page.Operations {
		if op.JobID == job {
			return op
		}
	}
	h.t.Fatalf("no record for job %s", job)
	return nil
}

// waitForSlot moves the clock to the job's next allowed poll.
func (h *harness) waitForSlot(job string) {
	h.t.Helper()
	op := h.op(job)
	if !op.NextPollAt.IsZero() {
		h.clock.Set(op.NextPollAt)
	}
}

func (h *harness) stories(job string) []string {
	h.t.Helper()
	op := h.op(job)
	envs, err := h.bolt.Audit(context.Background(), op.ID)
	if err != nil {
		h.t.Fatal(err)
	}
	var out []string
	for _, env := range envs {
		e, err := audit.DecodeEntry(env, nil)
		if err != nil {
			h.t.Fatal(err)
		}
		out = append(out, e.Time.UTC().Format("15:04:05")+" "+e.Story)
	}
	return out
}

func newGzip(w io.Writer) *gzip.Writer { return gzip.NewWriter(w) }
