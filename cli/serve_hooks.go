package cli

import (
	"context"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"pollgate/ledger"
	"pollgate/proxy"
	"pollgate/rules"
)

// OperatorDeps is what `pollgate serve` hands to the operators' surface
// (admin API, metrics, notifications, live contract reload).
type OperatorDeps struct {
	// AdminMux is the admin listener's mux. Everything mounted here except
	// /healthz and /readyz is already behind the admin bearer token.
	AdminMux *http.ServeMux
	Store    ledger.Store
	// Contract is the active contract; reload swaps it atomically. The proxy
	// loads it once per request, so in-flight requests finish on the old one.
	Contract   *atomic.Pointer[rules.Contract]
	ConfigPath string
	DataDir    string
	Logger     *slog.Logger
	Now        func() time.Time
	// AuditKey is the audit encryption key (--audit-key), nil when audit
	// entries are stored as plaintext JSON.
	AuditKey []byte
}

// operatorSurface is installed by the operators' surface (serve_operator.go).
// serve calls it after the store and the admin mux exist and before it starts
// listening; the returned Observer receives the proxy's decisions (metrics,
// escalation notifications). It must stop its goroutines when ctx ends.
var operatorSurface func(ctx context.Context, deps *OperatorDeps) (proxy.Observer, error)
