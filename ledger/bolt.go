package ledger

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterr "go.etcd.io/bbolt/errors"

	"pollgate/audit"
	"pollgate/rules"
)

// BoltOptions configures the embedded ledger.
type BoltOptions struct {
	// Retention is how long terminal operations and their audit chains are
	// kept after their last update before Sweep removes them. Default 7 days.
	Retention time.Duration
	// LockTimeout is how long OpenBolt waits for the data directory's file
	// lock. Default 1s. A second process on the same directory fails after it.
	LockTimeout time.Duration
	// AuditKey encrypts audit entries with AES-256-GCM when set (32 bytes);
	// nil stores them as plaintext JSON.
	AuditKey []byte
	// Logger receives sweeper and commit messages. Default slog.Default().
	Logger *slog.Logger
	// NoSync skips fsync on commit. For tests only: not crash-safe.
	NoSync bool
	// MaxBatch bounds how many concurrent steps share one transaction (group
	// commit). Default 256.
	MaxBatch int
}

// BoltFile is the name of the ledger file inside the data directory.
const BoltFile = "ledger.db"

var (
	bucketOps   = []byte("ops")   // encoded Key -> Operation JSON
	bucketIDs   = []byte("ids")   // operation id -> encoded Key
	bucketSubs  = []byte("subs")  // provider\0account\0request fingerprint -> newest operation id
	bucketAudit = []byte("audit") // operation id -> bucket{ seq (8 bytes BE) -> Envelope JSON }
	// bucketEarly holds early polls added by AddEarlyPolls: encoded Key ->
	// count (8 bytes BE). A record's Used.EarlyPolls is its JSON value plus
	// this count; putOp stores the total minus this count, so the pair stays
	// consistent whoever writes. It keeps a tight-looping agent's early polls
	// to an 8-byte write instead of a record re-encode.
	bucketEarly = []byte("early")
)

// BoltStore is the embedded ledger: one bbolt file in a data directory,
// usable by exactly one process at a time (the file lock enforces it).
//
// Every state-changing step is one bbolt read-write transaction with fsync.
// Concurrent steps are committed together (group commit): a single writer
// goroutine takes every step queued while the previous commit was running and
// applies them one after another inside one transaction, each with its own
// result. A logical refusal (ErrFenceLost, ErrConflict, ...) never aborts the
// batch; a failing transaction fails every step in it with ErrUnavailable and
// none of them is written. Steps run exactly once (unlike bolt.DB.Batch).
type BoltStore struct {
	db        *bolt.DB
	dir       string
	retention time.Duration
	key       []byte
	log       *slog.Logger
	maxBatch  int

	commits, steps atomic.Int64 // group commit statistics

	mu     sync.RWMutex // guards closed and sends on queue
	closed bool
	queue  chan *boltStep
	done   chan struct{}
}

var _ Store = (*BoltStore)(nil)

// boltStep is one queued atomic step. fn returns the step's logical error;
// a *writeFailure aborts the whole transaction.
type boltStep struct {
	fn   func(tx *bolt.Tx) error
	done chan error
}

type writeFailure struct{ err error }

func (w *writeFailure) Error() string { return w.err.Error() }
func (w *writeFailure) Unwrap() error { return w.err }

// OpenBolt opens (creating if needed) the ledger in dir/ledger.db (mode 0600).
// Only one process may use a data directory: a second one gets an error
// naming the directory after opts.LockTimeout.
func OpenBolt(dir string, opts BoltOptions) (*BoltStore, error) {
	if opts.Retention <= 0 {
		opts.Retention = DefaultRetention
	}
	if opts.LockTimeout <= 0 {
		opts.LockTimeout = time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.MaxBatch <= 0 {
		opts.MaxBatch = 256
	}
	if opts.AuditKey != nil && len(opts.AuditKey) != audit.KeySize {
		return nil, fmt.Errorf("failed to open ledger: audit key has %d bytes, want %d", len(opts.AuditKey), audit.KeySize)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, unavailable("create data directory "+dir, err)
	}
	path := filepath.Join(dir, BoltFile)
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: opts.LockTimeout, NoSync: opts.NoSync, NoFreelistSync: true, FreelistType: bolt.FreelistMapType})
	if err != nil {
		if errors.Is(err, bolterr.ErrTimeout) {
			return nil, fmt.Errorf("failed to open ledger in %s: %w: the data directory is locked by another process "+
				"(hint: only one pollgate process may use a data directory with the embedded ledger; "+
				"stop the other one, give this one its own --data-dir, or use Redis for several replicas)", dir, ErrUnavailable)
		}
		return nil, unavailable("open ledger in "+dir, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketOps, bucketIDs, bucketSubs, bucketAudit, bucketEarly} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, unavailable("initialise ledger in "+dir, err)
	}
	s := &BoltStore{
		db: db, dir: dir, retention: opts.Retention, key: opts.AuditKey,
		log: opts.Logger.With("ledger", "bbolt"), maxBatch: opts.MaxBatch,
		queue: make(chan *boltStep, opts.MaxBatch), done: make(chan struct{}),
	}
	go s.commitLoop()
	return s, nil
}

