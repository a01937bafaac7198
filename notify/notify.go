// Package notify owns escalation notifications: when an operation escalates,
// a webhook (the provider's notify.webhook, or the contract's default) gets
// the R18 message and the bounded options as JSON, with a Slack-compatible
// one-paragraph "text" field.
//
// Delivery is asynchronous and must never block the proxy: Enqueue puts the
// message on a bounded queue and returns at once; when the queue is full the
// message is dropped and counted. Workers retry failed deliveries with
// exponential backoff, each attempt under its own timeout; a delivery that
// still fails is logged and counted. Webhook URLs often carry a secret
// (Slack's do), so only their host is ever logged.
package notify

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"pollgate/rules"
)

// Outcomes reported to Config.OnOutcome (bounded metric label values).
const (
	OutcomeDelivered = "delivered" // the receiver answered 2xx
	OutcomeRetried   = "retried"   // one attempt failed, another follows
	OutcomeFailed    = "failed"    // every attempt failed, or the receiver refused it (4xx)
	OutcomeDropped   = "dropped"   // the queue was full (or closed)
)

// Config configures a Notifier. The zero value is usable: every field has a default.
type Config struct {
	// QueueSize bounds the number of pending messages. Default 256.
	QueueSize int
	// Workers is the number of concurrent deliveries. Default 2.
	Workers int
	// Attempts is the maximum number of tries per message. Default 5.
	Attempts int
	// BaseDelay is the wait after the first failed attempt; it doubles per
	// attempt up to MaxDelay. Defaults 1s and 30s.
	BaseDelay time.Duration
	MaxDelay  time.Duration
	// Timeout bounds one attempt (connect, send, read the answer). Default 5s.
	Timeout time.Duration
	// Client sends the requests. Default: a client that ignores proxy
	// environment variables (pollgate must not send its own webhooks through
	// itself).
	Client *http.Client
	// Sleep waits between attempts; it returns early with ctx.Err() when ctx
	// ends. Default: a timer. Tests inject one that records the delays.
	Sleep func(ctx context.Context, d time.Duration) error
	// OnOutcome is called once per outcome (see the Outcome constants). May be nil.
	OnOutcome func(outcome string)
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Message is the JSON body posted to a webhook.
type Message struct {
	// Text is a one-paragraph summary for Slack-compatible receivers.
	Text          string         `json:"text"`
	Event         string         `json:"event"` // always "escalated"
	Reason        rules.Reason   `json:"reason"`
	Message       string         `json:"message"` // the R18 text
	Options       []rules.Option `json:"options"`
	OperationID   string         `json:"operation_id"`
	Provider      string         `json:"provider"`
	ProviderJobID string         `json:"provider_job_id"`
	LastState     string         `json:"last_state,omitempty"`
	LastHTTP      int            `json:"last_http_status,omitempty"`
	StartedAt     time.Time      `json:"started_at"`
	EscalatedAt   time.Time      `json:"escalated_at"`
	DeadlineAt    time.Time      `json:"deadline_at"`
	RequestsUsed  int            `json:"status_requests_used"`
	RequestsMax   int            `json:"status_requests_max"`
}

// BuildMessage turns an escalated record into the webhook body.
func BuildMessage(op *rules.Operation) Message {
	m := Message{
		Event:         "escalated",
		OperationID:   op.ID,
		Provider:      op.Provider,
		ProviderJobID: op.JobID,
		LastState:     op.LastState,
		LastHTTP:      op.LastHTTP,
		StartedAt:     op.StartedAt,
		DeadlineAt:    op.DeadlineAt,
		RequestsUsed:  op.Used.StatusRequests,
		RequestsMax:   op.Budget.StatusRequests,
		Options:       []rules.Option{},
	}
	if e := op.Escalation; e != nil {
		m.Reason = e.Reason
		m.Message = e.Message
		m.EscalatedAt = e.At
		m.Options = append(m.Options, e.Options...)
	}
	m.Text = summary(m)
	return m
}

func summary(m Message) string {
	var b strings.Builder
	fmt.Fprintf(&b, "pollgate: %s job %s escalated (%s)", m.Provider, m.ProviderJobID, m.Reason)
	if msg := strings.TrimSpace(m.Message); msg != "" {
		b.WriteString(": ")
		b.WriteString(strings.Join(strings.Fields(msg), " "))
	}
	if !strings.HasSuffix(b.String(), ".") {
		b.WriteString(".")
	}
	// The R18 message usually lists the options already.
	if len(m.Options) > 0 && !strings.Contains(strings.ToLower(m.Message), "options:") {
		b.WriteString(" Options: ")
		for i, o := range m.Options {
			if i > 0 {
				b.WriteString("; ")
			}
			if o.Description != "" {
				b.WriteString(o.Description)
			} else {
				b.WriteString(o.Action)
			}
		}
		b.WriteString(".")
	}
	fmt.Fprintf(&b, " Operation %s: run `pollgate ops show %s`.", m.OperationID, m.OperationID)
	return b.String()
}

// WebhookFor returns the webhook of a provider, falling back to the
// contract's default; "" when neither is set.
func WebhookFor(c *rules.Contract, provider string) string {
	if c == nil {
		return ""
	}
	for _, p := range c.Providers {
		if p.Name == provider && p.Notify != nil && p.Notify.Webhook != "" {
			return p.Notify.Webhook
		}
	}
	if c.Notify != nil {
		return c.Notify.Webhook
	}
	return ""
}

type job struct {
	url string
	msg Message
}

// Notifier delivers messages from a bounded queue. Safe for concurrent use.
type Notifier struct {
	cfg   Config
	queue chan job

	mu      sync.RWMutex
	stopped bool
	wg      sync.WaitGroup
}

// New returns a Notifier; call Start to run its workers.
func New(cfg Config) *Notifier {
	if cfg.QueueSize <= 0 {
		cfg.QueueSize = 256
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 2
	}
	if cfg.Attempts <= 0 {
		cfg.Attempts = 5
	}
	if cfg.BaseDelay <= 0 {
		cfg.BaseDelay = time.Second
	}
	if cfg.MaxDelay <= 0 {
		cfg.MaxDelay = 30 * time.Second
	}
	if cfg.MaxDelay < cfg.BaseDelay {
		cfg.MaxDelay = cfg.BaseDelay
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 5 * time.Second
	}
	if cfg.Client == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.Proxy = nil
		cfg.Client = &http.Client{Transport: tr}
	}
	if cfg.Sleep == nil {
		cfg.Sleep = sleep
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Notifier{cfg: cfg, queue: make(chan job, cfg.QueueSize)}
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Start runs the workers until ctx ends. Messages still queued then are
// dropped (and counted); Wait returns when the workers have stopped.
func (n *Notifier) Start(ctx context.Context) {
	for range n.cfg.Workers {
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			n.work(ctx)
		}()
	}
	go func() {
		<-ctx.Done()
		n.mu.Lock()
		n.stopped = true
		n.mu.Unlock()
	}()
}

// Wait blocks until the workers started by Start have returned.
func (n *Notifier) Wait() { n.wg.Wait() }

// Escalated enqueues the notification of an escalated operation to the
// webhook the contract names for its provider; it does nothing when no
// webhook is configured. It never blocks.
func (n *Notifier) Escalated(c *rules.Contract, op *rules.Operation) bool {
	u := WebhookFor(c, op.Provider)
	if u == "" {
		return false
	}
	return n.Enqueue(u, BuildMessage(op))
}

// Enqueue queues msg for url and returns at once; false (and an outcome
// "dropped") when the queue is full or the notifier has stopped.
func (n *Notifier) Enqueue(url string, msg Message) bool {
	n.mu.RLock()
	stopped := n.stopped
	n.mu.RUnlock()
	if !stopped {
		select {
		case n.queue <- job{url: url, msg: msg}:
			return true
		default:
		}
	}
	n.outcome(OutcomeDropped)
	n.cfg.Logger.Warn("escalation notification dropped: queue full",
		"op", msg.OperationID, "provider", msg.Provider, "queue_size", n.cfg.QueueSize,
		"hint", "the webhook receiver is slow or down; check earlier delivery errors")
	return false
}

func (n *Notifier) outcome(o string) {
	if n.cfg.OnOutcome != nil {
		n.cfg.OnOutcome(o)
	}
}

func (n *Notifier) work(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			// Drain what is left so the drops are counted.
			for {
				select {
				case j := <-n.queue:
					n.outcome(OutcomeDropped)
					n.cfg.Logger.Warn("escalation notification dropped at shutdown", "op", j.msg.OperationID)
				default:
					return
				}
			}
		case j := <-n.queue:
			n.deliver(ctx, j)
		}
	}
}

