package ledger

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"pollgate/audit"
	"pollgate/rules"
)

// Redis backend.
//
// Redis settings pollgate needs (a Redis that loses writes is a budget that
// resets, R11):
//
//	appendonly yes              # durability across restarts
//	appendfsync everysec        # at most ~1s of writes lost on a crash ("always" to lose none)
//	maxmemory-policy noeviction # never evict an operation; writes fail instead (ErrUnavailable)
//
// OpenRedis checks appendonly and maxmemory-policy and logs a warning when
// they are unsafe (it tolerates CONFIG being disabled). Replication is
// asynchronous: a failover can lose the last writes.
//
// Keys (prefix default "pg"):
//
//	pg:{<op-key>}:op     hash: the record (see lua.go)
//	pg:{<op-key>}:audit  list: the audit envelopes in chain order
//	pg:{idx}:id:<id>     string: operation id -> op-key
//	pg:{idx}:ops         sorted set: every op-key (List, Export, Sweep)
//	pg:{idx}:sub:<hash>  sorted set: op-keys by started_at for one provider+account+request fingerprint
//
// op-key is hex(SHA-256(provider \0 account \0 job id))[:32]. The hot path
// (Reserve, Complete, Escalate: one script each, one round trip) touches only
// the operation's own slot. The indexes live in the {idx} slot and are
// written by Create in a separate script before the record; the trade-off:
// a crash between the two leaves an index entry without a record (harmless:
// every index hit is checked against the record's own id, and the entry
// expires), never a record missing from the indexes. The {idx} slot is
// written once per operation, so it is no hot spot; its keys expire
// (deadline + retention + 7 days), and Sweep prunes the registry.

// RedisOptions configures the Redis ledger.
type RedisOptions struct {
	// Retention is how long terminal operations and their audit chains are
	// kept (a PEXPIRE on their keys). Default 7 days.
	Retention time.Duration
	// AuditKey encrypts audit entries with AES-256-GCM when set (32 bytes).
	AuditKey []byte
	// Logger receives configuration warnings. Default slog.Default().
	Logger *slog.Logger
	// Prefix starts every key. Default "pg". It must not contain '{' or '}'
	// (the hash tags that keep an operation's keys in one Cluster slot).
	Prefix string
}

// RedisStore is the Redis ledger, shared by any number of proxy replicas.
type RedisStore struct {
	c         redis.UniversalClient
	prefix    string
	retention time.Duration
	key       []byte
	log       *slog.Logger

	mu       sync.Mutex
	suspects map[string]bool // registry entries without a record at the last Sweep
}

var _ Store = (*RedisStore)(nil)

// maxCAS bounds the retries of a write whose audit position moved. A
// "moved" reply carries the fresh record, so a retry costs one round trip.
// Lease holders (Complete, Escalate) retry at once; admin Updates yield with
// a short jittered pause (updateYield), so a poll's result is not starved
// by a burst of admin steps on the same operation.
const maxCAS = 64

// updateYield is how long an Update waits before its attempt-th retry.
func updateYield(attempt int) time.Duration {
	ceiling := min(time.Duration(attempt)*200*time.Microsecond, 5*time.Millisecond)
	return time.Duration(rand.Int64N(int64(ceiling) + 1))
}

// indexSlack keeps index entries beyond the deadline and retention, for
// operations whose deadline is extended.
const indexSlack = 7 * 24 * time.Hour

