// Package metrics owns pollgate's Prometheus metrics: one private registry
// (never the global default), every name prefixed "pollgate_", and label
// values from small fixed sets only (provider names from the contract, call
// kinds, decisions, reasons, status classes, ledger steps, outcomes) - never
// URLs, job ids or operation ids.
//
// Metrics implements proxy.Observer. Its methods only touch counters and
// histograms, so they never block the proxy. The operations-by-phase gauge is
// computed from the ledger at scrape time, at most once per CacheFor.
package metrics

import (
	"context"
	"net/http"
	"runtime"
	"runtime/debug"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"pollgate/ledger"
	"pollgate/proxy"
	"pollgate/rules"
)

// Options configures New. Every field is optional.
type Options struct {
	// Version is reported by pollgate_build_info; default: the module
	// version from the build info, or "devel".
	Version string
	// Store, when set, feeds pollgate_operations{phase,provider}.
	Store ledger.Store
	// CacheFor is how long a count of operations by phase is reused between
	// scrapes. Default 15s; listing the whole ledger on every scrape would
	// cost as much as the traffic it measures.
	CacheFor time.Duration
	// Now is the clock used for the cache; default time.Now.
	Now func() time.Time
	// ProcessCollectors adds the standard Go runtime and process metrics. Default off.
	ProcessCollectors bool
}

// Metrics holds every pollgate metric. Safe for concurrent use.
type Metrics struct {
	reg *prometheus.Registry

	governed      *prometheus.CounterVec
	upstream      *prometheus.CounterVec
	upstreamTime  *prometheus.HistogramVec
	ledgerTime    *prometheus.HistogramVec
	ledgerErrors  *prometheus.CounterVec
	earlyPolls    *prometheus.CounterVec
	escalations   *prometheus.CounterVec
	reloads       *prometheus.CounterVec
	contractInfo  *prometheus.GaugeVec
	contractTime  prometheus.Gauge
	notifications *prometheus.CounterVec

	contractMu   sync.Mutex
	contractHash string
}

var _ proxy.Observer = (*Metrics)(nil)

