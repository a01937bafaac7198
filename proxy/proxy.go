// Package proxy owns pollgate's traffic path: the goproxy forward proxy,
// selective MITM of the contract's hosts with the pollgate CA, the upstream
// transport, and the governed calls (submissions, status polls, result and
// cancel calls) carried out against the ledger in the order of R9/R21:
// reserve, forward exactly one request, classify, commit, answer.
//
// proxy makes no policy decisions of its own - package rules decides, the
// ledger persists - and it never touches traffic to hosts outside the
// contract (those are tunnelled byte for byte). It never logs credentials or
// whole bodies, and no panic or upstream failure inside a tunnel may crash
// the process: every governed call ends in an HTTP answer.
package proxy

import (
	crand "crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elazarl/goproxy"

	"pollgate/ca"
	"pollgate/ledger"
	"pollgate/rules"
)

// Config configures a Proxy. Contract, Store and CA are required.
type Config struct {
	// Contract returns the active contract. It is called once per request
	// (and once per CONNECT), so a reload applies to the next request while
	// in-flight requests finish on the contract they started with.
	Contract func() *rules.Contract
	// Store is the ledger. Governed calls fail closed (503) when it fails.
	Store ledger.Store
	// CA signs the leaf certificates of MITM'd contract hosts.
	CA *ca.Authority
	// UpstreamRoots verifies providers' TLS certificates. Default (nil): the
	// system roots. serve passes the system roots plus --upstream-ca.
	UpstreamRoots *x509.CertPool
	// Now is the clock of every decision and ledger step. Default time.Now.
	Now func() time.Time
	// Rand is the jitter source handed to rules. It is wrapped with a mutex,
	// so any rules.Rand works. Default: math/rand/v2 seeded from crypto/rand.
	Rand rules.Rand
	// Logger receives the proxy's logs. Default: slog.Default().
	Logger *slog.Logger
	// Observer receives decisions for metrics and notifications. Default NopObserver.
	Observer Observer
	// MaxBody is the largest body read for classification (status and
	// submission responses, submission requests). Default 1 MiB.
	MaxBody int64
	// AccountKey keys the account fingerprint (rules.AccountFingerprint). Required.
	AccountKey []byte
	// HolderID names this process in leases. Default "pollgate-<random>".
	HolderID string
	// IdleTimeout closes client connections (including tunnels and MITM'd
	// connections) idle this long. Default 2m. Applied by WrapListener.
	IdleTimeout time.Duration
	// LedgerTimeout bounds one ledger step. Default 5s.
	LedgerTimeout time.Duration
	// UpstreamTimeout bounds the wait for a provider's response headers. Default 60s.
	UpstreamTimeout time.Duration
	// Refuse, when set, is asked for every CONNECT and plain-HTTP target
	// ("host:port"); true answers 403 (e.g. the admin listener, metadata IPs).
	Refuse func(hostport string) bool
}

// DefaultMaxBody is the default body read limit.
const DefaultMaxBody = 1 << 20

// Proxy is the governed forward proxy. Create it with New.
type Proxy struct {
	cfg     Config
	gp      *goproxy.ProxyHttpServer
	tr      *http.Transport
	rnd     *lockedRand
	log     *slog.Logger
	obs     Observer
	hosts   atomic.Pointer[hostSet]
	gate    *earlyGate
	results *resultIndex
}

// hostSet caches the MITM host set of one contract.
type hostSet struct {
	c     *rules.Contract
	hosts map[string]bool
}