// NewRedisStore returns a store on an existing client (*redis.Client,
// *redis.ClusterClient or a failover client; not a Ring, which would split
// an operation's keys). It does no I/O and loads no scripts (they load on
// first use); Close closes the client.
func NewRedisStore(c redis.UniversalClient, opts RedisOptions) *RedisStore {
	if opts.Retention <= 0 {
		opts.Retention = DefaultRetention
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Prefix == "" {
		opts.Prefix = "pg"
	}
	return &RedisStore{c: c, prefix: opts.Prefix, retention: opts.Retention, key: opts.AuditKey,
		log: opts.Logger.With("ledger", "redis")}
}

// OpenRedis connects to url, checks that the server answers, warns about
// unsafe settings and loads the scripts. url is
//
//	redis://[:password@]host:port/db            one server (rediss:// for TLS)
//	redis+cluster://[:password@]host:port?addr=host2:port&addr=host3:port
//	                                            Redis Cluster (seed nodes; rediss+cluster:// for TLS)
//
// Errors never contain the URL (it may carry a password).
func OpenRedis(ctx context.Context, url string, opts RedisOptions) (*RedisStore, error) {
	if opts.AuditKey != nil && len(opts.AuditKey) != audit.KeySize {
		return nil, fmt.Errorf("failed to open ledger: audit key has %d bytes, want %d", len(opts.AuditKey), audit.KeySize)
	}
	if strings.ContainsAny(opts.Prefix, "{}") {
		return nil, fmt.Errorf("failed to open ledger: key prefix %q must not contain '{' or '}'", opts.Prefix)
	}
	const hint = "hint: redis://[:password@]host:port/db, rediss://..., or redis+cluster://host:port?addr=host2:port"
	var c redis.UniversalClient
	var where string
	if scheme, rest, ok := strings.Cut(url, "+cluster://"); ok && (scheme == "redis" || scheme == "rediss") {
		o, err := redis.ParseClusterURL(scheme + "://" + rest)
		if err != nil {
			return nil, errors.New("failed to open ledger: invalid Redis Cluster URL (" + hint + ")")
		}
		c, where = redis.NewClusterClient(o), "cluster "+strings.Join(o.Addrs, ",")
	} else {
		o, err := redis.ParseURL(url)
		if err != nil {
			return nil, errors.New("failed to open ledger: invalid Redis URL (" + hint + ")")
		}
		c, where = redis.NewClient(o), o.Addr
	}
	s := NewRedisStore(c, opts)
	if err := s.Ping(ctx); err != nil {
		s.c.Close()
		return nil, fmt.Errorf("failed to open ledger at %s: %w", where, err)
	}
	s.CheckConfig(ctx)
	for _, sc := range []*redis.Script{reserveScript, completeScript, escalateScript, updateScript, createScript, indexScript, sweepScript, exportScript} {
		if err := sc.Load(ctx, s.c).Err(); err != nil {
			s.c.Close()
			return nil, unavailable("load ledger scripts", err)
		}
	}
	return s, nil
}

// CheckConfig logs a warning when the server may lose or evict operations.
// It is silent when CONFIG is disabled (managed Redis).
func (s *RedisStore) CheckConfig(ctx context.Context) []string {
	var warnings []string
	cfg, err := s.c.ConfigGet(ctx, "maxmemory-policy").Result()
	if err != nil {
		s.log.Debug("cannot read Redis config; check maxmemory-policy and appendonly yourself", "err", err)
		return nil
	}
	if p, ok := cfg["maxmemory-policy"]; ok && p != "noeviction" {
		warnings = append(warnings, fmt.Sprintf("maxmemory-policy is %q: Redis may evict operations and reset their budgets (R11); set maxmemory-policy noeviction", p))
	}
	if cfg, err := s.c.ConfigGet(ctx, "appendonly").Result(); err == nil {
		if v, ok := cfg["appendonly"]; ok && v != "yes" {
			warnings = append(warnings, "appendonly is off: a Redis restart loses operations and resets their budgets (R11); set appendonly yes, appendfsync everysec")
		}
	}
	for _, w := range warnings {
		s.log.Warn("unsafe Redis setting for the ledger", "problem", w)
	}
	return warnings
}

func (s *RedisStore) Ping(ctx context.Context) error {
	if err := s.c.Ping(ctx).Err(); err != nil {
		return unavailable("reach Redis", err)
	}
	return nil
}

func (s *RedisStore) Close() error { return s.c.Close() }

// --- keys and encoding --------------------------------------------------------

func opKeyOf(k Key) string {
	h := sha256.Sum256([]byte(k.Provider + "\x00" + k.Account + "\x00" + k.JobID))
	return hex.EncodeToString(h[:16])
}

func (s *RedisStore) opHash(h string) string    { return s.prefix + ":{" + h + "}:op" }
func (s *RedisStore) auditList(h string) string { return s.prefix + ":{" + h + "}:audit" }
func (s *RedisStore) idKey(id string) string    { return s.prefix + ":{idx}:id:" + id }
func (s *RedisStore) registry() string          { return s.prefix + ":{idx}:ops" }
func (s *RedisStore) subIndex(provider, account, fp string) string {
	h := sha256.Sum256([]byte(provider + "\x00" + account + "\x00" + fp))
	return s.prefix + ":{idx}:sub:" + hex.EncodeToString(h[:16])
}

func micros(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMicro()
}

func text(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339Nano)
}

