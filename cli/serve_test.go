package cli

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"pollgate/ledger"
	"pollgate/rules"
)

// These tests drive the real pollgate binary (go build into t.TempDir())
// with real clients, over real sockets, against a scripted TLS provider.

// e2eStrictSkip skips, or fails when POLLGATE_TEST_STRICT=1 (CI).
func e2eStrictSkip(t *testing.T, format string, a ...any) {
	t.Helper()
	if os.Getenv("POLLGATE_TEST_STRICT") == "1" {
		t.Fatalf("POLLGATE_TEST_STRICT=1: "+format, a...)
	}
	t.Skipf(format, a...)
}

var (
	e2eBuildOnce sync.Once
	e2eBuildDir  string
	e2eBuildErr  error
)

// e2ePollgateBinary builds the pollgate binary once per test process.
func e2ePollgateBinary(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and runs the pollgate binary; skipped in -short mode")
	}
	e2eBuildOnce.Do(func() {
		// One fixed directory, rebuilt by every test run (no temp dirs left behind).
		e2eBuildDir = filepath.Join(os.TempDir(), "pollgate-e2e-bin")
		if e2eBuildErr = os.MkdirAll(e2eBuildDir, 0o755); e2eBuildErr != nil {
			return
		}
		cmd := exec.Command("go", "build", "-o", filepath.Join(e2eBuildDir, "pollgate"), ".")
		cmd.Dir = ".."
		out, err := cmd.CombinedOutput()
		if err != nil {
			e2eBuildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if e2eBuildErr != nil {
		t.Fatal(e2eBuildErr)
	}
	return filepath.Join(e2eBuildDir, "pollgate")
}

// e2eProvider is a scripted async-job API with TLS from its own test CA.
type e2eProvider struct {
	URL    string
	CAFile string
	host   string

	mu      sync.Mutex
	polls   map[string]int
	delay   map[string]time.Duration // per job, on every poll
	state   map[string]string        // per job, default "running"
	inFlite int
	maxIn   int
}

// e2eProviderHost returns a non-loopback address of this machine (Go clients
// never proxy loopback, CRAFT.md), else 127.0.0.1.
func e2eProviderHost() (string, bool) {
	addrs, err := net.InterfaceAddrs()
	if err == nil {
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.IsLoopback() && !ipn.IP.IsLinkLocalUnicast() {
				return ipn.IP.String(), true
			}
		}
	}
	return "127.0.0.1", false
}

func newE2EProvider(t *testing.T) *e2eProvider {
	t.Helper()
	host, _ := e2eProviderHost()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "e2e provider CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: host},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP(host), net.ParseIP("127.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	p := &e2eProvider{host: host, polls: map[string]int{}, delay: map[string]time.Duration{}, state: map[string]string{}}
	p.CAFile = filepath.Join(t.TempDir(), "provider-ca.pem")
	if err := os.WriteFile(p.CAFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o644); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(p.serve), TLSConfig: &tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}}
	go srv.ServeTLS(ln, "", "")
	t.Cleanup(func() { srv.Close() })
	p.URL = "https://" + ln.Addr().String()
	return p
}

func (p *e2eProvider) serve(w http.ResponseWriter, r *http.Request) {
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	w.Header().Set("Content-Type", "application/json")
	if r.Method == "POST" && r.URL.Path == "/v1/jobs" {
		w.WriteHeader(http.StatusAccepted)
		io.WriteString(w, `{"job_id":"job_sub","state":"queued"}`)
		return
	}
	if r.Method != "GET" || len(parts) != 3 {
		http.NotFound(w, r)
		return
	}
	job := parts[2]
	p.mu.Lock()
	p.polls[job]++
	p.inFlite++
	p.maxIn = max(p.maxIn, p.inFlite)
	d, st := p.delay[job], p.state[job]
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		p.inFlite--
		p.mu.Unlock()
	}()
	if st == "" {
		st = "running"
	}
	if d > 0 {
		time.Sleep(d)
	}
	fmt.Fprintf(w, `{"job_id":%q,"state":%q}`, job, st)
}

func (p *e2eProvider) pollCount(job string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.polls[job]
}

const e2eContract = `version: 1
defaults:
  policy:
    deadline: %s
    max_status_requests: %d
    backoff: {base: 500ms, max: 1s, jitter_floor: 0.5}
    lease: 2s
providers:
  - name: e2e
    base_url: %s
    account_header: Authorization
    submit:
      request: POST /v1/jobs
      job_id: job_id
    status:
      request: GET /v1/jobs/{job_id}
      state: state
      states:
        waiting: [queued, running]
        success: [succeeded]
        failure: [failed]
        cancelled: [cancelled]
        expired: [expired]
    escalation:
      state_value: failed
`