// CommitStats returns how many transactions the writer committed (or tried
// to) and how many steps they carried; steps/commits is the mean group size.
func (s *BoltStore) CommitStats() (commits, steps int64) {
	return s.commits.Load(), s.steps.Load()
}

// Dir returns the data directory.
func (s *BoltStore) Dir() string { return s.dir }

// run queues fn as one atomic step and waits for its commit.
func (s *BoltStore) run(ctx context.Context, what string, fn func(tx *bolt.Tx) error) error {
	st := &boltStep{fn: fn, done: make(chan error, 1)}
	s.mu.RLock()
	if s.closed {
		s.mu.RUnlock()
		return unavailable(what, errClosed)
	}
	select {
	case s.queue <- st:
	case <-ctx.Done():
		s.mu.RUnlock()
		return unavailable(what, ctx.Err())
	}
	s.mu.RUnlock()
	// Once queued, the step runs even if ctx ends: wait for the truth.
	err := <-st.done
	var wf *writeFailure
	if errors.As(err, &wf) {
		return unavailable(what, wf.err)
	}
	return err
}

var errClosed = errors.New("ledger is closed")

// commitLoop is the single writer: it applies every step queued while the
// previous transaction committed in one new transaction.
func (s *BoltStore) commitLoop() {
	defer close(s.done)
	batch := make([]*boltStep, 0, s.maxBatch)
	results := make([]error, 0, s.maxBatch)
	for first := range s.queue {
		batch = append(batch[:0], first)
	drain:
		for len(batch) < s.maxBatch {
			select {
			case st, ok := <-s.queue:
				if !ok {
					break drain
				}
				batch = append(batch, st)
			default:
				break drain
			}
		}
		results = results[:0]
		s.commits.Add(1)
		s.steps.Add(int64(len(batch)))
		txErr := s.db.Update(func(tx *bolt.Tx) error {
			for _, st := range batch {
				err := applyStep(st, tx)
				var wf *writeFailure
				if errors.As(err, &wf) {
					return wf
				}
				results = append(results, err)
			}
			return nil
		})
		for i, st := range batch {
			switch {
			case txErr != nil:
				var wf *writeFailure
				if !errors.As(txErr, &wf) {
					txErr = &writeFailure{txErr}
				}
				st.done <- txErr
			default:
				st.done <- results[i]
			}
		}
		if txErr != nil {
			s.log.Error("ledger commit failed", "steps", len(batch), "err", txErr)
		}
	}
}

// applyStep runs one step, turning a panic into a transaction failure.
func applyStep(st *boltStep, tx *bolt.Tx) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &writeFailure{fmt.Errorf("step panicked: %v", p)}
		}
	}()
	return st.fn(tx)
}

// Close stops the writer after the queued steps and closes the file.
func (s *BoltStore) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.queue)
	s.mu.Unlock()
	<-s.done
	return s.db.Close()
}

// Ping reports whether the ledger file is open and readable.
func (s *BoltStore) Ping(ctx context.Context) error {
	s.mu.RLock()
	closed := s.closed
	s.mu.RUnlock()
	if closed {
		return unavailable("ping ledger", errClosed)
	}
	if err := s.db.View(func(tx *bolt.Tx) error { return nil }); err != nil {
		return unavailable("ping ledger", err)
	}
	return nil
}

// --- encoding helpers -------------------------------------------------------

