// Package rules owns pollgate's behaviour: the provider contract (providers.yaml),
// the operation record's shape, and the pure decision core that turns
// (contract, record, now, randomness, one observed event) into a decision.
//
// rules does no I/O of its own: no network, no disk, no clock, no global
// randomness. Callers pass time and a random source in. The ledger persists
// what rules decide; the proxy carries decisions out. Rule numbers (R1-R27)
// refer to the behavioural contract in RULES.md.
package rules

import (
	"net/http"
	"net/url"
	"time"
)

// ---------------------------------------------------------------------------
// Contract (resolved form of providers.yaml; see contract.go for loading)
// ---------------------------------------------------------------------------

// Contract is a loaded, validated providers.yaml. It is immutable after
// Load returns and safe for concurrent use.
type Contract struct {
	Version   int         // schema version, always 1
	Defaults  Policy      // resolved defaults.policy
	Providers []*Provider // in file order
	Hash      string      // short hex hash of the file bytes ("contract <hash>")
	Path      string      // file the contract came from, for messages
	Notify    *NotifySpec // defaults.notify, may be nil
}

// Provider is one resolved provider entry: defaults already merged into Policy.
type Provider struct {
	Name          string
	BaseURL       *url.URL // scheme://host[:port][/path prefix]
	AccountHeader string   // header whose value is fingerprinted (never stored)
	Submit        *SubmitSpec
	Status        StatusSpec
	Result        *ActionSpec
	Cancel        *ActionSpec
	Escalation    EscalationSpec
	Policy        Policy
	Notify        *NotifySpec // per-provider webhook, falls back to Contract.Notify
	Line          int         // line of the provider entry in the file

	compiled []compiledTemplate // parsed request templates for Match, set by Parse
}

// Template is a parsed request template such as "GET /v1/jobs/{job_id}".
// Path is relative to the provider's BaseURL path prefix unless the template
// is a single placeholder holding a full URL ("GET {result_url}").
type Template struct {
	Method string
	Path   string // as written, with {placeholders}
	// FieldURL is set when the template is "{field}": the URL is taken from
	// the named body field of the success response.
	FieldURL string
	// Query is a fixed query string written after "?" in the template
	// (e.g. "api-version=2024-11-30"). It is ignored by Match and appended
	// by Expand. Placeholders are not allowed in it.
	Query string
}

type SubmitSpec struct {
	Request           Template
	JobID             string // gjson path of the job id in the response body
	StatusLocation    bool   // take the status URL from Location / Operation-Location (R14)
	IdempotencyHeader string // R20
}

type StatusSpec struct {
	Request         Template
	State           string // gjson path of the state (string or boolean)
	States          StateTable
	SuccessRequires []string // gjson paths that must be present and valid (R3)
	// SuccessForbids lists gjson paths that must be absent (or null) for a
	// success state to count as success; when one is present the job failed
	// (e.g. a Google operation with done=true and an error). Optional.
	SuccessForbids []string
	// StateDefault is the state assumed when the state field is absent
	// (e.g. "false" for Google operations, whose done is omitted while
	// false). Optional; without it a missing state is unknown (R2).
	StateDefault    string
	Hints           Hints
	Error           string // gjson path of the provider error kept on failure
	RequestIDHeader string // R17
}

// StateTable is the explicit table of R2. Boolean states are written as
// "true"/"false".
type StateTable struct {
	Waiting   []string
	Success   []string
	Failure   []string
	Cancelled []string
	Expired   []string
}

type Hints struct {
	PollAfterSeconds string // gjson path
	NextCheckAt      string // gjson path (RFC 3339 timestamp)
	ExpiresAt        string // gjson path (RFC 3339 timestamp or unix seconds)
}

type ActionSpec struct {
	Request Template
}

type EscalationSpec struct {
	StatusCode int    // default 200
	StateValue string // written at the state path; default first failure state
}

type NotifySpec struct {
	Webhook string
}

// Policy holds the limits of one provider. Every field has a default from
// defaults.policy (and a built-in default when that is silent too).
type Policy struct {
	Deadline             time.Duration   // default 40m (R8)
	BusinessDeadline     time.Duration   // optional, shorter than Deadline (R19); 0 = none
	MaxStatusRequests    int             // default 12 (R8, R9)
	MaxTransportFailures int             // default 3 (R17)
	MaxRateLimited       int             // default 3 (R13)
	Backoff              Backoff         // default 5s..120s, floor 0.5 (R5)
	NotFoundGrace        time.Duration   // default 30s (R15)
	Lease                time.Duration   // default 30s (R21)
	Extension            ExtensionPolicy // default 15m, 4 requests, 2 extensions (R18, R24)
	EarlyPoll            string          // "reject" (429 + Retry-After), the only mode today
}

type Backoff struct {
	Base        time.Duration
	Max         time.Duration
	JitterFloor float64 // (0,1], default 0.5
}

type ExtensionPolicy struct {
	Duration       time.Duration
	StatusRequests int
	MaxExtensions  int
}

// Kind says which contract call a request is.
type Kind string

