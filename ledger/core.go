package ledger

import (
	"errors"
	"fmt"
	"time"

	"pollgate/audit"
	"pollgate/rules"
)

// DefaultRetention is how long terminal operations and their audit chains
// are kept when an Options.Retention is zero.
const DefaultRetention = 7 * 24 * time.Hour

// DefaultListLimit is the page size of List when Filter.Limit is zero.
const DefaultListLimit = 100

// maxListLimit bounds one page of List.
const maxListLimit = 1000

// KeyOf returns the ledger key of a record.
func KeyOf(op *rules.Operation) Key {
	return Key{Provider: op.Provider, Account: op.Account, JobID: op.JobID}
}

// stepTime is the "now" of steps that take no explicit time argument
// (Create, Complete, Escalate): the entry's time, else the record's
// UpdatedAt. Both come from the caller's clock.
func stepTime(entry audit.Entry, op *rules.Operation) time.Time {
	if !entry.Time.IsZero() {
		return entry.Time
	}
	return op.UpdatedAt
}

// fillEntry completes an entry from the record it describes: the identity
// fields when empty, the time when zero, and the counters as committed.
func fillEntry(e *audit.Entry, op *rules.Operation, now time.Time) {
	if e.OperationID == "" {
		e.OperationID = op.ID
	}
	if e.Provider == "" {
		e.Provider = op.Provider
	}
	if e.JobID == "" {
		e.JobID = op.JobID
	}
	if e.Time.IsZero() {
		e.Time = now
	}
	e.Used = op.Used.StatusRequests
	e.Max = op.Budget.StatusRequests
	e.EarlyPolls = op.Used.EarlyPolls
}

// seal encodes entry and links it after op's chain head. It does not modify
// op; the caller sets op.AuditHead/AuditCount from the envelope once the
// step is certain to commit.
func seal(op *rules.Operation, entry audit.Entry, key []byte) (audit.Envelope, error) {
	data, enc, err := audit.EncodeEntry(entry, key)
	if err != nil {
		return audit.Envelope{}, err
	}
	return audit.Seal(op.AuditHead, op.AuditCount+1, op.ID, data, enc), nil
}

// applyEnvelope records a sealed envelope as the record's chain head.
func applyEnvelope(op *rules.Operation, env audit.Envelope) {
	op.AuditHead = env.Hash
	op.AuditCount = env.Seq
}

// leaseLive reports whether op's lease is held at now.
func leaseLive(op *rules.Operation, now time.Time) bool {
	return !op.Lease.ExpiresAt.IsZero() && now.Before(op.Lease.ExpiresAt)
}

// reserve applies the poll gate (R9, R21) to a stored record. It returns the
// outcome and whether op was changed (and must be persisted).
func reserve(op *rules.Operation, holder string, lease time.Duration, now time.Time) (Reservation, bool) {
	res := Reservation{Op: op, Key: KeyOf(op)}
	switch {
	case op.Phase.Terminal():
		res.Outcome = Terminal
		return res, false
	case !op.DeadlineAt.IsZero() && !now.Before(op.DeadlineAt):
		res.Outcome = DeadlineReached
		return res, false
	case op.Used.StatusRequests >= op.Budget.StatusRequests:
		res.Outcome = BudgetExhausted
		return res, false
	case now.Before(op.NextPollAt):
		res.Outcome = TooEarly
		res.Wait = op.NextPollAt.Sub(now)
		op.Used.EarlyPolls++
		op.UpdatedAt = now
		return res, true
	case leaseLive(op, now):
		res.Outcome = Busy
		res.Wait = op.Lease.ExpiresAt.Sub(now)
		op.Used.EarlyPolls++
		op.UpdatedAt = now
		return res, true
	}
	op.Used.StatusRequests++
	op.Lease = rules.Lease{Holder: holder, Fence: op.Lease.Fence + 1, ExpiresAt: now.Add(lease)}
	op.UpdatedAt = now
	res.Outcome = Reserved
	res.Fence = op.Lease.Fence
	return res, true
}