// e2eServer is one running `pollgate serve` process.
type e2eServer struct {
	cmd    *exec.Cmd
	listen string
	admin  string
	stderr *e2eBuffer
	done   chan error
}

type e2eBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *e2eBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *e2eBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

var e2eSummaryRE = regexp.MustCompile(`proxy on (\S+), admin on (\S+),`)

// e2eStartServe runs `pollgate serve` on free ports and waits for its summary line.
func e2eStartServe(t *testing.T, bin, config, data, upstreamCA string, extraEnv ...string) *e2eServer {
	t.Helper()
	cmd := exec.Command(bin, "serve", "--config", config, "--data", data, "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--upstream-ca", upstreamCA)
	if u := e2eRedisURL; u != "" {
		cmd.Args = append(cmd.Args, "--redis", u)
	}
	cmd.Env = append(e2eBaseEnv(), extraEnv...)
	pr, pw := io.Pipe()
	s := &e2eServer{cmd: cmd, stderr: &e2eBuffer{}, done: make(chan error, 1)}
	cmd.Stderr = io.MultiWriter(pw, s.stderr)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { s.done <- cmd.Wait(); pw.Close() }()
	found := make(chan []string, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			if m := e2eSummaryRE.FindStringSubmatch(sc.Text()); m != nil {
				found <- m
				break
			}
		}
		io.Copy(io.Discard, pr)
	}()
	select {
	case m := <-found:
		s.listen, s.admin = m[1], m[2]
	case err := <-s.done:
		t.Fatalf("pollgate serve exited: %v\n%s", err, s.stderr.String())
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		t.Fatalf("pollgate serve did not start:\n%s", s.stderr.String())
	}
	t.Cleanup(func() {
		if s.cmd.ProcessState == nil {
			s.cmd.Process.Kill()
			<-s.done
		}
	})
	return s
}

// e2eBaseEnv is a clean environment for children: no proxy or CA variables
// from the machine running the tests.
func e2eBaseEnv() []string {
	var env []string
	for _, k := range []string{"PATH", "HOME", "GOCACHE", "GOPATH", "GOMODCACHE", "GOFLAGS", "TMPDIR", "LANG"} {
		if v := os.Getenv(k); v != "" {
			env = append(env, k+"="+v)
		}
	}
	return env
}

// e2eAgentEnv runs `pollgate env` and returns its exports as KEY=VALUE.
func e2eAgentEnv(t *testing.T, bin, data, listen string) []string {
	t.Helper()
	cmd := exec.Command(bin, "env", "--data", data, "--listen", listen)
	cmd.Env = e2eBaseEnv()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("pollgate env: %v", err)
	}
	var env []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		kv, ok := strings.CutPrefix(line, "export ")
		if !ok {
			t.Fatalf("pollgate env printed %q", line)
		}
		k, v, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(v, "'") {
			v = strings.ReplaceAll(strings.Trim(v, "'"), `'\''`, "'")
		}
		env = append(env, k+"="+v)
	}
	return env
}

type e2eSetup struct {
	bin, config, data string
	prov              *e2eProvider
	srv               *e2eServer
}

func setupE2E(t *testing.T, deadline string, budget int) *e2eSetup {
	t.Helper()
	bin := e2ePollgateBinary(t)
	prov := newE2EProvider(t)
	dir := t.TempDir()
	config := filepath.Join(dir, "providers.yaml")
	if err := os.WriteFile(config, []byte(fmt.Sprintf(e2eContract, deadline, budget, prov.URL)), 0o644); err != nil {
		t.Fatal(err)
	}
	data := filepath.Join(dir, "data")
	s := &e2eSetup{bin: bin, config: config, data: data, prov: prov}
	// A proxy started from an agent's shell inherits its proxy variables:
	// pollgate must ignore them (no self-loop, CRAFT.md). These point nowhere.
	s.srv = e2eStartServe(t, bin, config, data, prov.CAFile, "HTTPS_PROXY=http://127.0.0.1:9", "HTTP_PROXY=http://127.0.0.1:9", "https_proxy=http://127.0.0.1:9")
	return s
}

