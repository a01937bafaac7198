// Command bench compares, on loopback and in one run, the throughput and
// latency of status calls made by the same keep-alive client:
//
//   - direct:    client -> provider (TLS), no proxy
//   - bare-mitm: client -> goproxy MITM passthrough (own ECDSA CA, leaf
//     cache, tuned upstream transport) -> provider
//   - governed:  client -> pollgate (MITM + ledger reserve/complete with
//     the bbolt ledger, fsync on) -> provider; every call forwarded
//   - early-429: client -> pollgate answering early polls itself (429 +
//     Retry-After); the provider is never contacted
//
// at 16 and 64 concurrent connections. It is run by hand, not in CI:
//
//	go run ./bench -duration 5s -conns 16,64
//
// See bench/README.md for results.
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elazarl/goproxy"

	"pollgate/ca"
	"pollgate/ledger"
	"pollgate/proxy"
	"pollgate/rules"
)

func main() {
	duration := flag.Duration("duration", 5*time.Second, "measurement time per mode and connection count")
	warmup := flag.Duration("warmup", time.Second, "warm-up time per run (not measured)")
	connsFlag := flag.String("conns", "16,64", "comma-separated connection counts")
	jobs := flag.Int("jobs", 200, "distinct jobs per connection in the governed mode")
	noSync := flag.Bool("nosync", false, "bbolt without fsync (not crash-safe; for comparison only)")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	flag.StringVar(&onlyMode, "mode", "", "run only this mode (direct, bare-mitm, governed, early-429)")
	flag.Parse()
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fmt.Fprintf(os.Stderr, "bench: %v\n", err)
			os.Exit(1)
		}
		pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	var conns []int
	for _, s := range strings.Split(*connsFlag, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "bench: bad -conns %q\n", *connsFlag)
			os.Exit(2)
		}
		conns = append(conns, n)
	}
	if err := run(*duration, *warmup, conns, *jobs, *noSync); err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		pprof.StopCPUProfile()
		os.Exit(1)
	}
}

var onlyMode string

// lastStores are the ledgers of the current governed proxies, by backoff.
var lastStores = map[string]*ledger.BoltStore{}

func storeFor(mode string) *ledger.BoltStore {
	switch mode {
	case "governed":
		return lastStores["1ms"]
	case "early-429":
		return lastStores["1h"]
	}
	return nil
}

type result struct {
	mode  string
	conns int
	reqs  int64
	errs  int64
	dur   time.Duration
	p50   time.Duration
	p99   time.Duration
	codes map[int]int64
}

