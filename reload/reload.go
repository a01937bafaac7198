// Package reload owns live reloading of the provider contract: on SIGHUP and
// when the file changes (polled by modification time and size, confirmed by
// a hash of the bytes), the file is parsed and validated; a valid contract
// replaces the active one with one atomic pointer swap, so a request that
// already loaded the old contract finishes on it. An invalid file is
// rejected with every problem logged, and the old contract stays active.
//
// reload never touches operation records: an operation's deadline and
// budgets are fixed on the record when it is created (and raised only by an
// extension), so a new contract's policy applies to new operations and to the
// state tables of later responses, never to authorized limits.
package reload

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"pollgate/rules"
)

// Outcomes of one reload attempt (also the metric label values).
const (
	Applied   = "applied"   // a new valid contract is active
	Unchanged = "unchanged" // the file holds the active contract
	Rejected  = "error"     // the file could not be read or is invalid; the old contract stays
)

// Config configures a Reloader.
type Config struct {
	// Path is the contract file. Required.
	Path string
	// Contract is the active contract pointer that the proxy loads per request. Required.
	Contract *atomic.Pointer[rules.Contract]
	// Parse validates file bytes; default rules.Parse. name is the file's base name.
	Parse func(name string, data []byte) (*rules.Contract, error)
	// Interval is how often the file is checked for changes. Default 2s;
	// negative disables polling (SIGHUP and Reload still work).
	Interval time.Duration
	// Signals triggers a reload per value received. Default: SIGHUP,
	// subscribed in Run.
	Signals <-chan os.Signal
	// OnReload is called after every attempt with its outcome and the
	// active contract afterwards. May be nil.
	OnReload func(outcome string, active *rules.Contract)
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Reloader watches one contract file. Safe for concurrent use.
type Reloader struct {
	cfg Config

	mu       sync.Mutex // serialises attempts
	fi       os.FileInfo
	seenHash string // hash of the bytes last considered (valid or not)
}

// New checks cfg and remembers the file's current state, so the first poll
// reloads only when the file changes after New.
func New(cfg Config) (*Reloader, error) {
	if cfg.Path == "" {
		return nil, errors.New("no contract file to watch (hint: pass --config or set POLLGATE_CONFIG)")
	}
	if cfg.Contract == nil {
		return nil, errors.New("reload: no contract pointer")
	}
	if cfg.Parse == nil {
		cfg.Parse = rules.Parse
	}
	if cfg.Interval == 0 {
		cfg.Interval = 2 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	r := &Reloader{cfg: cfg}
	r.fi, _ = os.Stat(cfg.Path)
	if c := cfg.Contract.Load(); c != nil {
		r.seenHash = c.Hash
	}
	return r, nil
}

// Run reloads on every signal and polls the file until ctx ends.
func (r *Reloader) Run(ctx context.Context) {
	sigs := r.cfg.Signals
	if sigs == nil {
		ch := make(chan os.Signal, 1)
		signal.Notify(ch, syscall.SIGHUP)
		defer signal.Stop(ch)
		sigs = ch
	}
	var tick <-chan time.Time
	if r.cfg.Interval > 0 {
		t := time.NewTicker(r.cfg.Interval)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-sigs:
			_, _ = r.Reload("signal")
		case <-tick:
			_, _ = r.Poll()
		}
	}
}

// racyWindow: a file modified this recently may change again without a
// visible change of size or modification time (timestamps are as coarse as
// the kernel's clock tick), so its bytes are hashed on every poll.
const racyWindow = 2 * time.Second

// Poll reloads when the file changed (another file renamed over it, or a
// new size or modification time, or recently modified bytes that hash
// differently) and its bytes differ from the last ones considered. A file
// that was rejected is not reported again until it changes.
func (r *Reloader) Poll() (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fi, err := os.Stat(r.cfg.Path)
	if err != nil {
		// A missing file during an editor's save is normal; try again next tick.
		return Unchanged, nil
	}
	if r.fi != nil && os.SameFile(fi, r.fi) && fi.Size() == r.fi.Size() && fi.ModTime().Equal(r.fi.ModTime()) &&
		time.Since(fi.ModTime()) > racyWindow {
		return Unchanged, nil
	}
	data, err := os.ReadFile(r.cfg.Path)
	if err != nil {
		return Unchanged, nil
	}
	r.fi = fi
	if hashOf(data) == r.seenHash {
		return Unchanged, nil
	}
	return r.apply(data, "file change")
}

// Reload reads and applies the file now, whatever its state (SIGHUP).
// trigger names the cause in the log.
func (r *Reloader) Reload(trigger string) (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if fi, err := os.Stat(r.cfg.Path); err == nil {
		r.fi = fi
	}
	data, err := os.ReadFile(r.cfg.Path)
	if err != nil {
		err = fmt.Errorf("failed to read contract %s: %w (hint: the active contract stays in force)", r.cfg.Path, err)
		r.cfg.Logger.Error("contract reload rejected", "trigger", trigger, "err", err)
		r.report(Rejected)
		return Rejected, err
	}
	return r.apply(data, trigger)
}

func (r *Reloader) apply(data []byte, trigger string) (string, error) {
	log := r.cfg.Logger.With("path", r.cfg.Path, "trigger", trigger)
	r.seenHash = hashOf(data)
	active := r.cfg.Contract.Load()
	c, err := r.cfg.Parse(filepath.Base(r.cfg.Path), data)
	if err != nil {
		var ve *rules.ValidationError
		if errors.As(err, &ve) {
			for _, p := range ve.Problems {
				log.Error("contract problem", "problem", p.String())
			}
		}
		keep := ""
		if active != nil {
			keep = active.Hash
		}
		log.Error("contract reload rejected: the active contract stays in force",
			"active_hash", keep, "problems", problemCount(err),
			"hint", "fix the file and save it again, or run `pollgate check`")
		r.report(Rejected)
		return Rejected, fmt.Errorf("contract %s rejected: %w", r.cfg.Path, err)
	}
	c.Path = r.cfg.Path
	if active != nil && active.Hash == c.Hash {
		log.Info("contract unchanged", "hash", c.Hash)
		r.report(Unchanged)
		return Unchanged, nil
	}
	old := r.cfg.Contract.Swap(c)
	oldHash := ""
	if old != nil {
		oldHash = old.Hash
	}
	log.Info("contract reloaded", "old_hash", oldHash, "hash", c.Hash, "providers", len(c.Providers))
	r.report(Applied)
	return Applied, nil
}

func (r *Reloader) report(outcome string) {
	if r.cfg.OnReload != nil {
		r.cfg.OnReload(outcome, r.cfg.Contract.Load())
	}
}

func problemCount(err error) int {
	var ve *rules.ValidationError
	if errors.As(err, &ve) {
		return len(ve.Problems)
	}
	return 1
}

// hashOf matches rules.Contract.Hash for the same bytes.
func hashOf(data []byte) string {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])[:12]
}