func encodeKey(k Key) []byte {
	b := make([]byte, 0, len(k.Provider)+len(k.Account)+len(k.JobID)+2)
	b = append(b, k.Provider...)
	b = append(b, 0)
	b = append(b, k.Account...)
	b = append(b, 0)
	return append(b, k.JobID...)
}

func subKey(provider, account, fp string) []byte {
	return []byte(provider + "\x00" + account + "\x00" + fp)
}

func seqKey(seq int64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(seq))
	return b[:]
}

func decodeOp(b []byte) (*rules.Operation, error) {
	op := new(rules.Operation)
	if err := json.Unmarshal(b, op); err != nil {
		return nil, fmt.Errorf("failed to decode operation record: %w", err)
	}
	return op, nil
}

func wf(err error) error {
	if err == nil {
		return nil
	}
	return &writeFailure{err}
}

func loadByKey(tx *bolt.Tx, k Key) (*rules.Operation, error) {
	ek := encodeKey(k)
	b := tx.Bucket(bucketOps).Get(ek)
	if b == nil {
		return nil, ErrNotFound
	}
	return readOp(tx, ek, b)
}

// readOp decodes a stored record and adds its pending early polls.
func readOp(tx *bolt.Tx, encKey, v []byte) (*rules.Operation, error) {
	op, err := decodeOp(v)
	if err != nil {
		return nil, err
	}
	op.Used.EarlyPolls += pendingEarly(tx, encKey)
	return op, nil
}

func pendingEarly(tx *bolt.Tx, encKey []byte) int {
	if v := tx.Bucket(bucketEarly).Get(encKey); len(v) == 8 {
		return int(binary.BigEndian.Uint64(v))
	}
	return 0
}

func loadByID(tx *bolt.Tx, id string) (*rules.Operation, error) {
	k := tx.Bucket(bucketIDs).Get([]byte(id))
	if k == nil {
		return nil, ErrNotFound
	}
	b := tx.Bucket(bucketOps).Get(k)
	if b == nil {
		return nil, ErrNotFound
	}
	return readOp(tx, k, b)
}

// putOp stores op, whose Used.EarlyPolls is the total (as loaded in this
// transaction, plus anything counted since); the pending early-poll count
// kept beside it is subtracted so the next load adds it back exactly once.
func putOp(tx *bolt.Tx, op *rules.Operation) error {
	ek := encodeKey(KeyOf(op))
	rec := *op
	rec.Used.EarlyPolls = max(0, op.Used.EarlyPolls-pendingEarly(tx, ek))
	b, err := json.Marshal(&rec)
	if err != nil {
		return wf(fmt.Errorf("failed to encode operation record: %w", err))
	}
	return wf(tx.Bucket(bucketOps).Put(ek, b))
}

func putEnvelope(tx *bolt.Tx, env audit.Envelope) error {
	b, err := json.Marshal(env)
	if err != nil {
		return wf(fmt.Errorf("failed to encode audit entry: %w", err))
	}
	ab, err := tx.Bucket(bucketAudit).CreateBucketIfNotExists([]byte(env.OperationID))
	if err != nil {
		return wf(err)
	}
	return wf(ab.Put(seqKey(env.Seq), b))
}

// commit seals entry onto op's chain and writes op and the envelope.
func (s *BoltStore) commit(tx *bolt.Tx, op *rules.Operation, entry audit.Entry, now time.Time) error {
	fillEntry(&entry, op, now)
	env, err := seal(op, entry, s.key)
	if err != nil {
		return err
	}
	applyEnvelope(op, env)
	if err := putOp(tx, op); err != nil {
		return err
	}
	return putEnvelope(tx, env)
}

// --- Store ------------------------------------------------------------------

