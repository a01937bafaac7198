package proxy

import (
	"context"
	"sync"
	"time"

	"pollgate/ledger"
	"pollgate/rules"
)

// earlyGate answers early polls from memory and counts them in the ledger
// in the background, so a tight-looping agent costs no fsync on its
// request path.
//
// Why a remembered "not before" time is safe: it is the NextPollAt of a
// record this process committed or read while the operation was waiting.
// Before that time no status request can be reserved (Reserve refuses it),
// so nothing can move NextPollAt earlier: the operation can only stay
// waiting with the same schedule or end (admin close, confirmed cancel).
// A remembered time therefore never lets a request through early; at worst
// an agent learns that its operation ended at its next allowed poll instead
// of a few seconds sooner.
//
// Counting: every early poll answered from memory is still recorded by a
// Reserve call with the poll's own time (so it can only be counted as
// too early, never reserve), run by a bounded pool of workers; when the
// queue is full the request path calls Reserve itself (back-pressure, no
// early poll is dropped).
type earlyGate struct {
	mu      sync.Mutex
	entries map[ledger.Key]gateEntry
	// coalesced holds early polls per job not yet counted, when the store
	// can add several in one step (EarlyPollCounter).
	coalesced map[ledger.Key]*earlyPoll
	addMany   func(ep earlyPoll)

	queue   chan earlyPoll
	stopped bool // queue closed (under mu)
	count   func(earlyPoll)
	pending sync.WaitGroup // early polls not yet counted

	// With addMany, early polls are summed per job and written every
	// flushEvery (or at once when too many jobs are pending): a job polled
	// in a tight loop costs one small ledger step per interval, not one per
	// poll. A crash loses at most one interval of early-poll counts (never a
	// provider request: those are reserved before sending, R9).
	flushEvery time.Duration
	tick       *time.Ticker
	tickDone   chan struct{}
}

// earlyFlushEvery is how long early polls of one job are summed before they
// are written; maxCoalesced bounds the jobs summed in memory at once.
const (
	earlyFlushEvery = 100 * time.Millisecond
	maxCoalesced    = 10_000
)

// EarlyPollCounter is the ledger's optional step that counts n early polls
// of one operation at once. When the store implements it (both shipped
// backends do), the early polls of one job answered from memory are
// coalesced into one step; otherwise each is counted by its own Reserve.
type EarlyPollCounter = ledger.EarlyPollCounter

type gateEntry struct {
	notBefore time.Time
	op        *rules.Operation // snapshot for the 429 body (ids, counters)
}

type earlyPoll struct {
	key   ledger.Key
	at    time.Time
	lease time.Duration
	n     int // coalesced count (EarlyPollCounter only)
}

// maxGateEntries bounds the remembered schedules; beyond it the gate
// starts over (correctness never depends on an entry being present).
const maxGateEntries = 100_000

// newEarlyGate starts workers that count early polls with count (one
// Reserve each), or, when addMany is set, with one coalesced step per job.
func newEarlyGate(workers int, count func(earlyPoll), addMany func(earlyPoll)) *earlyGate {
	g := &earlyGate{
		entries:    make(map[ledger.Key]gateEntry),
		coalesced:  make(map[ledger.Key]*earlyPoll),
		addMany:    addMany,
		queue:      make(chan earlyPoll, 16384),
		count:      count,
		flushEvery: earlyFlushEvery,
	}
	for i := 0; i < workers; i++ {
		go func() {
			for ep := range g.queue {
				g.flush(ep)
			}
		}()
	}
	if addMany != nil {
		g.tick = time.NewTicker(g.flushEvery)
		g.tickDone = make(chan struct{})
		go func() {
			for {
				select {
				case <-g.tick.C:
					g.flushCoalesced()
				case <-g.tickDone:
					return
				}
			}
		}()
	}
	return g
}

// flushCoalesced hands every job's summed early polls to the workers.
func (g *earlyGate) flushCoalesced() {
	g.mu.Lock()
	if len(g.coalesced) == 0 || g.stopped {
		g.mu.Unlock()
		return
	}
	batch := g.coalesced
	g.coalesced = make(map[ledger.Key]*earlyPoll, len(batch))
	g.mu.Unlock()
	for _, pc := range batch {
		g.mu.Lock()
		queued := false
		if !g.stopped {
			select {
			case g.queue <- *pc:
				queued = true
			default:
			}
		}
		g.mu.Unlock()
		if !queued {
			g.flush(*pc) // queue full or stopped: write it from here
		}
	}
}

// flush counts one queued item: a single early poll, or every early poll
// of the item's job coalesced so far.
func (g *earlyGate) flush(ep earlyPoll) {
	if g.addMany == nil {
		g.count(ep)
		g.pending.Done()
		return
	}
	g.addMany(ep)
	for i := 0; i < ep.n; i++ {
		g.pending.Done()
	}
}

