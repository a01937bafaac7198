// Package ledger owns every byte of pollgate's state: operation records,
// leases, counters, extensions and the per-operation audit chains. It has two
// backends behind the Store interface: bbolt in a data directory (default,
// exactly one proxy process) and Redis (several replicas, Cluster-compatible).
//
// The ledger performs the atomic checks of R9/R21 (deadline, budget, next
// allowed poll, lease) but makes no policy decisions of its own: the records
// it commits come from package rules.
//
// Time: every step takes "now" from the caller (one injected clock per
// process, NTP-synchronised across replicas). The same clock drives the
// decisions in rules, so a Reserve check and the schedule it enforces never
// disagree, and tests control time without touching Redis. Redis TIME was
// the alternative; it would give replicas one clock, but the schedule
// (next_poll_at, deadline) is computed by rules from the process clock
// anyway, so a second clock inside the scripts could only disagree with it.
// Steps without a time argument (Create, Complete, Escalate) take it from
// the entry's Time, else the record's UpdatedAt. Only the retention expiry
// of Redis keys (PEXPIRE) runs on the Redis clock. Redis compares times at
// microsecond precision.
//
// Backends:
//
//   - BoltStore (OpenBolt): <data-dir>/ledger.db, mode 0600. One process per
//     data directory (the file lock; a second process fails with an error
//     naming the directory), so with bbolt pollgate is a single replica.
//     Every step is a read-write transaction with fsync; concurrent steps
//     share one transaction (group commit, see BoltStore). Terminal
//     operations are removed by RunSweeper after the retention period.
//   - RedisStore (OpenRedis, NewRedisStore): any number of replicas, Redis
//     Cluster compatible; one Lua script per step, all keys of one operation
//     under one hash tag. A governed status call costs two round trips (one
//     Reserve script, one Complete script). Terminal operations expire
//     (PEXPIRE) after the retention period.
//
// Redis must not lose or evict writes, or budgets reset (R11):
//
//	appendonly yes
//	appendfsync everysec        # "always" loses nothing on a crash, at a cost
//	maxmemory-policy noeviction # writes fail (ErrUnavailable) instead of evicting
//
// OpenRedis warns at start when maxmemory-policy evicts or appendonly is off.
//
// Ownership of record fields: Reserve owns the request counter, early polls
// and the lease; Update (admin steps, recorded actions) owns Actions,
// Extensions, ResubmissionAllowed and ClosedAt/ClosedBy, which Complete and
// Escalate keep from the stored record; the ledger owns the identity and the
// audit chain (AuditHead, AuditCount). The ledger fills an entry's
// OperationID, Provider, JobID and Time when empty and sets its counters
// (Used, Max, EarlyPolls) from the committed record. On Redis an entry's
// EarlyPolls is the count known when the step started (early polls counted
// while a request was in flight show up in the next entry).
package ledger

import (
	"context"
	"errors"
	"io"
	"time"

	"pollgate/audit"
	"pollgate/rules"
)

// Key identifies one provider job: one caller, one job (R11).
type Key struct {
	Provider string
	Account  string // account fingerprint
	JobID    string
}

// Outcome of a Reserve.
type Outcome string

const (
	Reserved        Outcome = "reserved"         // counter incremented, lease taken: send exactly one request
	Terminal        Outcome = "terminal"         // phase is terminal or escalated: answer from the record
	TooEarly        Outcome = "too_early"        // now < next_poll_at: answer 429, Wait says how long
	Busy            Outcome = "busy"             // another request holds the lease: answer 429, Wait = lease remaining
	DeadlineReached Outcome = "deadline_reached" // now >= deadline_at: escalate deadline_exceeded (via Escalate)
	BudgetExhausted Outcome = "budget_exhausted" // used >= max: escalate request_budget_exhausted (via Escalate)
	NotFound        Outcome = "not_found"        // no record for the key
)

// Reservation is the result of Reserve. Op is the record as stored after the
// step (fresh, reloaded under the lease, R21).
type Reservation struct {
	Outcome Outcome
	Op      *rules.Operation
	Key     Key
	Fence   int64         // valid when Outcome == Reserved
	Wait    time.Duration // for TooEarly and Busy
}

// Filter selects operations for List. Empty fields match everything.
type Filter struct {
	Phase    rules.Phase
	Provider string
	Cursor   string // opaque, from a previous page
	Limit    int    // default 100
}

// Page is one page of List.
type Page struct {
	Operations []*rules.Operation
	Next       string // cursor of the next page, "" at the end
}

