package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"pollgate/admin"
)

func init() {
	register("report", "outcomes per provider: succeeded, failed, escalated, early polls, time to a result", runReport)
}

const reportUsage = `Usage: pollgate report [--admin ADDR] [--data DIR] [--json]

Show, per provider, how the operations in the ledger ended (R27): succeeded,
failed at the provider, escalated by reason, still waiting; the share of
early polls (agents ignoring waiting instructions: polls answered 429 by
pollgate out of all agent polls that reached the ledger); and the median and
95th percentile time from the start of an operation to its terminal result
(success, stop or escalation).

  --admin ADDR   server admin address (default $POLLGATE_ADMIN or 127.0.0.1:8081)
  --data DIR     data directory with admin.token (default $POLLGATE_DATA or
                 ./pollgate-data); $POLLGATE_ADMIN_TOKEN overrides the file
  --json         print the API's JSON

Exit codes: 0 done, 1 server unreachable or server error, 2 bad flags.

Examples:
  pollgate report
  pollgate report --json | jq '.providers[] | {provider, early_poll_share}'
`

func runReport(ctx context.Context, env Env) error {
	var cf clientFlags
	fs := flag.NewFlagSet("report", flag.ContinueOnError)
	fs.SetOutput(env.Stderr)
	fs.Usage = func() { fmt.Fprint(env.Stderr, reportUsage) }
	cf.register(fs, true)
	if err := fs.Parse(env.Args); err != nil {
		if err == flag.ErrHelp {
			return nil
		}
		return Usage("bad flags for report (hint: pollgate report -h)")
	}
	if fs.NArg() > 0 {
		return Usage("report takes no arguments, got %q", fs.Arg(0))
	}
	c, err := newAdminClient(&cf, env.Getenv)
	if err != nil {
		return err
	}
	var rep admin.Report
	if err := c.call(ctx, "GET", "/api/report", nil, &rep); err != nil {
		return err
	}
	if cf.json {
		return printJSON(env.Stdout, rep)
	}
	printReport(env.Stdout, rep)
	return nil
}

func printReport(w io.Writer, rep admin.Report) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PROVIDER\tOPERATIONS\tSUCCEEDED\tFAILED\tESCALATED\tWAITING\tEARLY POLLS\tMEDIAN\tP95")
	row := func(p admin.ProviderReport) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n", p.Provider, p.Operations, p.Succeeded, p.Failed,
			p.EscalatedTotal, p.Waiting, share(p), secs(p.MedianSeconds, p.Terminal), secs(p.P95Seconds, p.Terminal))
	}
	for _, p := range rep.Providers {
		row(p)
	}
	row(rep.Total)
	tw.Flush()
	var lines []string
	for _, p := range rep.Providers {
		if p.EscalatedTotal == 0 {
			continue
		}
		reasons := make([]string, 0, len(p.Escalated))
		for r := range p.Escalated {
			reasons = append(reasons, r)
		}
		sort.Strings(reasons)
		parts := make([]string, len(reasons))
		for i, r := range reasons {
			parts[i] = fmt.Sprintf("%s %d", r, p.Escalated[r])
		}
		lines = append(lines, fmt.Sprintf("  %s: %s", p.Provider, strings.Join(parts, ", ")))
	}
	if len(lines) > 0 {
		fmt.Fprintln(w, "\nescalated by reason:")
		fmt.Fprintln(w, strings.Join(lines, "\n"))
	}
	fmt.Fprintf(w, "\nearly polls: share of agent polls answered 429 by pollgate; median/p95: time to a terminal result (generated %s UTC)\n",
		rep.GeneratedAt.UTC().Format("2006-01-02 15:04:05"))
}

func share(p admin.ProviderReport) string {
	if p.EarlyPolls+p.StatusRequests == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%% (%d)", p.EarlyPollShare*100, p.EarlyPolls)
}

func secs(s float64, n int) string {
	if n == 0 {
		return "-"
	}
	return shortDur(time.Duration(s * float64(time.Second)).Round(time.Second).String())
}