func run(d, warmup time.Duration, conns []int, jobsPerConn int, noSync bool) error {
	up, upCA, err := startProvider()
	if err != nil {
		return err
	}
	defer up.Close()
	upURL := "https://" + up.Addr().String()
	authority, err := ca.New(ca.Options{})
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	roots.AddCert(upCA)

	bare, err := startBareMITM(authority, roots)
	if err != nil {
		return err
	}
	defer bare.Close()

	fmt.Printf("pollgate bench: GOMAXPROCS=%d, %s per run (+%s warm-up), bbolt fsync=%v\n\n", runtime.GOMAXPROCS(0), d, warmup, !noSync)
	var results []result
	for _, n := range conns {
		// Forwarded: jobs with a 1ms backoff, cycled so each is due again.
		gov, cleanup, err := startPollgate(authority, roots, upURL, "1ms", noSync)
		if err != nil {
			return err
		}
		govPaths := func(worker, i int) string {
			return fmt.Sprintf("/v1/jobs/w%d-j%d", worker, i%jobsPerConn)
		}
		// Pre-create every job (first sight creates the record).
		load(upURL, gov, authority, roots, n, 0, 0, govPaths, jobsPerConn)
		// Early polls: one job per worker, polled once, then always too early.
		early, cleanup2, err := startPollgate(authority, roots, upURL, "1h", noSync)
		if err != nil {
			cleanup()
			return err
		}
		earlyPath := func(worker, i int) string { return fmt.Sprintf("/v1/jobs/e%d", worker) }
		load(upURL, early, authority, roots, n, 0, 0, earlyPath, 1)

		for _, m := range []struct {
			name  string
			proxy string
			path  func(int, int) string
		}{
			{"direct", "", func(w, i int) string { return fmt.Sprintf("/v1/jobs/w%d-j%d", w, i%jobsPerConn) }},
			{"bare-mitm", bare.URL, func(w, i int) string { return fmt.Sprintf("/v1/jobs/w%d-j%d", w, i%jobsPerConn) }},
			{"governed", gov, govPaths},
			{"early-429", early, earlyPath},
		} {
			if onlyMode != "" && m.name != onlyMode && m.name != "bare-mitm" {
				continue
			}
			var c0, s0 int64
			if st := storeFor(m.name); st != nil {
				c0, s0 = st.CommitStats()
			}
			r := load(upURL, m.proxy, authority, roots, n, d, warmup, m.path, 0)
			r.mode = m.name
			if st := storeFor(m.name); st != nil {
				c1, s1 := st.CommitStats()
				if c1 > c0 {
					fmt.Printf("           ledger: %d commits, %.1f steps per commit\n", c1-c0, float64(s1-s0)/float64(c1-c0))
				}
			}
			results = append(results, r)
			fmt.Printf("%-10s conns=%-3d %9.0f req/s  p50 %-9s p99 %-9s codes %v errors %d\n",
				r.mode, n, float64(r.reqs)/r.dur.Seconds(), r.p50.Round(time.Microsecond), r.p99.Round(time.Microsecond), r.codes, r.errs)
		}
		cleanup()
		cleanup2()
	}
	fmt.Println()
	fmt.Println("| mode | conns | req/s | p50 | p99 | vs bare MITM |")
	fmt.Println("|---|---|---|---|---|---|")
	bareRate := map[int]float64{}
	for _, r := range results {
		if r.mode == "bare-mitm" {
			bareRate[r.conns] = float64(r.reqs) / r.dur.Seconds()
		}
	}
	for _, r := range results {
		rate := float64(r.reqs) / r.dur.Seconds()
		fmt.Printf("| %s | %d | %.0f | %s | %s | %.2fx |\n", r.mode, r.conns, rate,
			r.p50.Round(time.Microsecond), r.p99.Round(time.Microsecond), rate/bareRate[r.conns])
	}
	return nil
}

// load runs conns workers with one keep-alive client. With d > 0 it
// measures for d after warmup; with perWorker > 0 each worker makes that
// many requests (unmeasured, to create records) and returns.
func load(upURL, proxyURL string, authority *ca.Authority, upRoots *x509.CertPool, conns int, d, warmup time.Duration, path func(worker, i int) string, perWorker int) result {
	pool := upRoots.Clone()
	pool.AddCert(authority.Certificate())
	tr := &http.Transport{
		TLSClientConfig:     &tls.Config{RootCAs: pool},
		MaxIdleConnsPerHost: conns,
		MaxConnsPerHost:     conns,
		ForceAttemptHTTP2:   false,
	}
	if proxyURL != "" {
		u, _ := url.Parse(proxyURL)
		tr.Proxy = http.ProxyURL(u)
	}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}

	var measuring atomic.Bool
	var stop atomic.Bool
	var reqs, errs atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	codes := map[int]int64{}
	var wg sync.WaitGroup
	for w := 0; w < conns; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			var mine []time.Duration
			myCodes := map[int]int64{}
			for i := 0; !stop.Load(); i++ {
				if perWorker > 0 && i >= perWorker {
					break
				}
				req, _ := http.NewRequest("GET", upURL+path(w, i), nil)
				req.Header.Set("Authorization", "Bearer bench-"+strconv.Itoa(w))
				start := time.Now()
				resp, err := client.Do(req)
				if err == nil {
					_, err = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
				took := time.Since(start)
				if measuring.Load() {
					if err != nil {
						errs.Add(1)
						continue
					}
					reqs.Add(1)
					mine = append(mine, took)
					myCodes[resp.StatusCode]++
				}
			}
			mu.Lock()
			lat = append(lat, mine...)
			for k, v := range myCodes {
				codes[k] += v
			}
			mu.Unlock()
		}(w)
	}
	if perWorker > 0 {
		wg.Wait()
		return result{}
	}
	time.Sleep(warmup)
	measuring.Store(true)
	start := time.Now()
	time.Sleep(d)
	measuring.Store(false)
	elapsed := time.Since(start)
	stop.Store(true)
	wg.Wait()
	slices.Sort(lat)
	r := result{conns: conns, reqs: reqs.Load(), errs: errs.Load(), dur: elapsed, codes: codes}
	if len(lat) > 0 {
		r.p50 = lat[len(lat)/2]
		r.p99 = lat[len(lat)*99/100]
	}
	return r
}