var (
	// ErrUnavailable wraps every failure to reach or write the backing store
	// (Redis down, disk full, file locked). Nothing is half-written.
	ErrUnavailable = errors.New("ledger unavailable")
	// ErrNotFound: no operation with that key or id.
	ErrNotFound = errors.New("operation not found")
	// ErrFenceLost: Complete after the lease expired and another reservation
	// took the job; the late result is refused and must be reported.
	ErrFenceLost = errors.New("lease lost: a newer reservation owns the operation")
	// ErrConflict: the step is not allowed in the record's current phase
	// (e.g. Extend on a waiting operation, second allow-resubmission).
	ErrConflict = errors.New("operation state conflict")
)

// Store is the ledger contract. Every method is one atomic step, safe for
// concurrent use by many goroutines (and, for Redis, many processes); every
// state-changing step appends its audit entry in the same atomic step and
// returns errors wrapping the sentinels above.
type Store interface {
	// Create stores op (and its first audit entry) unless a record for the
	// same Key exists; it returns the stored record and whether it was new.
	// Two concurrent creators of the same job get one record (R4).
	Create(ctx context.Context, op *rules.Operation, entry audit.Entry) (*rules.Operation, bool, error)
	// Get loads by key; GetByID by operation id. ErrNotFound if absent.
	Get(ctx context.Context, key Key) (*rules.Operation, error)
	GetByID(ctx context.Context, id string) (*rules.Operation, error)
	// FindSubmission returns the newest operation of provider+account with
	// that request fingerprint, or ErrNotFound (resubmission check, R20).
	FindSubmission(ctx context.Context, provider, account, requestFingerprint string) (*rules.Operation, error)

	// Reserve is the poll gate (R9, R21), one atomic step: load; terminal or
	// escalated -> Terminal; now >= deadline -> DeadlineReached; used >= max ->
	// BudgetExhausted; now < next_poll_at -> TooEarly; lease held and not
	// expired -> Busy; else increment used.status_requests, take the lease
	// (holder, new fence, now+lease), persist, -> Reserved. TooEarly and Busy
	// also count one early poll in the same step. No audit entry is written
	// for early polls; their count appears in the next entry.
	Reserve(ctx context.Context, key Key, holder string, lease time.Duration, now time.Time) (Reservation, error)
	// Complete commits the record decided for a reservation (response
	// metadata, state, schedule, counters, escalation) and releases the lease,
	// only if the fence still matches (else ErrFenceLost). Counters owned by
	// other steps (early polls) are preserved from the stored record.
	// A second Complete of the same reservation is ErrFenceLost too; if an
	// admin step moved the operation out of the waiting phase meanwhile,
	// Complete returns ErrConflict and writes nothing.
	Complete(ctx context.Context, res Reservation, op *rules.Operation, entry audit.Entry) (*rules.Operation, error)
	// Escalate commits an escalation decided without a reservation (deadline
	// or budget found by Reserve). It applies only while the stored phase is
	// waiting and no live lease is held; otherwise it returns the stored record unchanged.
	Escalate(ctx context.Context, key Key, op *rules.Operation, entry audit.Entry) (*rules.Operation, error)
	// Update applies fn to the stored record in one atomic step and appends
	// entry (built by fn's caller from the result). Used for admin steps and
	// recorded actions. fn may return ErrConflict to abort without writing.
	// fn must not call the Store, and may run more than once (Redis retries
	// when another step appended to the chain meanwhile): no side effects
	// beyond the record. Changes fn makes to the fields Reserve owns (request
	// counter, early polls, lease) and to the identity are ignored.
	Update(ctx context.Context, id string, now time.Time, fn func(op *rules.Operation) (audit.Entry, error)) (*rules.Operation, error)

	// List pages through operations by phase and provider.
	List(ctx context.Context, f Filter) (Page, error)
	// Audit returns the envelopes of one operation in chain order.
	Audit(ctx context.Context, id string) ([]audit.Envelope, error)
	// Export writes every operation's envelopes and head as JSONL.
	Export(ctx context.Context, w io.Writer) error
	// Sweep removes terminal operations (and their audit chains) whose last
	// update is older than now-retention; returns how many were removed.
	Sweep(ctx context.Context, now time.Time) (int, error)
	// Ping reports whether the store is reachable (readiness).
	Ping(ctx context.Context) error
	Close() error
}

// EarlyPollCounter is implemented by both backends: it counts n early polls
// of one operation (answered 429 by pollgate without a reservation) in one
// atomic step, as Reserve counts a single one: no audit entry, the count
// shows in the next entry. It lets the proxy coalesce a tight-looping
// agent's early polls into one ledger step. ErrNotFound if the key is unknown.
type EarlyPollCounter interface {
	AddEarlyPolls(ctx context.Context, key Key, n int, now time.Time) error
}