func parseText(s string) time.Time {
	t, _ := time.Parse(time.RFC3339Nano, s)
	return t
}

// decodeHash builds a record from HGETALL output (field, value, ...).
func decodeHash(v []any) (*rules.Operation, error) {
	f := make(map[string]string, len(v)/2)
	for i := 0; i+1 < len(v); i += 2 {
		k, _ := v[i].(string)
		f[k], _ = v[i+1].(string)
	}
	return decodeFields(f)
}

func decodeFields(f map[string]string) (*rules.Operation, error) {
	rec, ok := f["rec"]
	if !ok {
		return nil, ErrNotFound
	}
	op, err := decodeOp([]byte(rec))
	if err != nil {
		return nil, err
	}
	num := func(k string) int64 { n, _ := strconv.ParseInt(f[k], 10, 64); return n }
	op.Used.StatusRequests = int(num("used"))
	op.Used.EarlyPolls = int(num("early"))
	op.Lease = rules.Lease{Holder: f["holder"], Fence: num("fence"), ExpiresAt: parseText(f["lexpt"])}
	op.UpdatedAt = parseText(f["upd"])
	op.AuditCount = num("acount")
	op.AuditHead = f["ahead"]
	return op, nil
}

// writeArgs are ARGV[1..12] of the writing scripts (see luaWrite in
// lua.go), for n sealed with env.
func (s *RedisStore) writeArgs(n *rules.Operation, env audit.Envelope) ([]any, error) {
	committed := n.Clone()
	applyEnvelope(committed, env)
	rec, err := json.Marshal(committed)
	if err != nil {
		return nil, fmt.Errorf("failed to encode operation record: %w", err)
	}
	envJSON, err := json.Marshal(env)
	if err != nil {
		return nil, fmt.Errorf("failed to encode audit entry: %w", err)
	}
	var ttl int64
	if n.Phase.Terminal() {
		ttl = max(s.retention.Milliseconds(), 1)
	}
	return []any{
		strconv.FormatInt(n.AuditCount, 10), n.AuditHead,
		rec, string(n.Phase), micros(n.DeadlineAt), micros(n.NextPollAt), n.Budget.StatusRequests,
		text(n.UpdatedAt), micros(n.UpdatedAt), envJSON, env.Hash, ttl,
	}, nil
}

func status(v []any) string {
	if len(v) == 0 {
		return ""
	}
	s, _ := v[0].(string)
	return s
}

func str(v []any, i int) string {
	if i >= len(v) {
		return ""
	}
	s, _ := v[i].(string)
	return s
}

// moved reloads the expected audit position from a {"moved", HGETALL...} reply.
func moved(v []any) (*rules.Operation, error) {
	op, err := decodeHash(v[1:])
	if err != nil {
		return nil, fmt.Errorf("failed to reload operation: %w", err)
	}
	return op, nil
}

// --- Store --------------------------------------------------------------------