// e2eCheckEscalation verifies what a naive loop printed when it ended.
func e2eCheckEscalation(t *testing.T, out []byte, reason rules.Reason) {
	t.Helper()
	var body struct {
		State    string `json:"state"`
		Pollgate struct {
			Escalated bool   `json:"escalated"`
			Reason    string `json:"reason"`
		} `json:"pollgate"`
	}
	line := bytes.TrimSpace(out)
	if i := bytes.LastIndexByte(line, '\n'); i >= 0 {
		line = line[i+1:]
	}
	if err := json.Unmarshal(line, &body); err != nil {
		t.Fatalf("loop output is not the escalation body: %v\n%s", err, out)
	}
	if body.State != "failed" || !body.Pollgate.Escalated || body.Pollgate.Reason != string(reason) {
		t.Fatalf("loop ended on %s", line)
	}
}

// A naive curl loop (HTTPS via MITM, CURL_CA_BUNDLE) ends because of the
// escalation body; the provider sees no more requests than the budget.
func TestCurlNaiveLoop(t *testing.T) {
	curl, err := exec.LookPath("curl")
	if err != nil {
		e2eStrictSkip(t, "curl not installed (apt-get install curl)")
	}
	s := setupE2E(t, "30s", 3)
	script := `for i in $(seq 1 300); do
  out=$(curl -sS --max-time 5 -H 'Authorization: Bearer sk-curl' "$URL")
  case "$out" in *'"state":"failed"'*) echo "$out"; exit 0;; esac
  sleep 0.05
done
echo "loop did not end: $out"; exit 1`
	cmd := exec.Command("sh", "-c", script)
	cmd.Env = append(append(e2eBaseEnv(), e2eAgentEnv(t, s.bin, s.data, s.srv.listen)...), "URL="+s.prov.URL+"/v1/jobs/job_curl", "CURL="+curl)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("curl loop: %v\n%s\nserver:\n%s", err, out, s.srv.stderr.String())
	}
	e2eCheckEscalation(t, out, rules.ReasonRequestBudgetExhausted)
	if n := s.prov.pollCount("job_curl"); n > 3 {
		t.Fatalf("provider saw %d polls, budget 3", n)
	}
}

// A naive Python requests loop (REQUESTS_CA_BUNDLE) ends because of the
// escalation body.
func TestPythonRequestsNaiveLoop(t *testing.T) {
	py := os.Getenv("POLLGATE_TEST_PYTHON")
	if py == "" {
		py = "/usr/bin/python3"
	}
	if err := exec.Command(py, "-c", "import requests").Run(); err != nil {
		e2eStrictSkip(t, "%s cannot import requests (apt-get install python3-requests): %v", py, err)
	}
	s := setupE2E(t, "30s", 3)
	script := `import os, sys, time, requests
url = os.environ["URL"]
for i in range(300):
    r = requests.get(url, headers={"Authorization": "Bearer sk-py"}, timeout=5)
    try:
        body = r.json()
    except ValueError:
        body = {}
    if body.get("state") in ("succeeded", "failed", "cancelled", "expired"):
        print(r.text.strip())
        sys.exit(0)
    time.sleep(0.05)
print("loop did not end")
sys.exit(1)
`
	cmd := exec.Command(py, "-c", script)
	cmd.Env = append(append(e2eBaseEnv(), e2eAgentEnv(t, s.bin, s.data, s.srv.listen)...), "URL="+s.prov.URL+"/v1/jobs/job_py")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python loop: %v\n%s", err, out)
	}
	e2eCheckEscalation(t, out, rules.ReasonRequestBudgetExhausted)
	if n := s.prov.pollCount("job_py"); n > 3 {
		t.Fatalf("provider saw %d polls, budget 3", n)
	}
}

const e2eGoAgent = `package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

func main() {
	for i := 0; i < 300; i++ {
		req, _ := http.NewRequest("GET", os.Getenv("URL"), nil)
		req.Header.Set("Authorization", "Bearer sk-go")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var body struct{ State string ` + "`json:\"state\"`" + ` }
		json.Unmarshal(b, &body)
		switch body.State {
		case "succeeded", "failed", "cancelled", "expired":
			fmt.Println(string(b))
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	fmt.Println("loop did not end")
	os.Exit(1)
}
`