// New builds the proxy. It does not listen; serve owns the listener.
func New(cfg Config) (*Proxy, error) {
	if cfg.Contract == nil {
		return nil, errors.New("proxy: Config.Contract is required")
	}
	if cfg.Store == nil {
		return nil, errors.New("proxy: Config.Store is required")
	}
	if cfg.CA == nil {
		return nil, errors.New("proxy: Config.CA is required")
	}
	if len(cfg.AccountKey) == 0 {
		return nil, errors.New("proxy: Config.AccountKey is required")
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Rand == nil {
		var seed [16]byte
		_, _ = crand.Read(seed[:])
		cfg.Rand = rand.New(rand.NewPCG(binary.LittleEndian.Uint64(seed[:8]), binary.LittleEndian.Uint64(seed[8:])))
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Observer == nil {
		cfg.Observer = NopObserver{}
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = DefaultMaxBody
	}
	if cfg.HolderID == "" {
		cfg.HolderID = "pollgate-" + randomHex(6)
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = 2 * time.Minute
	}
	if cfg.LedgerTimeout <= 0 {
		cfg.LedgerTimeout = 5 * time.Second
	}
	if cfg.UpstreamTimeout <= 0 {
		cfg.UpstreamTimeout = 60 * time.Second
	}
	p := &Proxy{
		cfg: cfg,
		tr:  NewTransport(cfg.UpstreamRoots, cfg.UpstreamTimeout),
		rnd: &lockedRand{r: cfg.Rand},
		log: cfg.Logger,
		obs: cfg.Observer,
	}
	var addMany func(earlyPoll)
	if _, ok := cfg.Store.(EarlyPollCounter); ok {
		addMany = p.addEarly
	}
	p.gate = newEarlyGate(256, p.countEarly, addMany)
	p.results = newResultIndex()
	p.gp = p.build()
	return p, nil
}

// Handler returns the proxy's HTTP handler (CONNECT and absolute-form requests).
func (p *Proxy) Handler() http.Handler { return p.gp }

// WrapListener wraps ln so every accepted connection, including hijacked
// tunnels, is closed after Config.IdleTimeout without traffic.
func (p *Proxy) WrapListener(ln net.Listener) net.Listener {
	return NewIdleListener(ln, p.cfg.IdleTimeout)
}

// Close waits until every early poll answered so far is counted in the
// ledger and releases idle upstream connections. Call it after the HTTP
// server has shut down and before the ledger is closed.
func (p *Proxy) Close() {
	p.gate.stop()
	p.tr.CloseIdleConnections()
}

// NewTransport returns the upstream transport: verified TLS (roots nil =
// system roots), no proxy (pollgate never forwards to itself, whatever
// HTTPS_PROXY says), bounded dial/TLS/header timeouts and an idle pool large
// enough that concurrent MITM'd requests reuse connections (CRAFT.md).
func NewTransport(roots *x509.CertPool, headerTimeout time.Duration) *http.Transport {
	if headerTimeout <= 0 {
		headerTimeout = 60 * time.Second
	}
	d := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	return &http.Transport{
		Proxy:                 nil,
		DialContext:           d.DialContext,
		TLSClientConfig:       &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: headerTimeout,
		ExpectContinueTimeout: time.Second,
		MaxIdleConns:          1024,
		MaxIdleConnsPerHost:   256,
		IdleConnTimeout:       90 * time.Second,
		ForceAttemptHTTP2:     true,
	}
}

func (p *Proxy) build() *goproxy.ProxyHttpServer {
	gp := goproxy.NewProxyHttpServer()
	gp.Tr = p.tr
	// Self-loop guard (CRAFT.md): NewProxyHttpServer reads HTTPS_PROXY.
	gp.ConnectDial = nil
	gp.ConnectDialWithReq = nil
	gp.Logger = goproxyLogger{p.log}
	gp.Verbose = false
	gp.NonproxyHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusBadRequest, map[string]any{
			"error":   "not_a_proxy_request",
			"message": "this is pollgate's proxy port; send absolute-form or CONNECT requests (hint: set HTTPS_PROXY, see 'pollgate env'; health endpoints live on the admin listener)",
		})
	})

	gp.OnRequest().HandleConnectFunc(p.handleConnect)
	gp.OnRequest().DoFunc(p.handleRequest)
	gp.OnResponse().DoFunc(p.handleResponse)
	return gp
}

// handleConnect MITMs contract hosts and tunnels everything else.
func (p *Proxy) handleConnect(host string, ctx *goproxy.ProxyCtx) (action *goproxy.ConnectAction, newHost string) {
	defer func() {
		if v := recover(); v != nil {
			p.log.Error("panic in CONNECT handler", "host", host, "panic", fmt.Sprint(v))
			action, newHost = &goproxy.ConnectAction{Action: goproxy.ConnectReject}, host
		}
	}()
	if p.cfg.Refuse != nil && p.cfg.Refuse(host) {
		ctx.Resp = refusedResponse(ctx.Req, host)
		return &goproxy.ConnectAction{Action: goproxy.ConnectReject}, host
	}
	if p.isContractHost(host) {
		// The round tripper is copied into every request of the tunnel.
		ctx.RoundTripper = goproxy.RoundTripperFunc(p.roundTrip)
		return &goproxy.ConnectAction{Action: goproxy.ConnectMitm, TLSConfig: p.tlsConfig}, host
	}
	return &goproxy.ConnectAction{Action: goproxy.ConnectAccept}, host
}