func (s *RedisStore) Create(ctx context.Context, op *rules.Operation, entry audit.Entry) (*rules.Operation, bool, error) {
	if err := validateNew(op); err != nil {
		return nil, false, err
	}
	n := op.Clone()
	n.AuditHead, n.AuditCount = "", 0
	now := stepTime(entry, n)
	if n.UpdatedAt.IsZero() {
		n.UpdatedAt = now
	}
	h := opKeyOf(KeyOf(n))
	ttl := s.retention + indexSlack
	if !n.DeadlineAt.IsZero() && !now.IsZero() {
		ttl = max(n.DeadlineAt.Sub(now), 0) + s.retention + indexSlack
	}
	hasSub := "0"
	if n.RequestFingerprint != "" {
		hasSub = "1"
	}
	idxKeys := []string{s.idKey(n.ID), s.registry(), s.subIndex(n.Provider, n.Account, n.RequestFingerprint)}
	idxArgs := []any{h, ttl.Milliseconds(), micros(n.StartedAt), hasSub, "0"}
	v, err := indexScript.Run(ctx, s.c, idxKeys, idxArgs...).Slice()
	if err != nil {
		return nil, false, unavailable("index operation", err)
	}
	if status(v) == "conflict" {
		other := str(v, 1)
		// The same job already stored: Create is idempotent per key.
		if stored, err := s.load(ctx, h); err == nil {
			return stored, false, nil
		} else if !errors.Is(err, ErrNotFound) {
			return nil, false, err
		}
		otherID, err := s.c.HGet(ctx, s.opHash(other), "id").Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, false, unavailable("check operation id", err)
		}
		if otherID == n.ID {
			return nil, false, fmt.Errorf("operation id %s already names another job: %w", n.ID, ErrConflict)
		}
		idxArgs[4] = "1" // the id's old operation is gone: take it over
		if err := indexScript.Run(ctx, s.c, idxKeys, idxArgs...).Err(); err != nil {
			return nil, false, unavailable("index operation", err)
		}
	}

	fillEntry(&entry, n, now)
	env, err := seal(n, entry, s.key)
	if err != nil {
		return nil, false, err
	}
	args, err := s.writeArgs(n, env)
	if err != nil {
		return nil, false, err
	}
	args = append(args, n.ID, n.Used.StatusRequests, n.Used.EarlyPolls, n.Lease.Fence,
		n.Lease.Holder, micros(n.Lease.ExpiresAt), text(n.Lease.ExpiresAt))
	v, err = createScript.Run(ctx, s.c, []string{s.opHash(h), s.auditList(h)}, args...).Slice()
	if err != nil {
		return nil, false, unavailable("create operation", err)
	}
	if status(v) == "exists" {
		stored, err := decodeHash(v[1:])
		return stored, false, err
	}
	applyEnvelope(n, env)
	return n, true, nil
}

// load reads one operation by op-key.
func (s *RedisStore) load(ctx context.Context, h string) (*rules.Operation, error) {
	f, err := s.c.HGetAll(ctx, s.opHash(h)).Result()
	if err != nil {
		return nil, unavailable("load operation", err)
	}
	return decodeFields(f)
}

func (s *RedisStore) Get(ctx context.Context, key Key) (*rules.Operation, error) {
	return s.load(ctx, opKeyOf(key))
}

// lookupID resolves an operation id to its op-key.
func (s *RedisStore) lookupID(ctx context.Context, id string) (string, error) {
	h, err := s.c.Get(ctx, s.idKey(id)).Result()
	if errors.Is(err, redis.Nil) {
		return "", ErrNotFound
	}
	if err != nil {
		return "", unavailable("look up operation id", err)
	}
	return h, nil
}

func (s *RedisStore) GetByID(ctx context.Context, id string) (*rules.Operation, error) {
	h, err := s.lookupID(ctx, id)
	if err != nil {
		return nil, err
	}
	op, err := s.load(ctx, h)
	if err != nil {
		return nil, err
	}
	if op.ID != id { // an id claimed by a creator that lost the race
		return nil, ErrNotFound
	}
	return op, nil
}

func (s *RedisStore) FindSubmission(ctx context.Context, provider, account, fp string) (*rules.Operation, error) {
	hs, err := s.c.ZRevRange(ctx, s.subIndex(provider, account, fp), 0, 9).Result()
	if err != nil {
		return nil, unavailable("find submission", err)
	}
	for _, h := range hs {
		op, err := s.load(ctx, h)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if op.Provider == provider && op.Account == account && op.RequestFingerprint == fp {
			return op, nil
		}
	}
	return nil, ErrNotFound
}

func (s *RedisStore) Reserve(ctx context.Context, key Key, holder string, lease time.Duration, now time.Time) (Reservation, error) {
	h := opKeyOf(key)
	exp := now.Add(lease)
	v, err := reserveScript.Run(ctx, s.c, []string{s.opHash(h)},
		micros(now), micros(exp), text(exp), holder, text(now)).Slice()
	if err != nil {
		return Reservation{}, unavailable("reserve", err)
	}
	out := Outcome(status(v))
	if out == "not_found" {
		return Reservation{Outcome: NotFound, Key: key}, nil
	}
	op, err := decodeHash(v[1:])
	if err != nil {
		return Reservation{}, err
	}
	res := Reservation{Outcome: out, Op: op, Key: key}
	switch out {
	case Reserved:
		res.Fence = op.Lease.Fence
		op.Lease.ExpiresAt = exp // exact, not the stored text's rounding
	case TooEarly:
		res.Wait = op.NextPollAt.Sub(now)
	case Busy:
		res.Wait = op.Lease.ExpiresAt.Sub(now)
	case Terminal, DeadlineReached, BudgetExhausted:
	default:
		return Reservation{}, fmt.Errorf("failed to reserve: unexpected script outcome %q", out)
	}
	return res, nil
}

