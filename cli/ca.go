package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"path/filepath"
	"strings"

	"pollgate/ca"
)

func init() {
	register("ca", "manage the pollgate CA ('ca init')", runCA)
}

const caUsage = `Usage: pollgate ca init [--data DIR] [--config FILE] [--name-constraints] [--force]

Creates the pollgate CA in the data directory: ca.pem (the certificate,
for NODE_EXTRA_CA_CERTS), ca-key.pem (the ECDSA P-256 key, mode 0600) and
bundle.pem (the system roots plus the CA, for SSL_CERT_FILE,
REQUESTS_CA_BUNDLE and CURL_CA_BUNDLE). 'pollgate serve' does the same on its
first start; run this to create the CA explicitly, or with name constraints.

Flags (each also from the environment variable in brackets):
  --data DIR           data directory [POLLGATE_DATA] (default ./pollgate-data)
  --config FILE        contract whose hosts the name constraints allow [POLLGATE_CONFIG] (default ./providers.yaml)
  --name-constraints   limit the CA to the contract's hosts (critical name
                       constraints: a leaf for any other name is rejected by
                       clients even if the CA key leaks). A contract with new
                       hosts then needs a new CA.
  --force              replace an existing CA (agents must trust the new one)

Examples:
  pollgate ca init
  pollgate ca init --name-constraints --config /etc/pollgate/providers.yaml --data /var/lib/pollgate
`

func runCA(_ context.Context, env Env) error {
	if len(env.Args) == 0 || env.Args[0] == "-h" || env.Args[0] == "--help" || env.Args[0] == "help" {
		fmt.Fprint(env.Stderr, caUsage)
		if len(env.Args) == 0 {
			return Usage("ca needs a subcommand (hint: pollgate ca init)")
		}
		return nil
	}
	if env.Args[0] != "init" {
		return Usage("unknown ca subcommand %q (hint: pollgate ca init)", env.Args[0])
	}
	fs := flag.NewFlagSet("ca init", flag.ContinueOnError)
	fs.SetOutput(env.Stderr)
	fs.Usage = func() { fmt.Fprint(env.Stderr, caUsage) }
	data := fs.String("data", "", "")
	config := fs.String("config", "", "")
	constrain := fs.Bool("name-constraints", false, "")
	force := fs.Bool("force", false, "")
	if err := fs.Parse(env.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return Usage("bad flags for ca init (hint: pollgate ca init -h)")
	}
	if fs.NArg() > 0 {
		return Usage("ca init takes no arguments, got %q (hint: pollgate ca init -h)", fs.Arg(0))
	}
	dir := serveFlagOrEnv(*data, env.Getenv, "POLLGATE_DATA", "./pollgate-data")
	opts := ca.Options{Force: *force}
	if *constrain {
		path := ContractPath(*config, env.Getenv)
		c, err := serveLoadContract(path, env.Stderr)
		if err != nil {
			return err
		}
		opts.NameConstraints = c.Hosts()
		if len(opts.NameConstraints) == 0 {
			return fmt.Errorf("%s names no hosts to constrain the CA to", path)
		}
	}
	a, err := ca.Create(dir, opts, env.Getenv)
	if err != nil {
		if errors.Is(err, ca.ErrExists) {
			return Exit(ExitError, err)
		}
		return err
	}
	fmt.Fprintf(env.Stdout, "created %s (%s, valid until %s)\n", filepath.Join(dir, ca.CertFile),
		a.Certificate().Subject.CommonName, a.Certificate().NotAfter.UTC().Format("2006-01-02"))
	fmt.Fprintf(env.Stdout, "key     %s (mode 0600)\n", filepath.Join(dir, ca.KeyFile))
	fmt.Fprintf(env.Stdout, "bundle  %s (system roots + the pollgate CA)\n", filepath.Join(dir, ca.BundleFile))
	if len(opts.NameConstraints) > 0 {
		fmt.Fprintf(env.Stdout, "name constraints: %s\n", strings.Join(opts.NameConstraints, ", "))
	}
	if _, _, err := ca.SystemRootsPEM(env.Getenv); err != nil {
		fmt.Fprintf(env.Stderr, "pollgate: warning: %v: bundle.pem holds only the pollgate CA, so tunnelled hosts fail verification in clients that use it (hint: install ca-certificates, or set SSL_CERT_FILE to your root bundle and run again with --force)\n", err)
	}
	fmt.Fprintln(env.Stdout, `next: pollgate serve, then eval "$(pollgate env)" in the agent's shell`)
	return nil
}