const (
	KindSubmit Kind = "submit"
	KindStatus Kind = "status"
	KindResult Kind = "result"
	KindCancel Kind = "cancel"
)

// Match is what Contract.Match found for one request.
type Match struct {
	Provider *Provider
	Kind     Kind
	Params   map[string]string // template placeholders, e.g. "job_id"
	JobID    string            // Params["job_id"] or the single placeholder value
}

// ---------------------------------------------------------------------------
// The operation record (R4); persisted by the ledger as JSON.
// ---------------------------------------------------------------------------

type Phase string

const (
	PhaseWaiting   Phase = "waiting"
	PhaseSucceeded Phase = "succeeded"
	PhaseStopped   Phase = "stopped" // terminal: job failed/cancelled/expired at the provider
	PhaseEscalated Phase = "escalated"
	PhaseClosed    Phase = "closed"
)

// Terminal reports whether polling has ended for good (a status call is
// answered from the record without contacting the provider).
func (p Phase) Terminal() bool {
	return p == PhaseSucceeded || p == PhaseStopped || p == PhaseEscalated || p == PhaseClosed
}

type Origin string

const (
	OriginSubmission     Origin = "submission"
	OriginFirstStatusCal Origin = "first_status_call"
)

// DelaySource names where the next poll time came from (R25).
type DelaySource string

const (
	DelayProviderRetryAfter DelaySource = "provider_retry_after"
	DelayProviderPollHint   DelaySource = "provider_poll_hint"
	DelayLocalBackoff       DelaySource = "local_backoff"
	DelayManualExtension    DelaySource = "manual_extension"
)

// Reason is the machine-readable escalation reason (R18).
type Reason string

const (
	ReasonDeadlineExceeded           Reason = "deadline_exceeded"
	ReasonRequestBudgetExhausted     Reason = "request_budget_exhausted"
	ReasonRateLimited                Reason = "rate_limited"
	ReasonTransportFailuresExhausted Reason = "transport_failures_exhausted"
	ReasonUnknownState               Reason = "unknown_state"
	ReasonAuthorizationDenied        Reason = "authorization_denied"
	ReasonJobFailed                  Reason = "job_failed"
	ReasonJobCancelled               Reason = "job_cancelled"
	ReasonJobExpired                 Reason = "job_expired"
	ReasonJobNotFound                Reason = "job_not_found"
	ReasonContradiction              Reason = "contradiction"
	ReasonInvalidResponse            Reason = "invalid_response"
	ReasonResubmissionBlocked        Reason = "resubmission_blocked"
)

// Budget is the authorized limit of one operation. It is fixed at creation
// and only raised by an extension (R24); a contract reload never changes it.
type Budget struct {
	StatusRequests    int `json:"status_requests"`
	TransportFailures int `json:"transport_failures"`
	RateLimited       int `json:"rate_limited"`
}

// Counters are what an operation has used. They never reset (R11).
type Counters struct {
	StatusRequests    int `json:"status_requests"`    // reserved (incremented before sending, R9)
	Polls             int `json:"polls"`              // completed polls with an answer; R5's attempt
	TransportFailures int `json:"transport_failures"` // R17
	RateLimited       int `json:"rate_limited"`       // R13
	EarlyPolls        int `json:"early_polls"`        // answered 429 by pollgate; not a provider request
	NotFound          int `json:"not_found"`          // 404s inside the grace period (R15)
}

type Lease struct {
	Holder    string    `json:"holder,omitempty"`
	Fence     int64     `json:"fence"` // increases with every reservation
	ExpiresAt time.Time `json:"expires_at,omitzero"`
}

// Option is one bounded next action offered on escalation (R18).
type Option struct {
	Action         string        `json:"action"` // "extend", "cancel_at_provider", "inspect", "close", "allow_resubmission"
	Duration       time.Duration `json:"-"`
	DurationText   string        `json:"duration,omitempty"` // Go duration text of Duration
	StatusRequests int           `json:"status_requests,omitempty"`
	Description    string        `json:"description"`
}

type Escalation struct {
	Reason  Reason    `json:"reason"`
	Message string    `json:"message"`
	Options []Option  `json:"options"`
	At      time.Time `json:"at"`
}

type Extension struct {
	By             string        `json:"by"`
	Note           string        `json:"note,omitempty"`
	At             time.Time     `json:"at"`
	Duration       time.Duration `json:"duration_ns"`
	StatusRequests int           `json:"status_requests"`
	NewDeadline    time.Time     `json:"new_deadline"`
}

// StoredResponse is a terminal provider answer kept for replay.
type StoredResponse struct {
	StatusCode int               `json:"status_code"`
	Header     map[string]string `json:"header,omitempty"` // selected headers only, never credentials
	Body       []byte            `json:"body,omitempty"`   // up to a limit
	Truncated  bool              `json:"truncated,omitempty"`
}

// ActionRecord is a result fetch or cancel call recorded on its own (R23).
type ActionRecord struct {
	Kind       Kind      `json:"kind"`
	At         time.Time `json:"at"`
	HTTPStatus int       `json:"http_status"`
	Error      string    `json:"error,omitempty"`
}

