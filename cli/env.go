package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"

	"pollgate/ca"
)

func init() {
	register("env", "print shell exports that point an agent at the proxy", runEnv)
}

const envUsage = `Usage: pollgate env [--data DIR] [--listen ADDR]

Prints shell exports that send an agent's HTTP(S) traffic through pollgate
and make it trust the pollgate CA:
  HTTPS_PROXY, HTTP_PROXY          the proxy listener (also https_proxy and
                                   http_proxy: curl ignores HTTP_PROXY)
  SSL_CERT_FILE, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE
                                   bundle.pem (system roots + the pollgate CA)
  NODE_EXTRA_CA_CERTS              ca.pem (Node adds it to its roots)
  NODE_USE_ENV_PROXY=1             Node >= 22.21 honours HTTPS_PROXY with it

Flags (each also from the environment variable in brackets):
  --data DIR      data directory of the proxy [POLLGATE_DATA] (default ./pollgate-data)
  --listen ADDR   proxy listener [POLLGATE_LISTEN] (default 127.0.0.1:8080)

Examples:
  eval "$(pollgate env)"
  eval "$(pollgate env --data /var/lib/pollgate --listen 10.0.0.5:8080)"
`

func runEnv(_ context.Context, env Env) error {
	fs := flag.NewFlagSet("env", flag.ContinueOnError)
	fs.SetOutput(env.Stderr)
	fs.Usage = func() { fmt.Fprint(env.Stderr, envUsage) }
	data := fs.String("data", "", "")
	listen := fs.String("listen", "", "")
	if err := fs.Parse(env.Args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return Usage("bad flags for env (hint: pollgate env -h)")
	}
	if fs.NArg() > 0 {
		return Usage("env takes no arguments, got %q (hint: pollgate env -h)", fs.Arg(0))
	}
	dir := serveFlagOrEnv(*data, env.Getenv, "POLLGATE_DATA", "./pollgate-data")
	addr := serveFlagOrEnv(*listen, env.Getenv, "POLLGATE_LISTEN", "127.0.0.1:8080")
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("failed to resolve %s: %w", dir, err)
	}
	caFile, bundle := filepath.Join(abs, ca.CertFile), filepath.Join(abs, ca.BundleFile)
	for _, f := range []string{caFile, bundle} {
		if _, err := os.Stat(f); err != nil {
			return fmt.Errorf("no pollgate CA in %s (hint: start 'pollgate serve --data %s' once, or run 'pollgate ca init --data %s')", abs, dir, dir)
		}
	}
	proxyURL := "http://" + envClientAddr(addr)
	exports := []struct{ k, v string }{
		{"HTTPS_PROXY", proxyURL},
		{"HTTP_PROXY", proxyURL},
		{"https_proxy", proxyURL}, // curl and wget read the lower-case names
		{"http_proxy", proxyURL},  // (curl ignores HTTP_PROXY)
		{"SSL_CERT_FILE", bundle},
		{"REQUESTS_CA_BUNDLE", bundle},
		{"CURL_CA_BUNDLE", bundle},
		{"NODE_EXTRA_CA_CERTS", caFile},
		{"NODE_USE_ENV_PROXY", "1"},
	}
	for _, e := range exports {
		fmt.Fprintf(env.Stdout, "export %s=%s\n", e.k, envShellQuote(e.v))
	}
	return nil
}

// envClientAddr turns a listen address into one a client can dial: an
// unspecified host (":8080", "0.0.0.0:8080") becomes loopback.
func envClientAddr(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if host == "" {
		host = "127.0.0.1"
	} else if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		if ip.To4() != nil {
			host = "127.0.0.1"
		} else {
			host = "::1"
		}
	}
	return net.JoinHostPort(host, port)
}

// envShellQuote quotes s for POSIX shells (single quotes, ' as '\”).
func envShellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:=@%+,") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
