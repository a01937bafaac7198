package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"pollgate/admin"
)

// DefaultAdminAddr is the admin listener of `pollgate serve`.
const DefaultAdminAddr = "127.0.0.1:8081"

// DefaultDataDir is the data directory when neither --data nor
// $POLLGATE_DATA is given.
const DefaultDataDir = "pollgate-data"

// AdminTokenFile is the admin token's file name inside the data directory.
const AdminTokenFile = "admin.token"

// clientFlags are the flags every command that talks to the admin API takes.
type clientFlags struct {
	admin string
	data  string
	json  bool
}

func (c *clientFlags) register(fs *flag.FlagSet, withJSON bool) {
	fs.StringVar(&c.admin, "admin", "", "admin address of the server (default $POLLGATE_ADMIN or "+DefaultAdminAddr+")")
	fs.StringVar(&c.data, "data", "", "data directory holding admin.token (default $POLLGATE_DATA or ./"+DefaultDataDir+")")
	if withJSON {
		fs.BoolVar(&c.json, "json", false, "print JSON for scripts instead of a table")
	}
}

func (c *clientFlags) dataDir(getenv func(string) string) string {
	if c.data != "" {
		return c.data
	}
	if v := getenv("POLLGATE_DATA"); v != "" {
		return v
	}
	return DefaultDataDir
}

// adminClient talks to the admin API of a running `pollgate serve`.
type adminClient struct {
	base  string // http://host:port
	token string
	http  *http.Client
}

// newAdminClient resolves the server address and the token: --admin, then
// $POLLGATE_ADMIN, then 127.0.0.1:8081; $POLLGATE_ADMIN_TOKEN, then the
// admin.token file in the data directory.
func newAdminClient(f *clientFlags, getenv func(string) string) (*adminClient, error) {
	addr := f.admin
	if addr == "" {
		addr = getenv("POLLGATE_ADMIN")
	}
	if addr == "" {
		addr = DefaultAdminAddr
	}
	base := addr
	if !strings.Contains(base, "://") {
		base = "http://" + base
	}
	base = strings.TrimRight(base, "/")
	tok := strings.TrimSpace(getenv("POLLGATE_ADMIN_TOKEN"))
	if tok == "" {
		path := filepath.Join(f.dataDir(getenv), AdminTokenFile)
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("failed to read the admin token: %w (hint: set POLLGATE_ADMIN_TOKEN, or pass --data with the server's data directory)", err)
		}
		tok = strings.TrimSpace(string(b))
	}
	// The admin API is local: never send its token through a proxy.
	// No overall timeout: an audit export of a large ledger streams for as
	// long as it takes; a server that does not answer at all is caught by
	// the header timeout.
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.Proxy = nil
	tr.ResponseHeaderTimeout = 60 * time.Second
	return &adminClient{base: base, token: tok, http: &http.Client{Transport: tr}}, nil
}

// apiError is an error answer of the admin API.
type apiError struct {
	Status int
	Body   admin.Error
}

func (e *apiError) Error() string {
	msg := e.Body.Error
	if msg == "" {
		msg = http.StatusText(e.Status)
	}
	if e.Body.Hint != "" {
		return fmt.Sprintf("%s (hint: %s)", msg, e.Body.Hint)
	}
	return msg
}

// errUnreachable wraps failures to connect to the admin listener.
var errUnreachable = errors.New("admin API unreachable")

func (c *adminClient) request(ctx context.Context, method, path string, body any) (*http.Response, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, rd)
	if err != nil {
		return nil, fmt.Errorf("invalid admin address %q: %w (hint: use host:port, e.g. %s)", c.base, err, DefaultAdminAddr)
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		var oe *net.OpError
		if errors.As(err, &oe) {
			return nil, fmt.Errorf("%w at %s: %v (hint: is `pollgate serve` running? choose the server with --admin or POLLGATE_ADMIN)", errUnreachable, c.base, oe.Err)
		}
		return nil, fmt.Errorf("failed to call the admin API at %s: %w", c.base, err)
	}
	if resp.StatusCode/100 != 2 {
		defer resp.Body.Close()
		ae := &apiError{Status: resp.StatusCode}
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		if json.Unmarshal(raw, &ae.Body) != nil || ae.Body.Error == "" {
			ae.Body.Error = fmt.Sprintf("admin API answered %s", resp.Status)
		}
		if resp.StatusCode == http.StatusUnauthorized {
			ae.Body.Hint = "the admin token was refused; set POLLGATE_ADMIN_TOKEN or pass --data with the server's data directory"
		}
		return nil, ae
	}
	return resp, nil
}

// call sends body (nil for none) and decodes a JSON answer into out.
func (c *adminClient) call(ctx context.Context, method, path string, body, out any) error {
	resp, err := c.request(ctx, method, path, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("failed to read the admin API answer: %w", err)
	}
	return nil
}

// parseInterspersed parses flags that may follow positional arguments
// ("ops extend ID --for 15m") and returns the positional ones.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if rest[0] == "--" {
			return append(pos, rest[1:]...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}