func (s *BoltStore) Create(ctx context.Context, op *rules.Operation, entry audit.Entry) (*rules.Operation, bool, error) {
	if err := validateNew(op); err != nil {
		return nil, false, err
	}
	var out *rules.Operation
	var created bool
	err := s.run(ctx, "create operation", func(tx *bolt.Tx) error {
		if stored, err := loadByKey(tx, KeyOf(op)); err == nil {
			out = stored
			return nil
		} else if !errors.Is(err, ErrNotFound) {
			return err
		}
		if k := tx.Bucket(bucketIDs).Get([]byte(op.ID)); k != nil {
			return fmt.Errorf("operation id %s already names another job: %w", op.ID, ErrConflict)
		}
		n := op.Clone()
		n.AuditHead, n.AuditCount = "", 0
		now := stepTime(entry, n)
		if n.UpdatedAt.IsZero() {
			n.UpdatedAt = now
		}
		if err := s.commit(tx, n, entry, now); err != nil {
			return err
		}
		if err := tx.Bucket(bucketIDs).Put([]byte(n.ID), encodeKey(KeyOf(n))); err != nil {
			return wf(err)
		}
		if n.RequestFingerprint != "" {
			subs := tx.Bucket(bucketSubs)
			sk := subKey(n.Provider, n.Account, n.RequestFingerprint)
			newer := true
			if prevID := subs.Get(sk); prevID != nil {
				if prev, err := loadByID(tx, string(prevID)); err == nil && prev.StartedAt.After(n.StartedAt) {
					newer = false
				}
			}
			if newer {
				if err := subs.Put(sk, []byte(n.ID)); err != nil {
					return wf(err)
				}
			}
		}
		out, created = n, true
		return nil
	})
	if err != nil {
		return nil, false, err
	}
	return out.Clone(), created, nil
}

func (s *BoltStore) view(what string, fn func(tx *bolt.Tx) error) error {
	err := s.db.View(fn)
	if err == nil || errors.Is(err, ErrNotFound) {
		return err
	}
	if errors.Is(err, bolterr.ErrDatabaseNotOpen) {
		return unavailable(what, err)
	}
	return fmt.Errorf("failed to %s: %w", what, err)
}

func (s *BoltStore) Get(ctx context.Context, key Key) (*rules.Operation, error) {
	var op *rules.Operation
	err := s.view("get operation", func(tx *bolt.Tx) (err error) {
		op, err = loadByKey(tx, key)
		return err
	})
	return op, err
}

func (s *BoltStore) GetByID(ctx context.Context, id string) (*rules.Operation, error) {
	var op *rules.Operation
	err := s.view("get operation", func(tx *bolt.Tx) (err error) {
		op, err = loadByID(tx, id)
		return err
	})
	return op, err
}

func (s *BoltStore) FindSubmission(ctx context.Context, provider, account, fp string) (*rules.Operation, error) {
	var op *rules.Operation
	err := s.view("find submission", func(tx *bolt.Tx) (err error) {
		id := tx.Bucket(bucketSubs).Get(subKey(provider, account, fp))
		if id == nil {
			return ErrNotFound
		}
		op, err = loadByID(tx, string(id))
		if err == nil && op.RequestFingerprint != fp {
			return ErrNotFound
		}
		return err
	})
	return op, err
}

func (s *BoltStore) Reserve(ctx context.Context, key Key, holder string, lease time.Duration, now time.Time) (Reservation, error) {
	var res Reservation
	err := s.run(ctx, "reserve", func(tx *bolt.Tx) error {
		op, err := loadByKey(tx, key)
		if errors.Is(err, ErrNotFound) {
			res = Reservation{Outcome: NotFound, Key: key}
			return nil
		}
		if err != nil {
			return err
		}
		r, changed := reserve(op, holder, lease, now)
		if changed {
			if err := putOp(tx, op); err != nil {
				return err
			}
		}
		res = r
		return nil
	})
	if err != nil {
		return Reservation{}, err
	}
	res.Op = res.Op.Clone()
	return res, nil
}

func (s *BoltStore) Complete(ctx context.Context, res Reservation, op *rules.Operation, entry audit.Entry) (*rules.Operation, error) {
	var out *rules.Operation
	err := s.run(ctx, "complete", func(tx *bolt.Tx) error {
		stored, err := loadByKey(tx, res.Key)
		if err != nil {
			return err
		}
		if err := checkFence(stored, res); err != nil {
			return err
		}
		n := completed(stored, op)
		now := stepTime(entry, op)
		n.UpdatedAt = now
		if err := s.commit(tx, n, entry, now); err != nil {
			return err
		}
		out = n
		return nil
	})
	return out.Clone(), err
}