// errPhaseChanged: Complete found the record no longer waiting (an admin
// step closed or escalated it while the request was in flight).
var errPhaseChanged = fmt.Errorf("%w: the operation left the waiting phase while the request was in flight", ErrConflict)

// checkFence verifies that stored still belongs to reservation res.
func checkFence(stored *rules.Operation, res Reservation) error {
	if res.Outcome != Reserved {
		return fmt.Errorf("%w: complete needs a reservation with outcome %q, got %q", ErrConflict, Reserved, res.Outcome)
	}
	if stored.Lease.Fence != res.Fence || stored.Lease.ExpiresAt.IsZero() {
		return fmt.Errorf("operation %s fence %d (stored %d): %w", stored.ID, res.Fence, stored.Lease.Fence, ErrFenceLost)
	}
	if stored.Phase != rules.PhaseWaiting {
		return fmt.Errorf("operation %s is %s: %w", stored.ID, stored.Phase, errPhaseChanged)
	}
	return nil
}

// completed builds the record Complete stores: everything from op, except
// identity, early polls, the audit chain, the admin-owned fields and the
// lease (released), which come from stored; the request counter never goes
// down (R11).
func completed(stored, op *rules.Operation) *rules.Operation {
	n := op.Clone()
	keepOwned(n, stored)
	keepAdmin(n, stored)
	n.Lease = rules.Lease{Fence: stored.Lease.Fence}
	return n
}

// escalated builds the record Escalate stores; the lease stays as stored.
func escalated(stored, op *rules.Operation) *rules.Operation {
	n := op.Clone()
	keepOwned(n, stored)
	keepAdmin(n, stored)
	n.Lease = stored.Lease
	return n
}

// keepAdmin restores the fields only Update changes (recorded actions,
// extensions, resubmission approval, closing), so a poll result computed
// from an older copy never undoes an admin step committed meanwhile.
func keepAdmin(n, stored *rules.Operation) {
	c := stored.Clone()
	n.Actions, n.Extensions = c.Actions, c.Extensions
	n.ResubmissionAllowed = stored.ResubmissionAllowed
	n.ClosedAt, n.ClosedBy = stored.ClosedAt, stored.ClosedBy
}

// keepOwned restores the fields no caller-supplied record may change:
// identity, audit chain, early polls, and a request counter that never
// decreases.
func keepOwned(n, stored *rules.Operation) {
	n.ID, n.Provider, n.Account, n.JobID = stored.ID, stored.Provider, stored.Account, stored.JobID
	n.AuditHead, n.AuditCount = stored.AuditHead, stored.AuditCount
	n.Used.EarlyPolls = stored.Used.EarlyPolls
	if stored.Used.StatusRequests > n.Used.StatusRequests {
		n.Used.StatusRequests = stored.Used.StatusRequests
	}
}

// updated restores what Update's fn may not change: identity, the chain,
// and the fields owned by Reserve (request counter, early polls, lease).
func updated(n, stored *rules.Operation) {
	keepOwned(n, stored)
	n.Used.StatusRequests = stored.Used.StatusRequests
	n.Lease = stored.Lease
}

// canEscalate reports whether Escalate applies to stored at now.
func canEscalate(stored *rules.Operation, now time.Time) bool {
	return stored.Phase == rules.PhaseWaiting && !leaseLive(stored, now)
}

// validateNew checks a record handed to Create.
func validateNew(op *rules.Operation) error {
	var missing []string
	if op.ID == "" {
		missing = append(missing, "operation_id")
	}
	if op.Provider == "" {
		missing = append(missing, "provider")
	}
	if op.JobID == "" {
		missing = append(missing, "provider_job_id")
	}
	if len(missing) > 0 {
		return fmt.Errorf("failed to create operation: missing %v", missing)
	}
	if op.Phase == "" {
		return errors.New("failed to create operation: missing phase")
	}
	return nil
}

func unavailable(what string, err error) error {
	if errors.Is(err, ErrUnavailable) {
		return fmt.Errorf("failed to %s: %w", what, err)
	}
	return fmt.Errorf("failed to %s: %w: %w", what, ErrUnavailable, err)
}