// A naive Go net/http loop (HTTPS_PROXY + SSL_CERT_FILE, default client)
// ends because of the escalation body.
func TestGoNetHTTPNaiveLoop(t *testing.T) {
	if _, nonLoopback := e2eProviderHost(); !nonLoopback {
		e2eStrictSkip(t, "no non-loopback address: Go's default client never proxies loopback")
	}
	s := setupE2E(t, "30s", 3)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(e2eGoAgent), 0o644); err != nil {
		t.Fatal(err)
	}
	agent := filepath.Join(dir, "agent")
	build := exec.Command("go", "build", "-o", agent, "main.go")
	build.Dir = dir
	build.Env = append(e2eBaseEnv(), "GO111MODULE=off")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build agent: %v\n%s", err, out)
	}
	cmd := exec.Command(agent)
	cmd.Env = append(append(e2eBaseEnv(), e2eAgentEnv(t, s.bin, s.data, s.srv.listen)...), "URL="+s.prov.URL+"/v1/jobs/job_go")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go loop: %v\n%s", err, out)
	}
	e2eCheckEscalation(t, out, rules.ReasonRequestBudgetExhausted)
	if n := s.prov.pollCount("job_go"); n > 3 {
		t.Fatalf("provider saw %d polls, budget 3", n)
	}
}

// e2eClient is an agent client that trusts only the data directory's CA.
func e2eClient(t *testing.T, data, listen string) *http.Client {
	t.Helper()
	pemBytes, err := os.ReadFile(filepath.Join(data, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pemBytes)
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		Proxy:           http.ProxyURL(&url.URL{Scheme: "http", Host: listen}),
		TLSClientConfig: &tls.Config{RootCAs: pool},
	}}
}

func e2eGetJob(t *testing.T, c *http.Client, u string) (*http.Response, map[string]any) {
	t.Helper()
	req, _ := http.NewRequest("GET", u, nil)
	req.Header.Set("Authorization", "Bearer sk-restart")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	defer resp.Body.Close()
	var m map[string]any
	b, _ := io.ReadAll(resp.Body)
	json.Unmarshal(b, &m)
	return resp, m
}