// Operation is the durable record of one provider job (R4). Keyed by
// (Provider, Account, JobID); OperationID is the second index.
type Operation struct {
	ID                 string `json:"operation_id"`
	Provider           string `json:"provider"`
	JobID              string `json:"provider_job_id"`
	Account            string `json:"account_fingerprint"` // keyed hash of the credential, never the credential
	RequestFingerprint string `json:"request_fingerprint,omitempty"`
	IdempotencyKey     string `json:"idempotency_key,omitempty"`
	StatusURL          string `json:"status_url,omitempty"`
	ResultURL          string `json:"result_url,omitempty"`
	Origin             Origin `json:"origin"`
	ContractVersion    string `json:"contract_version"`

	StartedAt  time.Time `json:"started_at"`
	DeadlineAt time.Time `json:"deadline_at"`
	Budget     Budget    `json:"budget"`
	Used       Counters  `json:"used"`

	NextPollAt  time.Time   `json:"next_poll_at,omitzero"`
	DelaySource DelaySource `json:"delay_source,omitempty"`

	LastState     string    `json:"last_state,omitempty"`
	LastHTTP      int       `json:"last_http_status,omitempty"`
	LastHTTPAt    time.Time `json:"last_http_at,omitzero"`
	LastRequestID string    `json:"last_request_id,omitempty"`
	LastError     string    `json:"last_error,omitempty"`     // last transport error text
	ProviderError string    `json:"provider_error,omitempty"` // kept on failure (R2), raw JSON

	Lease      Lease           `json:"lease"`
	Phase      Phase           `json:"phase"`
	Escalation *Escalation     `json:"escalation,omitempty"`
	Extensions []Extension     `json:"extensions,omitempty"`
	Terminal   *StoredResponse `json:"terminal_response,omitempty"`
	Actions    []ActionRecord  `json:"actions,omitempty"`

	ResubmissionAllowed bool      `json:"resubmission_allowed,omitempty"`
	ClosedAt            time.Time `json:"closed_at,omitzero"`
	ClosedBy            string    `json:"closed_by,omitempty"`
	UpdatedAt           time.Time `json:"updated_at"`

	AuditHead  string `json:"audit_head,omitempty"` // hex SHA-256 of the last audit entry
	AuditCount int64  `json:"audit_count"`
}

// Clone returns a deep copy, so decisions never alias the caller's record.
func (o *Operation) Clone() *Operation {
	if o == nil {
		return nil
	}
	c := *o
	if o.Escalation != nil {
		e := *o.Escalation
		e.Options = append([]Option(nil), o.Escalation.Options...)
		c.Escalation = &e
	}
	c.Extensions = append([]Extension(nil), o.Extensions...)
	c.Actions = append([]ActionRecord(nil), o.Actions...)
	if o.Terminal != nil {
		t := *o.Terminal
		t.Body = append([]byte(nil), o.Terminal.Body...)
		if o.Terminal.Header != nil {
			t.Header = make(map[string]string, len(o.Terminal.Header))
			for k, v := range o.Terminal.Header {
				t.Header[k] = v
			}
		}
		c.Terminal = &t
	}
	return &c
}

// ---------------------------------------------------------------------------
// Events and decisions
// ---------------------------------------------------------------------------

// Rand is the random source the decision core uses for jitter.
// *math/rand/v2.Rand satisfies it.
type Rand interface {
	Float64() float64
}

// Response is one provider answer as observed by the proxy.
type Response struct {
	StatusCode   int
	Header       http.Header
	Body         []byte // possibly nil when BodyTooLarge or not JSON
	BodyTooLarge bool   // the body exceeded the read limit (R10 invalid_response)
	At           time.Time
}

// Action is what the caller must do with a decision.
type Action string

const (
	ActSend     Action = "send"      // before sending: reserve one request and forward (R9)
	ActTooEarly Action = "too_early" // before sending: answer 429 + Retry-After (R7)
	ActEscalate Action = "escalate"  // stop and answer with the escalation body (R18)
	ActReplay   Action = "replay"    // terminal: answer from the stored record
	ActWait     Action = "wait"      // after a response: keep polling at NextPollAt
	ActNotReady Action = "not_ready" // after a response: success without required fields (R3); keep waiting
	ActSucceed  Action = "succeed"   // after a response: success state, required fields valid
)

// Decision is the outcome of one event. Op is the record after the event,
// ready to be committed by the ledger (it never aliases the input record).
type Decision struct {
	Action      Action
	Reason      Reason      // set when Action == ActEscalate
	Op          *Operation  // the new record to commit
	NextPollAt  time.Time   // when the next status request is allowed
	DelaySource DelaySource // where NextPollAt came from
	Wait        time.Duration
	State       string // parsed job state, if any
	StateClass  string // "waiting", "success", "failure", "cancelled", "expired", "unknown", ""
	// HintRejected says why a provider hint was ignored (R6), "" if none.
	HintRejected string
	// Note is a short human explanation for not_ready and similar answers.
	Note string
	// Story is the audit story line (R25), e.g.
	// "polled, state running, next poll 10:20:31 from local backoff".
	Story string
}
