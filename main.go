// Command pollgate is a forward HTTP(S) proxy that governs how AI agents poll
// the status endpoints of asynchronous provider jobs. See README.md.
package main

import (
	"context"
	_ "embed"
	"os"
	"os/signal"
	"syscall"

	"pollgate/cli"
)

// shippedContract is the providers.yaml of this repository, used by
// `pollgate serve` when no contract file is given or found.
//
//go:embed providers.yaml
var shippedContract []byte

func main() {
	cli.EmbeddedContract = shippedContract
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Run(ctx, os.Args[1:], cli.Env{Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr, Getenv: os.Getenv})
	stop()
	os.Exit(code)
}