// e2eReadOp opens the stopped proxy's ledger and returns the job's record.
func e2eReadOp(t *testing.T, data, job string) *rules.Operation {
	t.Helper()
	st, err := ledger.OpenBolt(data, ledger.BoltOptions{LockTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	page, err := st.List(context.Background(), ledger.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	for _, op := range page.Operations {
		if op.JobID == job {
			return op
		}
	}
	t.Fatalf("no record for %s", job)
	return nil
}

// R11, R21, R22: kill -9 the proxy while a poll is in flight, start it again on
// the same data directory: the reserved request stays counted, the deadline
// stays, and counting continues where it stopped.
func TestRestartKeepsCounters(t *testing.T) {
	s := setupE2E(t, "60s", 10)
	u := s.prov.URL + "/v1/jobs/job_rs"
	c := e2eClient(t, s.data, s.srv.listen)
	resp, _ := e2eGetJob(t, c, u)
	if resp.Header.Get("Pollgate-Requests") != "1/10" {
		t.Fatalf("first poll: %s %v", resp.Status, resp.Header)
	}
	// The next poll hangs at the provider; kill -9 while it is in flight.
	s.prov.mu.Lock()
	s.prov.delay["job_rs"] = 5 * time.Second
	s.prov.mu.Unlock()
	time.Sleep(1100 * time.Millisecond) // past the backoff slot (<= 1s)
	go func() {
		req, _ := http.NewRequest("GET", u, nil)
		req.Header.Set("Authorization", "Bearer sk-restart")
		if resp, err := c.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	deadline := time.Now().Add(5 * time.Second)
	for s.prov.pollCount("job_rs") < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if s.prov.pollCount("job_rs") < 2 {
		t.Fatal("second poll never reached the provider")
	}
	if err := s.srv.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-s.srv.done
	before := e2eReadOp(t, s.data, "job_rs")
	if before.Used.StatusRequests != 2 || before.Lease.ExpiresAt.IsZero() {
		t.Fatalf("after kill -9: used=%d lease=%+v (R9: reserved before sending)", before.Used.StatusRequests, before.Lease)
	}
	s.prov.mu.Lock()
	s.prov.delay["job_rs"] = 0
	s.prov.mu.Unlock()

	s.srv = e2eStartServe(t, s.bin, s.config, s.data, s.prov.CAFile)
	c = e2eClient(t, s.data, s.srv.listen)
	// The dead process's lease blocks the job until it expires (2s).
	var got string
	for i := 0; i < 60; i++ {
		resp, _ := e2eGetJob(t, c, u)
		if resp.Header.Get("Pollgate-Decision") == "forwarded" {
			got = resp.Header.Get("Pollgate-Requests")
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if got != "3/10" {
		t.Fatalf("after restart Pollgate-Requests = %q, want 3/10 (R11: counters never reset)", got)
	}
	if err := s.srv.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-s.srv.done:
		if err != nil {
			t.Fatalf("graceful shutdown: %v\n%s", err, s.srv.stderr.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("no graceful shutdown on SIGTERM")
	}
	after := e2eReadOp(t, s.data, "job_rs")
	if !after.DeadlineAt.Equal(before.DeadlineAt) || !after.StartedAt.Equal(before.StartedAt) || after.ID != before.ID {
		t.Fatalf("record changed identity/deadline across restart: before %v %v, after %v %v",
			before.StartedAt, before.DeadlineAt, after.StartedAt, after.DeadlineAt)
	}
	if after.Used.StatusRequests != 3 {
		t.Fatalf("used = %d, want 3", after.Used.StatusRequests)
	}
}

// e2eRedisURL, when set, makes e2eStartServe use the Redis ledger.
var e2eRedisURL string

// The same governed flow on the Redis ledger (a real redis-server in CI).
func TestServeWithRedis(t *testing.T) {
	u := os.Getenv("POLLGATE_TEST_REDIS_URL")
	if u == "" {
		e2eStrictSkip(t, "POLLGATE_TEST_REDIS_URL not set (CI starts a redis-server)")
	}
	e2eRedisURL = u
	defer func() { e2eRedisURL = "" }()
	s := setupE2E(t, "30s", 2)
	rz, err := http.Get("http://" + s.srv.admin + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	var ready map[string]any
	json.NewDecoder(rz.Body).Decode(&ready)
	rz.Body.Close()
	if ready["ledger"] != "redis" || ready["ready"] != true {
		t.Fatalf("/readyz on Redis: %v", ready)
	}
	c := e2eClient(t, s.data, s.srv.listen)
	jobURL := s.prov.URL + "/v1/jobs/job_redis"
	resp, _ := e2eGetJob(t, c, jobURL)
	if resp.StatusCode != 200 || resp.Header.Get("Pollgate-Decision") != "forwarded" {
		t.Fatalf("first poll: %d %v", resp.StatusCode, resp.Header)
	}
	resp, body := e2eGetJob(t, c, jobURL)
	if resp.StatusCode != 429 || body["error"] != "too_early" {
		t.Fatalf("early poll: %d %v", resp.StatusCode, body)
	}
	var last map[string]any
	for i := 0; i < 50; i++ {
		time.Sleep(200 * time.Millisecond)
		resp, last = e2eGetJob(t, c, jobURL)
		if resp.Header.Get("Pollgate-Decision") == "escalated" {
			break
		}
	}
	if pg, _ := last["pollgate"].(map[string]any); last["state"] != "failed" || pg["reason"] != "request_budget_exhausted" {
		t.Fatalf("no escalation on Redis: %v", last)
	}
	if n := s.prov.pollCount("job_redis"); n != 2 {
		t.Fatalf("provider saw %d polls, budget 2", n)
	}
}

// The admin listener: health endpoints open, everything else behind the token.
func TestServeAdminAndFiles(t *testing.T) {
	s := setupE2E(t, "30s", 3)
	for _, f := range []string{"ca.pem", "ca-key.pem", "bundle.pem", "admin.token", "account.key", "ledger.db"} {
		fi, err := os.Stat(filepath.Join(s.data, f))
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if (f == "ca-key.pem" || f == "admin.token" || f == "account.key") && fi.Mode().Perm()&0o077 != 0 {
			t.Fatalf("%s has mode %04o", f, fi.Mode().Perm())
		}
	}
	get := func(path, token string) (int, map[string]any) {
		req, _ := http.NewRequest("GET", "http://"+s.srv.admin+path, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var m map[string]any
		json.NewDecoder(resp.Body).Decode(&m)
		return resp.StatusCode, m
	}
	if code, _ := get("/healthz", ""); code != 200 {
		t.Fatalf("/healthz: %d", code)
	}
	code, m := get("/readyz", "")
	if code != 200 || m["ready"] != true || m["contract"] == "" {
		t.Fatalf("/readyz: %d %v", code, m)
	}
	if code, m := get("/api/operations", ""); code != 401 || m["error"] != "unauthorized" {
		t.Fatalf("admin API without token: %d %v", code, m)
	}
	if code, _ := get("/api/operations", "wrong"); code != 401 {
		t.Fatalf("admin API with a wrong token: %d", code)
	}
	tok, _ := os.ReadFile(filepath.Join(s.data, "admin.token"))
	if code, _ := get("/api/nonexistent-path", strings.TrimSpace(string(tok))); code == 401 {
		t.Fatal("the right token was refused")
	}
	// The proxy refuses to forward to its own admin listener.
	c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: s.srv.listen})}}
	resp, err := c.Get("http://" + s.srv.admin + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Fatalf("proxying to the admin listener: %d, want 403", resp.StatusCode)
	}
}
