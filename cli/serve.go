package cli

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"pollgate/audit"
	"pollgate/ca"
	"pollgate/ledger"
	"pollgate/proxy"
	"pollgate/rules"
)

func init() {
	register("serve", "run the governing proxy", runServe)
}

const serveUsage = `Usage: pollgate serve [flags]

Runs the forward proxy. Agents reach it through HTTPS_PROXY/HTTP_PROXY (see
'pollgate env'); calls the contract names are governed, every other host is
tunnelled untouched. The first start creates the CA (ca.pem, ca-key.pem),
bundle.pem, admin.token and account.key in the data directory.

Flags (each also from the environment variable in brackets):
  --config FILE       provider contract [POLLGATE_CONFIG] (default ./providers.yaml)
  --listen ADDR       proxy listener [POLLGATE_LISTEN] (default 127.0.0.1:8080)
  --admin ADDR        admin listener: /healthz, /readyz, admin API [POLLGATE_ADMIN] (default 127.0.0.1:8081)
  --data DIR          data directory [POLLGATE_DATA] (default ./pollgate-data)
  --redis URL         Redis ledger, e.g. redis://host:6379/0 [POLLGATE_REDIS_URL] (default: bbolt in --data)
  --upstream-ca FILE  extra PEM roots for providers' TLS [POLLGATE_UPSTREAM_CA]
  --max-body SIZE     largest body read for classification, e.g. 1MiB [POLLGATE_MAX_BODY] (default 1MiB)
  --audit-key FILE    encrypt audit entries with this AES-256 key [POLLGATE_AUDIT_KEY]
  --retention DUR     keep finished operations and their audit chains this long [POLLGATE_RETENTION] (default 168h)
The admin token is read from POLLGATE_ADMIN_TOKEN, else from DIR/admin.token.

Examples:
  pollgate serve
  pollgate serve --config /etc/pollgate/providers.yaml --data /var/lib/pollgate
  POLLGATE_REDIS_URL=redis://10.0.0.5:6379/0 pollgate serve --listen 0.0.0.0:8080
`

// EmbeddedContract, when set (main can embed the shipped providers.yaml),
// is the contract serve uses when neither --config nor POLLGATE_CONFIG is
// given and ./providers.yaml does not exist. Live reload is off then.
var EmbeddedContract []byte

// serveConfig is the resolved configuration of one serve run.
type serveConfig struct {
	config, listen, admin, data, redis, upstreamCA, auditKey string
	configGiven                                              bool
	maxBody                                                  int64
	retention                                                time.Duration
}

// Files serve keeps in the data directory besides the CA and the ledger.
const (
	adminTokenFile = "admin.token"
	accountKeyFile = "account.key"
)

func serveParseFlags(env Env) (*serveConfig, error) {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(env.Stderr)
	fs.Usage = func() { fmt.Fprint(env.Stderr, serveUsage) }
	c := &serveConfig{}
	fs.StringVar(&c.config, "config", "", "")
	fs.StringVar(&c.listen, "listen", "", "")
	fs.StringVar(&c.admin, "admin", "", "")
	fs.StringVar(&c.data, "data", "", "")
	fs.StringVar(&c.redis, "redis", "", "")
	fs.StringVar(&c.upstreamCA, "upstream-ca", "", "")
	fs.StringVar(&c.auditKey, "audit-key", "", "")
	maxBody := fs.String("max-body", "", "")
	retention := fs.String("retention", "", "")
	if err := fs.Parse(env.Args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, flag.ErrHelp
		}
		return nil, Usage("bad flags for serve (hint: pollgate serve -h)")
	}
	if fs.NArg() > 0 {
		return nil, Usage("serve takes no arguments, got %q (hint: pollgate serve -h)", fs.Arg(0))
	}
	c.configGiven = c.config != "" || env.Getenv("POLLGATE_CONFIG") != ""
	c.config = ContractPath(c.config, env.Getenv)
	c.listen = serveFlagOrEnv(c.listen, env.Getenv, "POLLGATE_LISTEN", "127.0.0.1:8080")
	c.admin = serveFlagOrEnv(c.admin, env.Getenv, "POLLGATE_ADMIN", "127.0.0.1:8081")
	c.data = serveFlagOrEnv(c.data, env.Getenv, "POLLGATE_DATA", "./pollgate-data")
	c.redis = serveFlagOrEnv(c.redis, env.Getenv, "POLLGATE_REDIS_URL", "")
	c.upstreamCA = serveFlagOrEnv(c.upstreamCA, env.Getenv, "POLLGATE_UPSTREAM_CA", "")
	c.auditKey = serveFlagOrEnv(c.auditKey, env.Getenv, "POLLGATE_AUDIT_KEY", "")
	mb := serveFlagOrEnv(*maxBody, env.Getenv, "POLLGATE_MAX_BODY", "1MiB")
	n, err := serveParseSize(mb)
	if err != nil {
		return nil, Usage("bad --max-body %q: %v (hint: a byte count such as 1048576, 512KiB or 2MiB)", mb, err)
	}
	c.maxBody = n
	ret := serveFlagOrEnv(*retention, env.Getenv, "POLLGATE_RETENTION", "168h")
	d, err := time.ParseDuration(ret)
	if err != nil || d <= 0 {
		return nil, Usage("bad --retention %q: want a positive duration (hint: 168h keeps finished operations for 7 days)", ret)
	}
	c.retention = d
	return c, nil
}