func (s *RedisStore) Complete(ctx context.Context, res Reservation, op *rules.Operation, entry audit.Entry) (*rules.Operation, error) {
	if res.Outcome != Reserved || res.Op == nil {
		return nil, fmt.Errorf("%w: complete needs a reservation with outcome %q, got %q", ErrConflict, Reserved, res.Outcome)
	}
	h := opKeyOf(res.Key)
	base := res.Op
	now := stepTime(entry, op)
	for range maxCAS {
		n := completed(base, op)
		n.UpdatedAt = now
		e := entry
		fillEntry(&e, n, now)
		env, err := seal(n, e, s.key)
		if err != nil {
			return nil, err
		}
		args, err := s.writeArgs(n, env)
		if err != nil {
			return nil, err
		}
		args = append(args, strconv.FormatInt(res.Fence, 10), n.Used.StatusRequests)
		v, err := completeScript.Run(ctx, s.c, []string{s.opHash(h), s.auditList(h)}, args...).Slice()
		if err != nil {
			return nil, unavailable("complete", err)
		}
		switch status(v) {
		case "ok":
			// The stored record is n with the counters Reserve owns.
			n.Used.StatusRequests, _ = strconv.Atoi(str(v, 1))
			n.Used.EarlyPolls, _ = strconv.Atoi(str(v, 2))
			n.Lease = rules.Lease{Fence: res.Fence}
			applyEnvelope(n, env)
			return n, nil
		case "not_found":
			return nil, ErrNotFound
		case "fence_lost":
			return nil, fmt.Errorf("operation %s fence %d (stored %s): %w", base.ID, res.Fence, str(v, 1), ErrFenceLost)
		case "phase_changed":
			return nil, fmt.Errorf("operation %s is %s: %w", base.ID, str(v, 1), errPhaseChanged)
		case "moved":
			if base, err = moved(v); err != nil {
				return nil, err
			}
		default:
			return nil, fmt.Errorf("failed to complete: unexpected script reply %q", status(v))
		}
	}
	return nil, fmt.Errorf("failed to complete operation %s: the audit chain kept moving: %w", res.Op.ID, ErrConflict)
}

func (s *RedisStore) Escalate(ctx context.Context, key Key, op *rules.Operation, entry audit.Entry) (*rules.Operation, error) {
	h := opKeyOf(key)
	base := op
	now := stepTime(entry, op)
	for range maxCAS {
		n := escalated(base, op)
		n.UpdatedAt = now
		e := entry
		fillEntry(&e, n, now)
		env, err := seal(n, e, s.key)
		if err != nil {
			return nil, err
		}
		args, err := s.writeArgs(n, env)
		if err != nil {
			return nil, err
		}
		args = append(args, micros(now), n.Used.StatusRequests)
		v, err := escalateScript.Run(ctx, s.c, []string{s.opHash(h), s.auditList(h)}, args...).Slice()
		if err != nil {
			return nil, unavailable("escalate", err)
		}
		switch status(v) {
		case "ok":
			return decodeHash(v[1:])
		case "not_found":
			return nil, ErrNotFound
		case "noop":
			return decodeHash(v[1:])
		case "moved":
			if base, err = moved(v); err != nil {
				return nil, err
			}
		default:
			return nil, fmt.Errorf("failed to escalate: unexpected script reply %q", status(v))
		}
	}
	return nil, fmt.Errorf("failed to escalate operation %s: the audit chain kept moving: %w", op.ID, ErrConflict)
}

