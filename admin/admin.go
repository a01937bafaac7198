// Package admin owns pollgate's admin HTTP API: listing and inspecting
// operations with their audit story, the bounded human decisions on
// escalations (extend, close, allow one resubmission), the outcome report
// (R27) and the audit export. It speaks JSON; errors are
// {"error": "...", "hint": "..."}.
//
// admin makes no policy decisions of its own: an extension is decided by
// rules.Extend inside one ledger Update step, so the bounds offered by the
// escalation and the contract's max_extensions are enforced in one place.
// It never shows credentials: records carry only account fingerprints.
package admin

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"pollgate/ledger"
	"pollgate/rules"
)

// Config configures the admin handler.
type Config struct {
	// Store is the ledger. Required.
	Store ledger.Store
	// Contract returns the active contract (it changes on reload). Required.
	Contract func() *rules.Contract
	// Token is the bearer token every request must carry (compared in
	// constant time). Required unless Unauthenticated is set.
	Token string
	// Unauthenticated skips the token check. Set it only when the handler is
	// mounted behind another bearer check (pollgate serve's admin mux). With
	// neither Token nor Unauthenticated, every request gets 401.
	Unauthenticated bool
	// AuditKey decrypts encrypted audit entries for stories and the audit
	// endpoint; nil shows encrypted entries as such.
	AuditKey []byte
	// Now is the clock for decisions; default time.Now.
	Now func() time.Time
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Registry, when set, is served at GET /metrics.
	Registry prometheus.Gatherer
}

// Error is the JSON body of every error answer.
type Error struct {
	Error string `json:"error"`
	Hint  string `json:"hint,omitempty"`
}

type server struct {
	cfg       Config
	tokenHash [32]byte
}

// New returns the admin API handler. It serves /api/... (and /metrics when
// a Registry is set); mount it on "/" or on "/api/" and "/metrics".
func New(cfg Config) http.Handler {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Contract == nil {
		cfg.Contract = func() *rules.Contract { return nil }
	}
	s := &server{cfg: cfg, tokenHash: sha256.Sum256([]byte(cfg.Token))}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /api/operations", s.list)
	mux.HandleFunc("GET /api/operations/{id}", s.show)
	mux.HandleFunc("GET /api/operations/{id}/audit", s.auditEntries)
	mux.HandleFunc("POST /api/operations/{id}/extend", s.extend)
	mux.HandleFunc("POST /api/operations/{id}/close", s.close)
	mux.HandleFunc("POST /api/operations/{id}/allow-resubmission", s.allowResubmission)
	mux.HandleFunc("GET /api/report", s.report)
	mux.HandleFunc("GET /api/audit/export", s.export)
	mux.HandleFunc("/api/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "no such admin endpoint: "+r.Method+" "+r.URL.Path,
			"see `pollgate ops -h`; endpoints live under /api/operations, /api/report and /api/audit/export")
	})
	if cfg.Registry != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(cfg.Registry, promhttp.HandlerOpts{}))
	}
	return s.auth(mux)
}

func (s *server) auth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.cfg.Unauthenticated {
			tok, ok := bearer(r)
			// Compare fixed-size digests so neither the length nor the
			// content of the token leaks through timing.
			got := sha256.Sum256([]byte(tok))
			if !ok || s.cfg.Token == "" || subtle.ConstantTimeCompare(got[:], s.tokenHash[:]) != 1 {
				w.Header().Set("WWW-Authenticate", `Bearer realm="pollgate admin"`)
				writeError(w, http.StatusUnauthorized, "missing or wrong admin token",
					"send Authorization: Bearer <token>; the token is POLLGATE_ADMIN_TOKEN or the admin.token file in the data directory")
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

func bearer(r *http.Request) (string, bool) {
	h := r.Header.Get("Authorization")
	const prefix = "bearer "
	if len(h) <= len(prefix) || !strings.EqualFold(h[:len(prefix)], prefix) {
		return "", false
	}
	return strings.TrimSpace(h[len(prefix):]), true
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
}

func writeError(w http.ResponseWriter, status int, msg, hint string) {
	writeJSON(w, status, Error{Error: msg, Hint: hint})
}

// storeError answers a ledger failure: 404 for unknown ids, 409 for a step
// not allowed in the record's phase, 503 when the ledger is unreachable.
func (s *server) storeError(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, ledger.ErrNotFound):
		writeError(w, http.StatusNotFound, "operation "+r.PathValue("id")+" not found",
			"list operations with `pollgate ops list`; finished operations are removed after the retention period")
	case errors.Is(err, rules.ErrExtensionRefused), errors.Is(err, ledger.ErrConflict):
		writeError(w, http.StatusConflict, err.Error(), "see the options of the escalation with `pollgate ops show "+r.PathValue("id")+"`")
	case errors.Is(err, ledger.ErrUnavailable):
		s.cfg.Logger.Error("admin request failed: ledger unavailable", "path", r.URL.Path, "err", err)
		w.Header().Set("Retry-After", "5")
		writeError(w, http.StatusServiceUnavailable, err.Error(), "check that the ledger (data directory or Redis) is reachable")
	default:
		s.cfg.Logger.Error("admin request failed", "path", r.URL.Path, "err", err)
		writeError(w, http.StatusInternalServerError, err.Error(), "")
	}
}