func serveFlagOrEnv(v string, getenv func(string) string, name, def string) string {
	if v != "" {
		return v
	}
	if e := getenv(name); e != "" {
		return e
	}
	return def
}

// serveParseSize reads "1048576", "512KiB", "2MiB" (also KB/MB as powers of 1024).
func serveParseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		m      int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"KB", 1 << 10}, {"MB", 1 << 20}, {"K", 1 << 10}, {"M", 1 << 20}} {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSuffix(s, u.suffix), u.m
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || n <= 0 {
		return 0, errors.New("not a positive size")
	}
	return n * mult, nil
}

// serveLogger logs text on a terminal and JSON otherwise.
func serveLogger(w io.Writer) *slog.Logger {
	if f, ok := w.(*os.File); ok {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			return slog.New(slog.NewTextHandler(w, nil))
		}
	}
	return slog.New(slog.NewJSONHandler(w, nil))
}

// serveSecretFile returns the contents of a 0600 secret in dir, creating it
// with n random bytes (hex) on first use.
func serveSecretFile(dir, name string, n int) (string, bool, error) {
	path := filepath.Join(dir, name)
	b, err := os.ReadFile(path)
	if err == nil {
		if fi, err := os.Stat(path); err == nil && fi.Mode().Perm()&0o077 != 0 {
			return "", false, fmt.Errorf("%s has mode %04o, readable by others (hint: chmod 600 %s)", path, fi.Mode().Perm(), path)
		}
		v := strings.TrimSpace(string(b))
		if v == "" {
			return "", false, fmt.Errorf("%s is empty (hint: delete it and restart to create a new one)", path)
		}
		return v, false, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return "", false, fmt.Errorf("failed to read %s: %w", path, err)
	}
	raw := make([]byte, n)
	if _, err := rand.Read(raw); err != nil {
		return "", false, fmt.Errorf("failed to create %s: %w", path, err)
	}
	v := hex.EncodeToString(raw)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return "", false, fmt.Errorf("failed to create %s: %w", path, err)
	}
	if _, err := f.WriteString(v + "\n"); err != nil {
		f.Close()
		return "", false, fmt.Errorf("failed to write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return "", false, fmt.Errorf("failed to write %s: %w", path, err)
	}
	return v, true, nil
}

func serveLoadContract(path string, stderr io.Writer) (*rules.Contract, error) {
	c, err := rules.Load(path)
	if err != nil {
		var ve *rules.ValidationError
		if errors.As(err, &ve) {
			for _, p := range ve.Problems {
				p.File = path
				fmt.Fprintln(stderr, p.String())
			}
			return nil, fmt.Errorf("%s: %d problems found (hint: run 'pollgate check --config %s')", path, len(ve.Problems), path)
		}
		return nil, err
	}
	return c, nil
}

func serveUpstreamRoots(file string) (*x509.CertPool, error) {
	pool, err := x509.SystemCertPool()
	if err != nil || pool == nil {
		pool = x509.NewCertPool()
	}
	if file == "" {
		return pool, nil
	}
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("failed to read --upstream-ca: %w", err)
	}
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("--upstream-ca %s holds no PEM certificate", file)
	}
	return pool, nil
}