// errPermanent marks an answer that retrying cannot fix (4xx except 408/429).
var errPermanent = errors.New("receiver refused the notification")

func (n *Notifier) deliver(ctx context.Context, j job) {
	body, err := json.Marshal(j.msg)
	if err != nil { // cannot happen with this type; keep the worker alive anyway
		n.outcome(OutcomeFailed)
		n.cfg.Logger.Error("failed to encode escalation notification", "op", j.msg.OperationID, "err", err)
		return
	}
	host := hostOf(j.url)
	log := n.cfg.Logger.With("op", j.msg.OperationID, "provider", j.msg.Provider, "webhook_host", host)
	delay := n.cfg.BaseDelay
	for attempt := 1; ; attempt++ {
		err = n.post(ctx, j.url, body)
		if err == nil {
			n.outcome(OutcomeDelivered)
			log.Info("escalation notification delivered", "attempt", attempt)
			return
		}
		if errors.Is(err, errPermanent) || attempt >= n.cfg.Attempts || ctx.Err() != nil {
			n.outcome(OutcomeFailed)
			log.Error("failed to deliver escalation notification", "attempts", attempt, "err", err,
				"hint", "check that the webhook in providers.yaml (notify.webhook) is reachable and accepts JSON POSTs")
			return
		}
		n.outcome(OutcomeRetried)
		log.Warn("escalation notification attempt failed, retrying", "attempt", attempt, "retry_in", delay, "err", err)
		if n.cfg.Sleep(ctx, delay) != nil {
			n.outcome(OutcomeFailed)
			log.Error("escalation notification abandoned at shutdown", "attempts", attempt)
			return
		}
		delay = min(delay*2, n.cfg.MaxDelay)
	}
}

func (n *Notifier) post(ctx context.Context, u string, body []byte) error {
	ctx, cancel := context.WithTimeout(ctx, n.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("%w: invalid webhook URL", errPermanent)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "pollgate-notify")
	resp, err := n.cfg.Client.Do(req)
	if err != nil {
		// The error text of url.Error contains the full URL; keep only the cause.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return fmt.Errorf("failed to post: %w", err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	switch {
	case resp.StatusCode >= 200 && resp.StatusCode < 300:
		return nil
	case resp.StatusCode == http.StatusRequestTimeout || resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500:
		return fmt.Errorf("receiver answered %d", resp.StatusCode)
	default:
		return fmt.Errorf("%w: receiver answered %d", errPermanent, resp.StatusCode)
	}
}

func hostOf(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(invalid URL)"
	}
	return u.Host
}
