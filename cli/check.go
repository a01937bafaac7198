package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"pollgate/rules"
)

func init() {
	register("check", "validate a provider contract (providers.yaml)", runCheck)
}

const checkUsage = `Usage: pollgate check [--config FILE]

Validate a provider contract and report every problem at once, each with
its line and a hint. Exits 0 when the contract is valid, 1 when it is not.

The contract is FILE, else $POLLGATE_CONFIG, else ./providers.yaml.

Examples:
  pollgate check
  pollgate check --config /etc/pollgate/providers.yaml
  POLLGATE_CONFIG=staging.yaml pollgate check
`

// ContractPath picks the contract file: the flag value, then
// $POLLGATE_CONFIG, then ./providers.yaml. serve uses the same rule.
func ContractPath(flagValue string, getenv func(string) string) string {
	if flagValue != "" {
		return flagValue
	}
	if v := getenv("POLLGATE_CONFIG"); v != "" {
		return v
	}
	return "providers.yaml"
}

func runCheck(_ context.Context, env Env) error {
	fs := flag.NewFlagSet("check", flag.ContinueOnError)
	fs.SetOutput(env.Stderr)
	fs.Usage = func() { fmt.Fprint(env.Stderr, checkUsage) }
	config := fs.String("config", "", "contract file (default $POLLGATE_CONFIG or ./providers.yaml)")
	if err := fs.Parse(env.Args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return Usage("bad flags for check (hint: pollgate check --config FILE)")
	}
	if fs.NArg() > 0 {
		return Usage("check takes no arguments, got %q (hint: pollgate check --config FILE)", fs.Arg(0))
	}
	path := ContractPath(*config, env.Getenv)
	c, err := rules.Load(path)
	if err != nil {
		var ve *rules.ValidationError
		if errors.As(err, &ve) {
			for _, p := range ve.Problems {
				p.File = path
				fmt.Fprintln(env.Stderr, p.String())
			}
			fmt.Fprintf(env.Stderr, "pollgate: %s: %d problem%s found\n", path, len(ve.Problems), checkPlural(len(ve.Problems)))
			return Silent(ExitError)
		}
		return err
	}
	fmt.Fprintf(env.Stdout, "ok: %d providers (contract %s)\n", len(c.Providers), c.Hash)
	return nil
}

func checkPlural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}