func runServe(ctx context.Context, env Env) error {
	cfg, err := serveParseFlags(env)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	log := serveLogger(env.Stderr)
	now := time.Now

	var contract *rules.Contract
	if _, statErr := os.Stat(cfg.config); !cfg.configGiven && errors.Is(statErr, os.ErrNotExist) && EmbeddedContract != nil {
		if contract, err = rules.Parse("providers.yaml (embedded)", EmbeddedContract); err != nil {
			return fmt.Errorf("embedded contract: %w", err)
		}
		log.Info("no ./providers.yaml: using the embedded default contract (pass --config to use your own; live reload is off)")
		cfg.config = ""
	} else if contract, err = serveLoadContract(cfg.config, env.Stderr); err != nil {
		return err
	}
	if err := os.MkdirAll(cfg.data, 0o700); err != nil {
		return fmt.Errorf("failed to create data directory %s: %w", cfg.data, err)
	}
	authority, created, err := ca.LoadOrCreate(cfg.data, ca.Options{}, env.Getenv)
	if err != nil {
		return err
	}
	if created {
		log.Info("created the pollgate CA; agents must trust it (see 'pollgate env')",
			"ca", filepath.Join(cfg.data, ca.CertFile), "bundle", filepath.Join(cfg.data, ca.BundleFile))
	}
	token := env.Getenv("POLLGATE_ADMIN_TOKEN")
	if token == "" {
		var made bool
		if token, made, err = serveSecretFile(cfg.data, adminTokenFile, 32); err != nil {
			return err
		}
		if made {
			log.Info("created the admin token", "file", filepath.Join(cfg.data, adminTokenFile))
		}
	}
	keyHex, _, err := serveSecretFile(cfg.data, accountKeyFile, 32)
	if err != nil {
		return err
	}
	accountKey, err := hex.DecodeString(keyHex)
	if err != nil || len(accountKey) < 16 {
		return fmt.Errorf("%s is not a hex key (hint: delete it and restart; account fingerprints of existing operations change)", filepath.Join(cfg.data, accountKeyFile))
	}
	roots, err := serveUpstreamRoots(cfg.upstreamCA)
	if err != nil {
		return err
	}
	var auditKey []byte
	if cfg.auditKey != "" {
		if auditKey, err = audit.LoadKey(cfg.auditKey); err != nil {
			return err
		}
	}

	var store ledger.Store
	backend := "bbolt"
	if cfg.redis != "" {
		rs, err := ledger.OpenRedis(ctx, cfg.redis, ledger.RedisOptions{Logger: log, AuditKey: auditKey, Retention: cfg.retention})
		if err != nil {
			return fmt.Errorf("failed to open the Redis ledger: %w", err)
		}
		store, backend = rs, "redis"
		go rs.RunSweeper(ctx, time.Hour, now)
	} else {
		bs, err := ledger.OpenBolt(cfg.data, ledger.BoltOptions{Logger: log, AuditKey: auditKey, Retention: cfg.retention})
		if err != nil {
			return err
		}
		store = bs
		go bs.RunSweeper(ctx, time.Hour, now)
		log.Info("embedded bbolt ledger: this process is the only replica for this data directory (use --redis for several)",
			"file", filepath.Join(cfg.data, ledger.BoltFile))
	}
	defer store.Close()

	var active atomic.Pointer[rules.Contract]
	active.Store(contract)

	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		serveWriteJSON(w, http.StatusOK, map[string]any{"ok": true})
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		c := active.Load()
		rctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		perr := store.Ping(rctx)
		body := map[string]any{"ready": perr == nil && c != nil, "ledger": backend}
		if perr != nil {
			body["ledger_error"] = perr.Error()
		}
		if c != nil {
			body["contract"] = c.Hash
			body["providers"] = len(c.Providers)
		}
		code := http.StatusOK
		if perr != nil || c == nil {
			code = http.StatusServiceUnavailable
		}
		serveWriteJSON(w, code, body)
	})

	var observer proxy.Observer = proxy.NopObserver{}
	if operatorSurface != nil {
		obs, err := operatorSurface(ctx, &OperatorDeps{
			AdminMux:   mux,
			Store:      store,
			Contract:   &active,
			ConfigPath: cfg.config,
			DataDir:    cfg.data,
			Logger:     log,
			Now:        now,
			AuditKey:   auditKey,
		})
		if err != nil {
			return fmt.Errorf("failed to start the operators' surface: %w", err)
		}
		if obs != nil {
			observer = obs
		}
	}

	pln, err := net.Listen("tcp", cfg.listen)
	if err != nil {
		return fmt.Errorf("failed to listen on %s: %w (hint: --listen or POLLGATE_LISTEN)", cfg.listen, err)
	}
	aln, err := net.Listen("tcp", cfg.admin)
	if err != nil {
		pln.Close()
		return fmt.Errorf("failed to listen on %s: %w (hint: --admin or POLLGATE_ADMIN)", cfg.admin, err)
	}
	refuse := serveRefuser(pln.Addr(), aln.Addr())
	holder, _ := os.Hostname()
	p, err := proxy.New(proxy.Config{
		Contract:      active.Load,
		Store:         store,
		CA:            authority,
		UpstreamRoots: roots,
		Now:           now,
		Logger:        log,
		Observer:      observer,
		MaxBody:       cfg.maxBody,
		AccountKey:    accountKey,
		HolderID:      fmt.Sprintf("%s:%d:%s", holder, os.Getpid(), serveRandomToken(4)),
		Refuse:        refuse,
	})
	if err != nil {
		pln.Close()
		aln.Close()
		return err
	}
	defer p.Close()

	proxySrv := &http.Server{Handler: p.Handler(), ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
	adminSrv := &http.Server{Handler: serveAdminAuth(token, mux), ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
	errc := make(chan error, 2)
	go func() { errc <- proxySrv.Serve(p.WrapListener(pln)) }()
	go func() { errc <- adminSrv.Serve(aln) }()

	fmt.Fprintf(env.Stderr, "pollgate: proxy on %s, admin on %s, data %s, ledger %s, contract %s (%d providers)\n",
		pln.Addr(), aln.Addr(), cfg.data, serveBackendSummary(backend), contract.Hash, len(contract.Providers))
	log.Info("pollgate serving", "listen", pln.Addr().String(), "admin", aln.Addr().String(), "data", cfg.data,
		"ledger", backend, "contract", contract.Hash, "providers", len(contract.Providers), "max_body", cfg.maxBody)

	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = proxySrv.Shutdown(sctx)
	_ = adminSrv.Shutdown(sctx)
	if serveErr != nil && !errors.Is(serveErr, http.ErrServerClosed) {
		return fmt.Errorf("server failed: %w", serveErr)
	}
	return nil
}

func serveBackendSummary(b string) string {
	if b == "bbolt" {
		return "bbolt (single replica)"
	}
	return b
}

func serveRandomToken(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// serveRefuser refuses proxying to pollgate's own listeners (a loop, or a way
// around the admin token's network boundary) and to the cloud metadata
// address.
func serveRefuser(addrs ...net.Addr) func(string) bool {
	own := map[string]bool{}
	for _, a := range addrs {
		host, port, err := net.SplitHostPort(a.String())
		if err != nil {
			continue
		}
		own[net.JoinHostPort(host, port)] = true
		if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
			own[net.JoinHostPort("127.0.0.1", port)] = true
			own[net.JoinHostPort("::1", port)] = true
			own[net.JoinHostPort("localhost", port)] = true
		}
		if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
			own[net.JoinHostPort("localhost", port)] = true
		}
	}
	return func(hostport string) bool {
		host, _, err := net.SplitHostPort(hostport)
		if err != nil {
			host = hostport
		}
		if host == "169.254.169.254" || strings.EqualFold(host, "metadata.google.internal") {
			return true
		}
		return own[strings.ToLower(hostport)]
	}
}

// serveAdminAuth puts everything on the admin mux except /healthz and /readyz
// behind "Authorization: Bearer <token>" (constant-time comparison).
func serveAdminAuth(token string, next http.Handler) http.Handler {
	want := []byte("Bearer " + token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/healthz" || r.URL.Path == "/readyz" {
			next.ServeHTTP(w, r)
			return
		}
		got := []byte(r.Header.Get("Authorization"))
		if subtle.ConstantTimeCompare(got, want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="pollgate"`)
			serveWriteJSON(w, http.StatusUnauthorized, map[string]any{
				"error":   "unauthorized",
				"message": "missing or wrong admin token (hint: send 'Authorization: Bearer <token>' with the token from POLLGATE_ADMIN_TOKEN or the data directory's admin.token)",
			})
			return
		}
		next.ServeHTTP(w, r)
	})
}

func serveWriteJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	b, _ := json.Marshal(v)
	_, _ = w.Write(append(b, '\n'))
}