// startProvider serves a small JSON status answer over TLS (HTTP/1.1).
func startProvider() (net.Listener, *x509.Certificate, error) {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "bench provider"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	cert, _ := x509.ParseCertificate(der)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}},
		NextProtos:   []string{"http/1.1"},
	})
	if err != nil {
		return nil, nil, err
	}
	body := []byte(`{"id":"job","state":"running","created_at":"2026-03-02T10:20:00Z"}`)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.Write(body)
	})}
	go srv.Serve(ln)
	return ln, cert, nil
}

type bareProxy struct {
	URL string
	srv *http.Server
}

func (b *bareProxy) Close() { b.srv.Close() }

// startBareMITM is goproxy MITM'ing everything with the same CA and leaf
// cache and the same tuned transport, but no governance.
func startBareMITM(authority *ca.Authority, roots *x509.CertPool) (*bareProxy, error) {
	gp := goproxy.NewProxyHttpServer()
	gp.Tr = proxy.NewTransport(roots, 30*time.Second)
	gp.ConnectDial = nil
	gp.Logger = nopLogger{}
	gp.OnRequest().HandleConnectFunc(func(host string, ctx *goproxy.ProxyCtx) (*goproxy.ConnectAction, string) {
		return &goproxy.ConnectAction{Action: goproxy.ConnectMitm, TLSConfig: func(h string, _ *goproxy.ProxyCtx) (*tls.Config, error) {
			return authority.ServerTLSConfig(h)
		}}, host
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: gp}
	go srv.Serve(ln)
	return &bareProxy{URL: "http://" + ln.Addr().String(), srv: srv}, nil
}

type nopLogger struct{}

func (nopLogger) Printf(string, ...any) {}

const benchContract = `version: 1
defaults:
  policy:
    deadline: 24h
    max_status_requests: 100000000
    backoff: {base: %s, max: %s, jitter_floor: 1}
    lease: 30s
providers:
  - name: bench
    base_url: %s
    account_header: Authorization
    status:
      request: GET /v1/jobs/{job_id}
      state: state
      states:
        waiting: [queued, running]
        success: [succeeded]
        failure: [failed]
`

// startPollgate runs the governed proxy with a bbolt ledger in a temp dir.
// The ledger is remembered by backoff ("1ms" governed, "1h" early-429) so
// the run can print its group-commit statistics.
func startPollgate(authority *ca.Authority, roots *x509.CertPool, upURL, backoff string, noSync bool) (string, func(), error) {
	c, err := rules.Parse("bench.yaml", []byte(fmt.Sprintf(benchContract, backoff, backoff, upURL)))
	if err != nil {
		return "", nil, err
	}
	dir, err := os.MkdirTemp("", "pollgate-bench-")
	if err != nil {
		return "", nil, err
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	st, err := ledger.OpenBolt(dir, ledger.BoltOptions{NoSync: noSync, Logger: log})
	if err != nil {
		return "", nil, err
	}
	lastStores[backoff] = st
	p, err := proxy.New(proxy.Config{
		Contract:      func() *rules.Contract { return c },
		Store:         st,
		CA:            authority,
		UpstreamRoots: roots,
		Logger:        log,
		AccountKey:    []byte("bench-account-key-0123456789abcdef"),
	})
	if err != nil {
		return "", nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{Handler: p.Handler()}
	go srv.Serve(p.WrapListener(ln))
	return "http://" + ln.Addr().String(), func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		p.Close()
		st.Close()
		os.RemoveAll(dir)
	}, nil
}