// Update is an optimistic read-modify-write: fn may run more than once when
// another step changes the record meanwhile, so it must have no side effects
// beyond the record it is given.
func (s *RedisStore) Update(ctx context.Context, id string, now time.Time, fn func(op *rules.Operation) (audit.Entry, error)) (*rules.Operation, error) {
	stored, err := s.GetByID(ctx, id)
	if err != nil {
		return nil, err
	}
	h := opKeyOf(KeyOf(stored))
	for attempt := range maxCAS {
		if attempt > 0 {
			select {
			case <-time.After(updateYield(attempt)):
			case <-ctx.Done():
				return nil, unavailable("update operation", ctx.Err())
			}
		}
		n := stored.Clone()
		entry, err := fn(n)
		if err != nil {
			return nil, err
		}
		updated(n, stored)
		n.UpdatedAt = now
		fillEntry(&entry, n, now)
		env, err := seal(n, entry, s.key)
		if err != nil {
			return nil, err
		}
		args, err := s.writeArgs(n, env)
		if err != nil {
			return nil, err
		}
		v, err := updateScript.Run(ctx, s.c, []string{s.opHash(h), s.auditList(h)}, args...).Slice()
		if err != nil {
			return nil, unavailable("update operation", err)
		}
		switch status(v) {
		case "ok":
			if n.DeadlineAt.After(stored.DeadlineAt) {
				// Keep the id index alive as long as the extended operation (best effort).
				ttl := max(n.DeadlineAt.Sub(now), 0) + s.retention + indexSlack
				if err := s.c.PExpire(ctx, s.idKey(id), ttl).Err(); err != nil {
					s.log.Warn("failed to extend the id index expiry", "op", id, "err", err)
				}
			}
			return decodeHash(v[1:])
		case "not_found":
			return nil, ErrNotFound
		case "moved":
			if stored, err = moved(v); err != nil {
				return nil, err
			}
		default:
			return nil, fmt.Errorf("failed to update: unexpected script reply %q", status(v))
		}
	}
	return nil, fmt.Errorf("failed to update operation %s: the record kept changing: %w", id, ErrConflict)
}

// scanRegistry pages through the registry of op-keys after cursor (exclusive).
func (s *RedisStore) scanRegistry(ctx context.Context, after string, count int64) ([]string, error) {
	lo := "-"
	if after != "" {
		lo = "(" + after
	}
	hs, err := s.c.ZRangeByLex(ctx, s.registry(), &redis.ZRangeBy{Min: lo, Max: "+", Count: count}).Result()
	if err != nil {
		return nil, unavailable("list operations", err)
	}
	return hs, nil
}

// loadMany reads several operations in one pipeline; absent ones are nil.
func (s *RedisStore) loadMany(ctx context.Context, hs []string) ([]*rules.Operation, error) {
	cmds := make([]*redis.MapStringStringCmd, len(hs))
	_, err := s.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, h := range hs {
			cmds[i] = p.HGetAll(ctx, s.opHash(h))
		}
		return nil
	})
	if err != nil {
		return nil, unavailable("load operations", err)
	}
	ops := make([]*rules.Operation, len(hs))
	for i, c := range cmds {
		op, err := decodeFields(c.Val())
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		ops[i] = op
	}
	return ops, nil
}

const scanBatch = 200

func (s *RedisStore) List(ctx context.Context, f Filter) (Page, error) {
	limit := f.Limit
	if limit <= 0 {
		limit = DefaultListLimit
	}
	limit = min(limit, maxListLimit)
	after := ""
	if f.Cursor != "" {
		b, err := base64.RawURLEncoding.DecodeString(f.Cursor)
		if err != nil {
			return Page{}, fmt.Errorf("invalid list cursor: %w", err)
		}
		after = string(b)
	}
	var page Page
	var lastKey string
	for {
		hs, err := s.scanRegistry(ctx, after, scanBatch)
		if err != nil {
			return Page{}, err
		}
		ops, err := s.loadMany(ctx, hs)
		if err != nil {
			return Page{}, err
		}
		for i, op := range ops {
			if op == nil || (f.Phase != "" && op.Phase != f.Phase) || (f.Provider != "" && op.Provider != f.Provider) {
				continue
			}
			if len(page.Operations) == limit {
				page.Next = base64.RawURLEncoding.EncodeToString([]byte(lastKey))
				return page, nil
			}
			page.Operations = append(page.Operations, op)
			lastKey = hs[i]
		}
		if len(hs) < scanBatch {
			return page, nil
		}
		after = hs[len(hs)-1]
	}
}

// chain reads an operation's id, head and envelopes atomically.
func (s *RedisStore) chain(ctx context.Context, h string) (id string, head audit.Head, envs []audit.Envelope, err error) {
	v, err := exportScript.Run(ctx, s.c, []string{s.opHash(h), s.auditList(h)}).Slice()
	if err != nil {
		return "", head, nil, unavailable("read audit chain", err)
	}
	if len(v) < 3 {
		return "", head, nil, ErrNotFound
	}
	id = str(v, 0)
	count, _ := strconv.ParseInt(str(v, 1), 10, 64)
	head = audit.NewHead(id, count, str(v, 2))
	for i := 3; i < len(v); i++ {
		var env audit.Envelope
		if err := json.Unmarshal([]byte(str(v, i)), &env); err != nil {
			return "", head, nil, fmt.Errorf("failed to decode audit entry: %w", err)
		}
		envs = append(envs, env)
	}
	return id, head, envs, nil
}

