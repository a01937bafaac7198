package proxy

import (
	"time"

	"pollgate/rules"
)

// Observer receives what the proxy decided, for metrics and notifications.
// Implementations must be safe for concurrent use and must never block the
// proxy (queue and drop rather than wait). NopObserver is the default.
type Observer interface {
	// Governed is called once per governed answer: provider name, call kind,
	// and the Pollgate-Decision value ("forwarded", "too_early", "escalated",
	// "replayed", "not_ready", "refused").
	Governed(provider string, kind rules.Kind, decision string)
	// Upstream is called once per request sent upstream, with the status code
	// (0 for a transport error) and how long the round trip took.
	Upstream(provider string, status int, took time.Duration)
	// Ledger is called after every ledger step with its name ("reserve",
	// "complete", ...), duration and whether it failed.
	Ledger(step string, took time.Duration, err error)
	// EarlyPoll is called when an agent polled before its allowed slot.
	EarlyPoll(provider string)
	// Escalated is called once when an operation becomes escalated (not on
	// replays of the escalation body). op is a copy the observer may keep.
	Escalated(op *rules.Operation)
}

// NopObserver ignores everything.
type NopObserver struct{}

func (NopObserver) Governed(string, rules.Kind, string) {}
func (NopObserver) Upstream(string, int, time.Duration) {}
func (NopObserver) Ledger(string, time.Duration, error) {}
func (NopObserver) EarlyPoll(string)                    {}
func (NopObserver) Escalated(*rules.Operation)          {}

var _ Observer = NopObserver{}
