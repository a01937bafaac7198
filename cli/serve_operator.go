package cli

import (
	"context"
	"sync/atomic"
	"time"

	"pollgate/admin"
	"pollgate/metrics"
	"pollgate/notify"
	"pollgate/proxy"
	"pollgate/reload"
	"pollgate/rules"
)

func init() { operatorSurface = startOperatorSurface }

// startOperatorSurface mounts the admin API (/api/...) and /metrics on the
// admin mux (already behind the admin token), starts the escalation
// notifier and the contract reloader, and returns the Observer that feeds
// metrics and notifications from the proxy's decisions.
func startOperatorSurface(ctx context.Context, deps *OperatorDeps) (proxy.Observer, error) {
	log := deps.Logger
	now := deps.Now
	if now == nil {
		now = time.Now
	}
	m := metrics.New(metrics.Options{Store: deps.Store, Now: now})
	m.SetContract(deps.Contract.Load(), now())

	n := notify.New(notify.Config{Logger: log.With("component", "notify"), OnOutcome: m.Notification})
	n.Start(ctx)

	if deps.ConfigPath != "" {
		r, err := reload.New(reload.Config{
			Path:     deps.ConfigPath,
			Contract: deps.Contract,
			Logger:   log.With("component", "reload"),
			OnReload: func(outcome string, active *rules.Contract) {
				m.ContractReload(outcome)
				if outcome == reload.Applied {
					m.SetContract(active, now())
				}
			},
		})
		if err != nil {
			return nil, err
		}
		go r.Run(ctx)
		log.Info("contract reload enabled: on SIGHUP and when the file changes", "path", deps.ConfigPath)
	} else {
		log.Info("contract reload disabled: running on the embedded default contract (hint: pass --config to reload on SIGHUP and file changes)")
	}

	h := admin.New(admin.Config{
		Store:           deps.Store,
		Contract:        deps.Contract.Load,
		Unauthenticated: true, // the admin mux checks the bearer token
		AuditKey:        deps.AuditKey,
		Now:             now,
		Logger:          log.With("component", "admin"),
	})
	deps.AdminMux.Handle("/api/", h)
	deps.AdminMux.Handle("GET /metrics", m.Handler())
	return &operatorObserver{Metrics: m, notifier: n, contract: deps.Contract}, nil
}

// operatorObserver counts every decision and notifies escalations.
type operatorObserver struct {
	*metrics.Metrics
	notifier *notify.Notifier
	contract *atomic.Pointer[rules.Contract]
}

var _ proxy.Observer = (*operatorObserver)(nil)

// Escalated counts the escalation and queues its webhook notification
// (never blocking: a full queue drops and counts).
func (o *operatorObserver) Escalated(op *rules.Operation) {
	o.Metrics.Escalated(op)
	o.notifier.Escalated(o.contract.Load(), op)
}