func (s *RedisStore) Audit(ctx context.Context, id string) ([]audit.Envelope, error) {
	h, err := s.lookupID(ctx, id)
	if err != nil {
		return nil, err
	}
	got, _, envs, err := s.chain(ctx, h)
	if err != nil {
		return nil, err
	}
	if got != id {
		return nil, ErrNotFound
	}
	return envs, nil
}

// Export writes every operation's envelopes and head; each operation is read
// in one atomic step.
func (s *RedisStore) Export(ctx context.Context, w io.Writer) error {
	after := ""
	for {
		hs, err := s.scanRegistry(ctx, after, scanBatch)
		if err != nil {
			return err
		}
		for _, h := range hs {
			_, head, envs, err := s.chain(ctx, h)
			if errors.Is(err, ErrNotFound) {
				continue
			}
			if err != nil {
				return err
			}
			if err := audit.WriteExport(w, envs, head); err != nil {
				return err
			}
		}
		if len(hs) < scanBatch {
			return nil
		}
		after = hs[len(hs)-1]
	}
}

// Sweep removes terminal operations whose last update is older than
// now-retention (Redis expiry normally does this first; Sweep also covers a
// changed retention) and prunes registry entries of vanished operations. An
// entry is pruned only when its operation was missing in the previous Sweep
// too, so an operation being created (index written, record not yet) is
// never dropped from the registry.
func (s *RedisStore) Sweep(ctx context.Context, now time.Time) (int, error) {
	cutoff := micros(now.Add(-s.retention))
	if err := sweepScript.Load(ctx, s.c).Err(); err != nil {
		return 0, unavailable("sweep ledger", err)
	}
	s.mu.Lock()
	previous := s.suspects
	s.mu.Unlock()
	suspects := map[string]bool{}
	removed := 0
	after := ""
	for {
		hs, err := s.scanRegistry(ctx, after, scanBatch)
		if err != nil {
			return removed, err
		}
		swept := make([]*redis.Cmd, len(hs))
		exists := make([]*redis.IntCmd, len(hs))
		_, err = s.c.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, h := range hs {
				swept[i] = p.EvalSha(ctx, sweepScript.Hash(), []string{s.opHash(h), s.auditList(h)}, cutoff)
				exists[i] = p.Exists(ctx, s.opHash(h))
			}
			return nil
		})
		if err != nil {
			return removed, unavailable("sweep ledger", err)
		}
		var gone []any
		for i, h := range hs {
			if n, _ := swept[i].Int(); n == 1 {
				removed++
				gone = append(gone, h)
			} else if exists[i].Val() == 0 {
				if previous[h] {
					gone = append(gone, h)
				} else {
					suspects[h] = true
				}
			}
		}
		if len(gone) > 0 {
			if err := s.c.ZRem(ctx, s.registry(), gone...).Err(); err != nil {
				return removed, unavailable("sweep ledger", err)
			}
		}
		if len(hs) < scanBatch {
			break
		}
		after = hs[len(hs)-1]
	}
	s.mu.Lock()
	s.suspects = suspects
	s.mu.Unlock()
	return removed, nil
}

// RunSweeper calls Sweep every interval until ctx ends.
func (s *RedisStore) RunSweeper(ctx context.Context, every time.Duration, now func() time.Time) {
	runSweeper(ctx, s, s.log, every, now)
}

// AddEarlyPolls counts n early polls of one operation in one script call.
func (s *RedisStore) AddEarlyPolls(ctx context.Context, key Key, n int, now time.Time) error {
	if n <= 0 {
		return nil
	}
	v, err := addEarlyScript.Run(ctx, s.c, []string{s.opHash(opKeyOf(key))}, n, micros(now), text(now)).Slice()
	if err != nil {
		return unavailable("add_early_polls", err)
	}
	if status(v) == "not_found" {
		return fmt.Errorf("add early polls for job %s of %s: %w", key.JobID, key.Provider, ErrNotFound)
	}
	return nil
}

var _ EarlyPollCounter = (*RedisStore)(nil)