func (s *BoltStore) Escalate(ctx context.Context, key Key, op *rules.Operation, entry audit.Entry) (*rules.Operation, error) {
	var out *rules.Operation
	err := s.run(ctx, "escalate", func(tx *bolt.Tx) error {
		stored, err := loadByKey(tx, key)
		if err != nil {
			return err
		}
		now := stepTime(entry, op)
		if !canEscalate(stored, now) {
			out = stored
			return nil
		}
		n := escalated(stored, op)
		n.UpdatedAt = now
		if err := s.commit(tx, n, entry, now); err != nil {
			return err
		}
		out = n
		return nil
	})
	return out.Clone(), err
}

// Update runs fn inside the ledger's single writer; fn must not call the
// Store (it would wait for itself).
func (s *BoltStore) Update(ctx context.Context, id string, now time.Time, fn func(op *rules.Operation) (audit.Entry, error)) (*rules.Operation, error) {
	var out *rules.Operation
	err := s.run(ctx, "update operation", func(tx *bolt.Tx) error {
		stored, err := loadByID(tx, id)
		if err != nil {
			return err
		}
		n := stored.Clone()
		entry, err := fn(n)
		if err != nil {
			return err
		}
		updated(n, stored)
		n.UpdatedAt = now
		if err := s.commit(tx, n, entry, now); err != nil {
			return err
		}
		out = n
		return nil
	})
	return out.Clone(), err
}

func (s *BoltStore) List(ctx context.Context, f Filter) (Page, error) {
	limit := f.Limit
	if limit <= 0 {
		limit = DefaultListLimit
	}
	limit = min(limit, maxListLimit)
	var after []byte
	if f.Cursor != "" {
		var err error
		if after, err = base64.RawURLEncoding.DecodeString(f.Cursor); err != nil {
			return Page{}, fmt.Errorf("invalid list cursor: %w", err)
		}
	}
	var page Page
	err := s.view("list operations", func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketOps).Cursor()
		var k, v []byte
		if after == nil {
			k, v = c.First()
		} else {
			k, v = c.Seek(after)
			if k != nil && bytes.Equal(k, after) {
				k, v = c.Next()
			}
		}
		for ; k != nil; k, v = c.Next() {
			if f.Provider != "" && !bytes.HasPrefix(k, []byte(f.Provider+"\x00")) {
				continue
			}
			op, err := readOp(tx, k, v)
			if err != nil {
				return err
			}
			if f.Phase != "" && op.Phase != f.Phase {
				continue
			}
			if len(page.Operations) == limit {
				page.Next = base64.RawURLEncoding.EncodeToString(encodeKey(KeyOf(page.Operations[limit-1])))
				return nil
			}
			page.Operations = append(page.Operations, op)
		}
		return nil
	})
	return page, err
}

func (s *BoltStore) Audit(ctx context.Context, id string) ([]audit.Envelope, error) {
	var envs []audit.Envelope
	err := s.view("read audit chain", func(tx *bolt.Tx) error {
		if tx.Bucket(bucketIDs).Get([]byte(id)) == nil {
			return ErrNotFound
		}
		var err error
		envs, err = readChain(tx, id)
		return err
	})
	return envs, err
}

func readChain(tx *bolt.Tx, id string) ([]audit.Envelope, error) {
	ab := tx.Bucket(bucketAudit).Bucket([]byte(id))
	if ab == nil {
		return nil, nil
	}
	var envs []audit.Envelope
	err := ab.ForEach(func(_, v []byte) error {
		var env audit.Envelope
		if err := json.Unmarshal(v, &env); err != nil {
			return fmt.Errorf("failed to decode audit entry: %w", err)
		}
		envs = append(envs, env)
		return nil
	})
	return envs, err
}

// exportChunk bounds how many operations one read transaction exports, so a
// long export never holds a read transaction (and the file's mmap) for long.
const exportChunk = 200

