package admin

import (
	"context"
	"math"
	"net/http"
	"sort"
	"time"

	"pollgate/ledger"
	"pollgate/rules"
)

// Report is the body of GET /api/report: how well the fleet meets R27.
type Report struct {
	GeneratedAt time.Time        `json:"generated_at"`
	Providers   []ProviderReport `json:"providers"` // contract order, then providers only the ledger knows
	Total       ProviderReport   `json:"total"`
}

// ProviderReport counts one provider's operations by outcome.
type ProviderReport struct {
	Provider   string `json:"provider"`
	Operations int    `json:"operations"`
	Succeeded  int    `json:"succeeded"`
	// Failed: the provider ended the job (job_failed, job_cancelled, job_expired).
	Failed int `json:"failed"`
	// Escalated counts the other escalations by reason, closed ones included.
	Escalated      map[string]int `json:"escalated"`
	EscalatedTotal int            `json:"escalated_total"`
	Waiting        int            `json:"waiting"` // still waiting for a terminal result
	Closed         int            `json:"closed"`  // escalations a person acknowledged
	// StatusRequests sent to the provider and EarlyPolls answered 429 by
	// pollgate; EarlyPollShare = early / (early + sent): the share of agent
	// polls that ignored the waiting instructions.
	StatusRequests int     `json:"status_requests"`
	EarlyPolls     int     `json:"early_polls"`
	EarlyPollShare float64 `json:"early_poll_share"`
	// Time from the start of an operation to its terminal result (success,
	// stop or escalation) over the operations that have one.
	Terminal      int     `json:"terminal"`
	MedianSeconds float64 `json:"median_time_to_terminal_seconds"`
	P95Seconds    float64 `json:"p95_time_to_terminal_seconds"`

	durations []time.Duration
}

var providerEnded = map[rules.Reason]bool{
	rules.ReasonJobFailed: true, rules.ReasonJobCancelled: true, rules.ReasonJobExpired: true,
}

func (p *ProviderReport) add(op *rules.Operation) {
	p.Operations++
	p.StatusRequests += op.Used.StatusRequests
	p.EarlyPolls += op.Used.EarlyPolls
	if op.Phase == rules.PhaseClosed {
		p.Closed++
	}
	var reason rules.Reason
	if op.Escalation != nil {
		reason = op.Escalation.Reason
	}
	switch {
	case op.Phase == rules.PhaseWaiting:
		p.Waiting++
		return
	case op.Phase == rules.PhaseSucceeded:
		p.Succeeded++
	case op.Phase == rules.PhaseStopped || providerEnded[reason]:
		p.Failed++
	default:
		if reason == "" {
			reason = "none"
		}
		p.Escalated[string(reason)]++
		p.EscalatedTotal++
	}
	if end := terminalAt(op); !end.IsZero() && !end.Before(op.StartedAt) {
		p.durations = append(p.durations, end.Sub(op.StartedAt))
	}
}

// terminalAt is when an operation got its terminal result.
func terminalAt(op *rules.Operation) time.Time {
	switch {
	case op.Escalation != nil:
		return op.Escalation.At
	case !op.LastHTTPAt.IsZero():
		return op.LastHTTPAt
	}
	return op.UpdatedAt
}

func (p *ProviderReport) finish() {
	if n := p.EarlyPolls + p.StatusRequests; n > 0 {
		p.EarlyPollShare = math.Round(float64(p.EarlyPolls)/float64(n)*1e4) / 1e4
	}
	p.Terminal = len(p.durations)
	sort.Slice(p.durations, func(i, j int) bool { return p.durations[i] < p.durations[j] })
	p.MedianSeconds = percentile(p.durations, 0.50).Seconds()
	p.P95Seconds = percentile(p.durations, 0.95).Seconds()
}

// percentile is the nearest-rank percentile of sorted durations (0 when empty).
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

// BuildReport reads every operation once and counts outcomes per provider.
func BuildReport(ctx context.Context, store ledger.Store, c *rules.Contract, now time.Time) (Report, error) {
	byName := map[string]*ProviderReport{}
	var order []string
	get := func(name string) *ProviderReport {
		if p := byName[name]; p != nil {
			return p
		}
		p := &ProviderReport{Provider: name, Escalated: map[string]int{}}
		byName[name] = p
		order = append(order, name)
		return p
	}
	if c != nil {
		for _, p := range c.Providers {
			get(p.Name)
		}
	}
	total := &ProviderReport{Provider: "total", Escalated: map[string]int{}}
	f := ledger.Filter{Limit: maxPageLimit}
	for {
		page, err := store.List(ctx, f)
		if err != nil {
			return Report{}, err
		}
		for _, op := range page.Operations {
			get(op.Provider).add(op)
			total.add(op)
		}
		if page.Next == "" {
			break
		}
		f.Cursor = page.Next
	}
	rep := Report{GeneratedAt: now.UTC(), Providers: make([]ProviderReport, 0, len(order))}
	for _, name := range order {
		p := byName[name]
		p.finish()
		rep.Providers = append(rep.Providers, *p)
	}
	total.finish()
	rep.Total = *total
	return rep, nil
}

func (s *server) report(w http.ResponseWriter, r *http.Request) {
	rep, err := BuildReport(r.Context(), s.cfg.Store, s.cfg.Contract(), s.cfg.Now())
	if err != nil {
		s.storeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, rep)
}
