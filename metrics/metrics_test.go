package metrics

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"pollgate/ledger"
	"pollgate/rules"
)

// listStore is a ledger.Store that only answers List (pages of 2) and
// counts how often it was asked.
type listStore struct {
	ledger.Store
	mu    sync.Mutex
	ops   []*rules.Operation
	lists int
	fail  bool
}

func (s *listStore) List(_ context.Context, f ledger.Filter) (ledger.Page, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lists++
	if s.fail {
		return ledger.Page{}, ledger.ErrUnavailable
	}
	start := 0
	if f.Cursor != "" {
		for i, op := range s.ops {
			if op.ID == f.Cursor {
				start = i
			}
		}
	}
	end := min(start+2, len(s.ops))
	p := ledger.Page{Operations: s.ops[start:end]}
	if end < len(s.ops) {
		p.Next = s.ops[end].ID
	}
	return p, nil
}

// scrape fetches /metrics over HTTP and parses the text format.
func scrape(t *testing.T, h http.Handler) map[string]*dto.MetricFamily {
	t.Helper()
	srv := httptest.NewServer(h)
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("scrape: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse exposition: %v", err)
	}
	return fams
}

// value finds the sample of family name whose labels include want.
func value(t *testing.T, fams map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	t.Helper()
	fam := fams[name]
	if fam == nil {
		t.Fatalf("metric %s not exposed", name)
	}
next:
	for _, m := range fam.Metric {
		got := map[string]string{}
		for _, l := range m.Label {
			got[l.GetName()] = l.GetValue()
		}
		for k, v := range want {
			if got[k] != v {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		}
	}
	t.Fatalf("metric %s has no sample with labels %v", name, want)
	return 0
}

func TestObserverMetricsScraped(t *testing.T) {
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	store := &listStore{ops: []*rules.Operation{
		{ID: "a", Provider: "acme", Phase: rules.PhaseWaiting},
		{ID: "b", Provider: "acme", Phase: rules.PhaseWaiting},
		{ID: "c", Provider: "acme", Phase: rules.PhaseEscalated},
		{ID: "d", Provider: "other", Phase: rules.PhaseSucceeded},
		{ID: "e", Provider: "other", Phase: rules.PhaseClosed},
	}}
	m := New(Options{Version: "v1.2.3", Store: store, Now: func() time.Time { return now }})

	m.Governed("acme", rules.KindStatus, "forwarded")
	m.Governed("acme", rules.KindStatus, "forwarded")
	m.Governed("acme", rules.KindStatus, "too_early")
	m.Upstream("acme", 200, 20*time.Millisecond)
	m.Upstream("acme", 503, 30*time.Millisecond)
	m.Upstream("acme", 0, time.Second)
	m.Ledger("reserve", time.Millisecond, nil)
	m.Ledger("complete", time.Millisecond, errors.New("disk full"))
	m.EarlyPoll("acme")
	m.Escalated(&rules.Operation{Provider: "acme", Escalation: &rules.Escalation{Reason: rules.ReasonDeadlineExceeded}})
	m.ContractReload("applied")
	m.ContractReload("error")
	m.SetContract(&rules.Contract{Hash: "abc123"}, now)
	m.SetContract(&rules.Contract{Hash: "def456"}, now)
	m.Notification("dropped")

	fams := scrape(t, m.Handler())
	checks := []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"pollgate_governed_requests_total", map[string]string{"provider": "acme", "kind": "status", "decision": "forwarded"}, 2},
		{"pollgate_governed_requests_total", map[string]string{"decision": "too_early"}, 1},
		{"pollgate_upstream_responses_total", map[string]string{"class": "2xx"}, 1},
		{"pollgate_upstream_responses_total", map[string]string{"class": "5xx"}, 1},
		{"pollgate_upstream_responses_total", map[string]string{"class": "error"}, 1},
		{"pollgate_upstream_duration_seconds", map[string]string{"provider": "acme"}, 3},
		{"pollgate_ledger_duration_seconds", map[string]string{"step": "reserve"}, 1},
		{"pollgate_ledger_errors_total", map[string]string{"step": "complete"}, 1},
		{"pollgate_early_polls_total", map[string]string{"provider": "acme"}, 1},
		{"pollgate_escalations_total", map[string]string{"provider": "acme", "reason": "deadline_exceeded"}, 1},
		{"pollgate_contract_reloads_total", map[string]string{"outcome": "applied"}, 1},
		{"pollgate_contract_reloads_total", map[string]string{"outcome": "error"}, 1},
		{"pollgate_contract_reloads_total", map[string]string{"outcome": "unchanged"}, 0},
		{"pollgate_contract_info", map[string]string{"hash": "def456"}, 1},
		{"pollgate_contract_loaded_timestamp_seconds", nil, float64(now.Unix())},
		{"pollgate_notifications_total", map[string]string{"outcome": "dropped"}, 1},
		{"pollgate_notifications_total", map[string]string{"outcome": "delivered"}, 0},
		{"pollgate_build_info", map[string]string{"version": "v1.2.3"}, 1},
		{"pollgate_operations", map[string]string{"phase": "waiting", "provider": "acme"}, 2},
		{"pollgate_operations", map[string]string{"phase": "escalated", "provider": "acme"}, 1},
		{"pollgate_operations", map[string]string{"phase": "succeeded", "provider": "acme"}, 0},
		{"pollgate_operations", map[string]string{"phase": "closed", "provider": "other"}, 1},
	}
	for _, c := range checks {
		if got := value(t, fams, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	// Only the active contract hash is exposed.
	if n := len(fams["pollgate_contract_info"].Metric); n != 1 {
		t.Errorf("pollgate_contract_info has %d series, want 1", n)
	}
	// Every name carries the prefix, and no label could hold a URL or id.
	allowed := map[string]bool{"provider": true, "kind": true, "decision": true, "class": true, "step": true,
		"reason": true, "outcome": true, "phase": true, "hash": true, "version": true, "goversion": true, "le": true}
	for name, fam := range fams {
		if !strings.HasPrefix(name, "pollgate_") {
			t.Errorf("metric %s lacks the pollgate_ prefix", name)
		}
		for _, m := range fam.Metric {
			for _, l := range m.Label {
				if !allowed[l.GetName()] {
					t.Errorf("metric %s has unbounded label %q", name, l.GetName())
				}
			}
		}
	}
}

// The phase count is cached: scrapes within CacheFor do not list the ledger
// again, and a failing ledger keeps the last count and counts an error.
func TestPhaseCollectorCaches(t *testing.T) {
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	store := &listStore{ops: []*rules.Operation{{ID: "a", Provider: "acme", Phase: rules.PhaseWaiting}}}
	m := New(Options{Store: store, Now: clock, CacheFor: 10 * time.Second})

	scrape(t, m.Handler())
	scrape(t, m.Handler())
	if store.lists != 1 {
		t.Errorf("two scrapes within CacheFor listed the ledger %d times, want 1", store.lists)
	}
	mu.Lock()
	now = now.Add(11 * time.Second)
	mu.Unlock()
	store.mu.Lock()
	store.fail = true
	store.mu.Unlock()
	fams := scrape(t, m.Handler())
	if got := value(t, fams, "pollgate_operations", map[string]string{"phase": "waiting"}); got != 1 {
		t.Errorf("after a failed recount waiting = %v, want the last count 1", got)
	}
	if got := value(t, fams, "pollgate_operations_scrape_errors_total", nil); got != 1 {
		t.Errorf("scrape errors = %v, want 1", got)
	}
}

func TestStatusClass(t *testing.T) {
	for in, want := range map[int]string{0: "error", 200: "2xx", 202: "2xx", 301: "3xx", 404: "4xx", 429: "4xx", 503: "5xx", 999: "error", -1: "error"} {
		if got := StatusClass(in); got != want {
			t.Errorf("StatusClass(%d) = %q, want %q", in, got, want)
		}
	}
}

// BenchmarkObserver measures the cost the proxy pays per governed answer
// (one Governed, one Upstream, two Ledger calls).
//
//	go test -run '^$' -bench Observer ./metrics
func BenchmarkObserver(b *testing.B) {
	m := New(Options{})
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			m.Governed("acme", rules.KindStatus, "forwarded")
			m.Upstream("acme", 200, 20*time.Millisecond)
			m.Ledger("reserve", 100*time.Microsecond, nil)
			m.Ledger("complete", 100*time.Microsecond, nil)
		}
	})
}