func (p *Proxy) tlsConfig(host string, _ *goproxy.ProxyCtx) (*tls.Config, error) {
	return p.cfg.CA.ServerTLSConfig(host)
}

// handleRequest strips hop-by-hop headers and routes plain-HTTP requests to
// contract hosts through the governed round tripper.
func (p *Proxy) handleRequest(req *http.Request, ctx *goproxy.ProxyCtx) (r *http.Request, resp *http.Response) {
	defer func() {
		if v := recover(); v != nil {
			p.log.Error("panic in request handler", "panic", fmt.Sprint(v))
			r, resp = req, errorResponse(req, http.StatusInternalServerError, "internal_error", "pollgate failed to handle this request; see its log")
		}
	}()
	stripHopRequest(req.Header)
	if req.URL.Scheme == "http" && ctx.RoundTripper == nil {
		if p.cfg.Refuse != nil && p.cfg.Refuse(hostPort(req.URL)) {
			return req, refusedResponse(req, req.URL.Host)
		}
		if p.isContractHost(hostPort(req.URL)) {
			ctx.RoundTripper = goproxy.RoundTripperFunc(p.roundTrip)
		}
	}
	return req, nil
}

// handleResponse strips hop-by-hop response headers and turns a missing
// response (plain-HTTP transport error) into a 502 with a JSON body.
func (p *Proxy) handleResponse(resp *http.Response, ctx *goproxy.ProxyCtx) (out *http.Response) {
	defer func() {
		if v := recover(); v != nil {
			p.log.Error("panic in response handler", "panic", fmt.Sprint(v))
			out = errorResponse(ctx.Req, http.StatusBadGateway, "internal_error", "pollgate failed to handle this response; see its log")
		}
	}()
	if resp == nil {
		msg := "the upstream server did not answer"
		if ctx.Error != nil {
			msg = "the upstream server did not answer: " + ctx.Error.Error()
		}
		return errorResponse(ctx.Req, http.StatusBadGateway, "upstream_unreachable", msg)
	}
	stripHopResponse(resp)
	return resp
}

// isContractHost reports whether hostport ("host:port", or a bare host for
// port 443) is the host and port of a provider base_url. Only those are
// MITM'd; the same host on another port is tunnelled.
func (p *Proxy) isContractHost(hostport string) bool {
	c := p.cfg.Contract()
	if c == nil {
		return false
	}
	hs := p.hosts.Load()
	if hs == nil || hs.c != c {
		hs = &hostSet{c: c, hosts: map[string]bool{}}
		for _, pr := range c.Providers {
			if pr.BaseURL != nil {
				hs.hosts[hostKey(pr.BaseURL.Hostname(), pr.BaseURL.Port(), pr.BaseURL.Scheme)] = true
			}
		}
		p.hosts.Store(hs)
	}
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		host, port = hostport, ""
	}
	return hs.hosts[hostKey(host, port, "https")] || (port == "" && hs.hosts[hostKey(host, "80", "http")])
}

// hostKey is "host:port" in lower case, the port defaulted by scheme.
func hostKey(host, port, scheme string) string {
	host = strings.TrimSuffix(strings.ToLower(strings.Trim(host, "[]")), ".")
	if port == "" {
		port = "443"
		if scheme == "http" {
			port = "80"
		}
	}
	return net.JoinHostPort(host, port)
}

// lockedRand makes a rules.Rand safe for concurrent use.
type lockedRand struct {
	mu sync.Mutex
	r  rules.Rand
}

func (l *lockedRand) Float64() float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.Float64()
}

type goproxyLogger struct{ l *slog.Logger }

func (g goproxyLogger) Printf(format string, v ...any) {
	g.l.Debug(strings.TrimSpace(fmt.Sprintf(format, v...)), "component", "goproxy")
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = crand.Read(b)
	const hexdigits = "0123456789abcdef"
	out := make([]byte, 2*n)
	for i, c := range b {
		out[2*i], out[2*i+1] = hexdigits[c>>4], hexdigits[c&15]
	}
	return string(out)
}
