// Package cli implements pollgate's subcommands. Each subcommand lives in its
// own file and registers itself; Run dispatches. Output rules: results on
// stdout, diagnostics on stderr prefixed "pollgate: ", lowercase, with a hint
// where the operator can fix something.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
)

// Exit codes, documented in README.md.
const (
	ExitOK    = 0 // success
	ExitError = 1 // the command ran and found a problem (invalid contract, tampered audit log, refused request)
	ExitUsage = 2 // bad flags or arguments
)

// ExitError lets a command choose its exit code.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// Exit wraps err with an exit code.
func Exit(code int, err error) error { return &exitError{code: code, err: err} }

// Usage marks err as a usage error (exit 2).
func Usage(format string, a ...any) error { return Exit(ExitUsage, fmt.Errorf(format, a...)) }

// Env is what a command gets from main: arguments after the subcommand
// name, standard streams and the process environment (as a lookup, so tests
// can inject one).
type Env struct {
	Args   []string
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
	Getenv func(string) string
}

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, env Env) error
}

var commands = map[string]command{}

// register adds a subcommand; called from init functions in this package.
// Multi-word commands ("ca init", "ops list") register under their first
// word and dispatch the rest themselves.
func register(name, summary string, run func(ctx context.Context, env Env) error) {
	if _, dup := commands[name]; dup {
		panic("cli: duplicate command " + name)
	}
	commands[name] = command{name: name, summary: summary, run: run}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "pollgate governs how AI agents poll the status endpoints of asynchronous provider jobs.")
	fmt.Fprintln(w, "\nUsage:\n  pollgate <command> [flags]\n\nCommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-8s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nRun 'pollgate <command> -h' for the flags of one command.")
}

// Run executes one pollgate invocation and returns the process exit code.
func Run(ctx context.Context, args []string, env Env) int {
	if env.Getenv == nil {
		env.Getenv = func(string) string { return "" }
	}
	if len(args) == 0 {
		usage(env.Stderr) // a usage error: nothing on stdout
		return ExitUsage
	}
	if args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(env.Stdout)
		return ExitOK
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(env.Stderr, "pollgate: unknown command %q (hint: run 'pollgate help' for the list)\n", args[0])
		return ExitUsage
	}
	env.Args = args[1:]
	err := cmd.run(ctx, env)
	if err == nil {
		return ExitOK
	}
	code := ExitError
	var ee *exitError
	if errors.As(err, &ee) {
		code = ee.code
	}
	if msg := strings.TrimSpace(err.Error()); msg != "" && !errors.Is(err, errSilent) {
		fmt.Fprintf(env.Stderr, "pollgate: %s\n", msg)
	}
	return code
}

// errSilent marks an error whose details the command already printed.
var errSilent = errors.New("")

// Silent returns an error with the given exit code that prints nothing more.
func Silent(code int) error { return Exit(code, errSilent) }