// Export writes every operation's envelopes followed by its head line. Each
// operation is read in one transaction (its chain and head agree).
func (s *BoltStore) Export(ctx context.Context, w io.Writer) error {
	var after []byte
	var buf bytes.Buffer
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		buf.Reset()
		var last []byte
		n := 0
		err := s.view("export audit log", func(tx *bolt.Tx) error {
			c := tx.Bucket(bucketOps).Cursor()
			var k, v []byte
			if after == nil {
				k, v = c.First()
			} else if k, v = c.Seek(after); k != nil && bytes.Equal(k, after) {
				k, v = c.Next()
			}
			for ; k != nil && n < exportChunk; k, v = c.Next() {
				op, err := decodeOp(v)
				if err != nil {
					return err
				}
				envs, err := readChain(tx, op.ID)
				if err != nil {
					return err
				}
				if err := audit.WriteExport(&buf, envs, audit.NewHead(op.ID, op.AuditCount, op.AuditHead)); err != nil {
					return err
				}
				last = append(last[:0], k...)
				n++
			}
			return nil
		})
		if err != nil {
			return err
		}
		if _, err := w.Write(buf.Bytes()); err != nil {
			return fmt.Errorf("failed to write audit export: %w", err)
		}
		if n < exportChunk {
			return nil
		}
		after = last
	}
}

// sweepChunk bounds the deletions of one sweep transaction.
const sweepChunk = 500

// Sweep removes terminal operations whose last update is older than
// now-retention, with their audit chains and index entries.
func (s *BoltStore) Sweep(ctx context.Context, now time.Time) (int, error) {
	cutoff := now.Add(-s.retention)
	total := 0
	for {
		removed := 0
		err := s.run(ctx, "sweep ledger", func(tx *bolt.Tx) error {
			removed = 0
			var victims []*rules.Operation
			c := tx.Bucket(bucketOps).Cursor()
			for k, v := c.First(); k != nil && len(victims) < sweepChunk; k, v = c.Next() {
				op, err := decodeOp(v)
				if err != nil {
					return err
				}
				if op.Phase.Terminal() && op.UpdatedAt.Before(cutoff) {
					victims = append(victims, op)
				}
			}
			for _, op := range victims {
				if err := tx.Bucket(bucketOps).Delete(encodeKey(KeyOf(op))); err != nil {
					return wf(err)
				}
				if err := tx.Bucket(bucketEarly).Delete(encodeKey(KeyOf(op))); err != nil {
					return wf(err)
				}
				if err := tx.Bucket(bucketIDs).Delete([]byte(op.ID)); err != nil {
					return wf(err)
				}
				if op.RequestFingerprint != "" {
					sk := subKey(op.Provider, op.Account, op.RequestFingerprint)
					if id := tx.Bucket(bucketSubs).Get(sk); id != nil && string(id) == op.ID {
						if err := tx.Bucket(bucketSubs).Delete(sk); err != nil {
							return wf(err)
						}
					}
				}
				if tx.Bucket(bucketAudit).Bucket([]byte(op.ID)) != nil {
					if err := tx.Bucket(bucketAudit).DeleteBucket([]byte(op.ID)); err != nil {
						return wf(err)
					}
				}
			}
			removed = len(victims)
			return nil
		})
		total += removed
		if err != nil || removed < sweepChunk {
			return total, err
		}
	}
}

// RunSweeper calls Sweep every interval until ctx ends, logging what it
// removed. now is the process clock (time.Now in production).
func (s *BoltStore) RunSweeper(ctx context.Context, every time.Duration, now func() time.Time) {
	runSweeper(ctx, s, s.log, every, now)
}

func runSweeper(ctx context.Context, st Store, log *slog.Logger, every time.Duration, now func() time.Time) {
	if every <= 0 {
		every = time.Hour
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		n, err := st.Sweep(ctx, now())
		switch {
		case err != nil && ctx.Err() == nil:
			log.Warn("ledger sweep failed", "err", err)
		case n > 0:
			log.Info("ledger sweep removed expired operations", "removed", n)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// AddEarlyPolls counts n early polls of one operation in one step: an
// 8-byte counter beside the record (see bucketEarly), no record re-encode.
func (s *BoltStore) AddEarlyPolls(ctx context.Context, key Key, n int, now time.Time) error {
	if n <= 0 {
		return nil
	}
	return s.run(ctx, "add_early_polls", func(tx *bolt.Tx) error {
		ek := encodeKey(key)
		if tx.Bucket(bucketOps).Get(ek) == nil {
			return fmt.Errorf("add early polls for job %s of %s: %w", key.JobID, key.Provider, ErrNotFound)
		}
		var v [8]byte
		binary.BigEndian.PutUint64(v[:], uint64(pendingEarly(tx, ek)+n))
		return wf(tx.Bucket(bucketEarly).Put(ek, v[:]))
	})
}

var _ EarlyPollCounter = (*BoltStore)(nil)