// remember records that op (waiting) may not be polled before its
// NextPollAt. Records that are not waiting are forgotten.
func (g *earlyGate) remember(key ledger.Key, op *rules.Operation) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if op == nil || op.Phase != rules.PhaseWaiting || op.NextPollAt.IsZero() {
		delete(g.entries, key)
		return
	}
	if len(g.entries) >= maxGateEntries {
		g.entries = make(map[ledger.Key]gateEntry)
	}
	snap := &rules.Operation{ID: op.ID, Provider: op.Provider, JobID: op.JobID, Used: op.Used, Budget: op.Budget,
		NextPollAt: op.NextPollAt, Phase: op.Phase, DelaySource: op.DelaySource}
	g.entries[key] = gateEntry{notBefore: op.NextPollAt, op: snap}
}

func (g *earlyGate) forget(key ledger.Key) {
	g.mu.Lock()
	delete(g.entries, key)
	g.mu.Unlock()
}

// check returns the remembered snapshot and the wait when a poll at now is
// early; ok is false when the ledger must decide.
func (g *earlyGate) check(key ledger.Key, now time.Time) (op *rules.Operation, wait time.Duration, ok bool) {
	g.mu.Lock()
	e, found := g.entries[key]
	if found && !now.Before(e.notBefore) {
		delete(g.entries, key)
		found = false
	}
	g.mu.Unlock()
	if !found {
		return nil, 0, false
	}
	return e.op, e.notBefore.Sub(now), true
}

// record counts one early poll in the ledger, in the background when the
// queue has room.
func (g *earlyGate) record(ep earlyPoll) {
	g.pending.Add(1)
	g.mu.Lock()
	if g.addMany != nil && !g.stopped {
		if pc := g.coalesced[ep.key]; pc != nil {
			pc.n++ // summed until the next flush
			pc.at = ep.at
			g.mu.Unlock()
			return
		}
		if len(g.coalesced) < maxCoalesced {
			ep.n = 1
			g.coalesced[ep.key] = &ep
			g.mu.Unlock()
			return
		}
		// Too many jobs pending: this one is written on its own now.
	}
	ep.n = 1
	queued := false
	if !g.stopped {
		select {
		case g.queue <- ep:
			queued = true
		default:
		}
	}
	g.mu.Unlock()
	if !queued {
		g.flush(ep) // queue full or stopped: count on the request path
	}
}

// stop ends the workers once every queued early poll is counted; later
// early polls are counted on the request path.
func (g *earlyGate) stop() {
	g.mu.Lock()
	if g.stopped {
		g.mu.Unlock()
		g.pending.Wait()
		return
	}
	g.stopped = true
	batch := g.coalesced
	g.coalesced = make(map[ledger.Key]*earlyPoll)
	close(g.queue)
	g.mu.Unlock()
	if g.tick != nil {
		g.tick.Stop()
		close(g.tickDone)
	}
	for _, pc := range batch {
		g.flush(*pc)
	}
	g.pending.Wait()
}

// drain waits until every early poll answered so far is counted (at most
// one flush interval later).
func (g *earlyGate) drain() {
	if g.addMany != nil {
		g.flushCoalesced()
	}
	g.pending.Wait()
}

// addEarly counts coalesced early polls with the store's EarlyPollCounter.
func (p *Proxy) addEarly(ep earlyPoll) {
	c := p.cfg.Store.(EarlyPollCounter)
	_, err := step(p, "add_early_polls", func(ctx context.Context) (struct{}, error) {
		return struct{}{}, c.AddEarlyPolls(ctx, ep.key, ep.n, ep.at)
	})
	if err != nil {
		p.log.Warn("failed to count early polls", "provider", ep.key.Provider, "job", ep.key.JobID, "n", ep.n, "err", err)
	}
}

// countEarly is the gate's counter: one Reserve at the early poll's own
// time, which the ledger answers TooEarly (counting it) or Terminal.
func (p *Proxy) countEarly(ep earlyPoll) {
	res, err := step(p, "reserve", func(ctx context.Context) (ledger.Reservation, error) {
		return p.cfg.Store.Reserve(ctx, ep.key, p.cfg.HolderID, ep.lease, ep.at)
	})
	switch {
	case err != nil:
		p.log.Warn("failed to count an early poll", "provider", ep.key.Provider, "job", ep.key.JobID, "err", err)
	case res.Outcome == ledger.Reserved:
		// Cannot happen for a remembered waiting schedule (see earlyGate);
		// release the lease at once rather than hold it for nothing.
		p.log.Error("early-poll count reserved a request; releasing it", "op", res.Op.ID)
		op := res.Op.Clone()
		op.Lease.Holder, op.Lease.ExpiresAt = "", time.Time{}
		_, _ = step(p, "complete", func(ctx context.Context) (*rules.Operation, error) {
			e := entry(op, "lease_released", nil, ep.at)
			e.Story = "reservation released unused (early-poll accounting)"
			return p.cfg.Store.Complete(ctx, res, op, e)
		})
		p.gate.forget(ep.key)
	case res.Outcome != ledger.TooEarly:
		p.gate.forget(ep.key)
	}
}