// New builds the registry with every pollgate metric registered.
func New(o Options) *Metrics {
	if o.CacheFor <= 0 {
		o.CacheFor = 15 * time.Second
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Version == "" {
		o.Version = "devel"
		if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			o.Version = bi.Main.Version
		}
	}
	reg := prometheus.NewRegistry()
	f := func(c prometheus.Collector) { reg.MustRegister(c) }
	m := &Metrics{reg: reg}

	m.governed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pollgate_governed_requests_total",
		Help: "Governed answers by provider, call kind and decision (the Pollgate-Decision header).",
	}, []string{"provider", "kind", "decision"})
	m.upstream = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pollgate_upstream_responses_total",
		Help: "Requests sent to providers by status class (2xx, 3xx, 4xx, 5xx, error for transport failures).",
	}, []string{"provider", "class"})
	m.upstreamTime = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "pollgate_upstream_duration_seconds",
		Help:    "Round trip time of requests sent to providers.",
		Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
	}, []string{"provider"})
	m.ledgerTime = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "pollgate_ledger_duration_seconds",
		Help:    "Duration of ledger steps (reserve, complete, ...).",
		Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, 1},
	}, []string{"step"})
	m.ledgerErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pollgate_ledger_errors_total",
		Help: "Ledger steps that failed.",
	}, []string{"step"})
	m.earlyPolls = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pollgate_early_polls_total",
		Help: "Status calls before the allowed slot, answered 429 by pollgate (agents ignoring waiting instructions).",
	}, []string{"provider"})
	m.escalations = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pollgate_escalations_total",
		Help: "Operations that became escalated, by reason.",
	}, []string{"provider", "reason"})
	m.reloads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pollgate_contract_reloads_total",
		Help: "Contract reload attempts by outcome (applied, unchanged, error).",
	}, []string{"outcome"})
	m.contractInfo = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pollgate_contract_info",
		Help: "The active contract: 1 for its hash.",
	}, []string{"hash"})
	m.contractTime = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "pollgate_contract_loaded_timestamp_seconds",
		Help: "When the active contract was loaded (unix seconds).",
	})
	m.notifications = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pollgate_notifications_total",
		Help: "Escalation webhook outcomes (delivered, retried, failed, dropped).",
	}, []string{"outcome"})
	build := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pollgate_build_info",
		Help: "Build information: always 1.",
	}, []string{"version", "goversion"})
	build.WithLabelValues(o.Version, runtime.Version()).Set(1)

	for _, c := range []prometheus.Collector{m.governed, m.upstream, m.upstreamTime, m.ledgerTime, m.ledgerErrors,
		m.earlyPolls, m.escalations, m.reloads, m.contractInfo, m.contractTime, m.notifications, build} {
		f(c)
	}
	for _, oc := range []string{"applied", "unchanged", "error"} {
		m.reloads.WithLabelValues(oc)
	}
	for _, oc := range []string{"delivered", "retried", "failed", "dropped"} {
		m.notifications.WithLabelValues(oc)
	}
	if o.Store != nil {
		f(&phaseCollector{store: o.Store, cacheFor: o.CacheFor, now: o.Now,
			desc: prometheus.NewDesc("pollgate_operations", "Operations in the ledger by phase and provider.", []string{"phase", "provider"}, nil),
			errDesc: prometheus.NewDesc("pollgate_operations_scrape_errors_total",
				"Failures to count operations from the ledger at scrape time.", nil, nil)})
	}
	if o.ProcessCollectors {
		f(collectors.NewGoCollector())
		f(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	return m
}

// Registry returns the private registry (for tests and extra collectors).
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the registry in the Prometheus exposition formats.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// Governed implements proxy.Observer.
func (m *Metrics) Governed(provider string, kind rules.Kind, decision string) {
	m.governed.WithLabelValues(provider, string(kind), decision).Inc()
}

// Upstream implements proxy.Observer.
func (m *Metrics) Upstream(provider string, status int, took time.Duration) {
	m.upstream.WithLabelValues(provider, StatusClass(status)).Inc()
	m.upstreamTime.WithLabelValues(provider).Observe(took.Seconds())
}

// Ledger implements proxy.Observer.
func (m *Metrics) Ledger(step string, took time.Duration, err error) {
	m.ledgerTime.WithLabelValues(step).Observe(took.Seconds())
	if err != nil {
		m.ledgerErrors.WithLabelValues(step).Inc()
	}
}

// EarlyPoll implements proxy.Observer.
func (m *Metrics) EarlyPoll(provider string) { m.earlyPolls.WithLabelValues(provider).Inc() }

// Escalated implements proxy.Observer.
func (m *Metrics) Escalated(op *rules.Operation) {
	reason := "unknown"
	if op.Escalation != nil {
		reason = string(op.Escalation.Reason)
	}
	m.escalations.WithLabelValues(op.Provider, reason).Inc()
}

// ContractReload records one reload attempt: outcome is "applied",
// "unchanged" or "error".
func (m *Metrics) ContractReload(outcome string) { m.reloads.WithLabelValues(outcome).Inc() }

// SetContract marks c as the active contract (pollgate_contract_info{hash}).
func (m *Metrics) SetContract(c *rules.Contract, loadedAt time.Time) {
	if c == nil {
		return
	}
	m.contractMu.Lock()
	defer m.contractMu.Unlock()
	if m.contractHash != "" && m.contractHash != c.Hash {
		m.contractInfo.DeleteLabelValues(m.contractHash)
	}
	m.contractHash = c.Hash
	m.contractInfo.WithLabelValues(c.Hash).Set(1)
	m.contractTime.Set(float64(loadedAt.UnixNano()) / 1e9)
}

// Notification records one webhook outcome (see package notify).
func (m *Metrics) Notification(outcome string) { m.notifications.WithLabelValues(outcome).Inc() }

// StatusClass maps an upstream status code to its label: "2xx".."5xx", or
// "error" for a transport failure (0) and anything outside 100-599.
func StatusClass(status int) string {
	if status < 100 || status > 599 {
		return "error"
	}
	return strconv.Itoa(status/100) + "xx"
}

// phaseCollector counts operations by phase and provider from the ledger,
// reusing the last count for cacheFor.
type phaseCollector struct {
	store    ledger.Store
	cacheFor time.Duration
	now      func() time.Time
	desc     *prometheus.Desc
	errDesc  *prometheus.Desc

	mu     sync.Mutex
	at     time.Time
	counts map[[2]string]int
	errs   int
}

func (c *phaseCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.desc
	ch <- c.errDesc
}

func (c *phaseCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	if c.counts == nil || now.Sub(c.at) >= c.cacheFor {
		counts, err := countPhases(c.store)
		if err != nil {
			c.errs++
		} else {
			c.counts, c.at = counts, now
		}
	}
	// Every phase of every provider seen, so a phase that empties reads 0
	// instead of vanishing.
	providers := map[string]bool{}
	for k := range c.counts {
		providers[k[1]] = true
	}
	for p := range providers {
		for _, ph := range phases {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(c.counts[[2]string{string(ph), p}]), string(ph), p)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.errDesc, prometheus.CounterValue, float64(c.errs))
}

var phases = []rules.Phase{rules.PhaseWaiting, rules.PhaseSucceeded, rules.PhaseStopped, rules.PhaseEscalated, rules.PhaseClosed}

func countPhases(s ledger.Store) (map[[2]string]int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	counts := map[[2]string]int{}
	f := ledger.Filter{Limit: 1000}
	for {
		page, err := s.List(ctx, f)
		if err != nil {
			return nil, err
		}
		for _, op := range page.Operations {
			counts[[2]string{string(op.Phase), op.Provider}]++
		}
		if page.Next == "" {
			return counts, nil
		}
		f.Cursor = page.Next
	}
}
