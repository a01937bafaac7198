package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"pollgate/admin"
	"pollgate/rules"
)

func init() {
	register("ops", "inspect operations and decide on escalations (list, show, extend, close, allow-resubmission)", runOps)
}

const opsUsage = `Usage:
  pollgate ops list [--phase PHASE] [--provider NAME] [--limit N] [--json]
  pollgate ops show ID [--json]
  pollgate ops extend ID --for DURATION --requests N [--note TEXT] [--by NAME] [--json]
  pollgate ops close ID [--note TEXT] [--by NAME] [--json]
  pollgate ops allow-resubmission ID [--note TEXT] [--by NAME] [--json]

Talk to the admin API of a running 'pollgate serve'.

  list                 operations, ordered by provider and job; PHASE is waiting,
                       succeeded, stopped, escalated or closed
  show                 one operation: its record, the escalation message (R18),
                       the options and the story of every decision (R25)
  extend               approve more time and status requests for an escalated
                       operation, within the bounds its escalation offered; the
                       next poll is allowed at once
  close                acknowledge an escalation; agents keep getting the
                       escalation body
  allow-resubmission   allow one resubmission of a request blocked as
                       resubmission_blocked

Every command takes:
  --admin ADDR   server admin address (default $POLLGATE_ADMIN or 127.0.0.1:8081)
  --data DIR     data directory with admin.token (default $POLLGATE_DATA or
                 ./pollgate-data); $POLLGATE_ADMIN_TOKEN overrides the file
  --json         print the API's JSON instead of a table

--by defaults to $USER. Flags may come before or after ID.

Exit codes:
  0  done
  1  refused (outside the offered bounds, not escalated, ...), not found,
     server unreachable or server error
  2  bad flags or arguments

Examples:
  pollgate ops list --phase escalated
  pollgate ops show op_5f2c9a1e
  pollgate ops extend op_5f2c9a1e --for 15m --requests 4 --note "provider is slow today"
  pollgate ops close op_5f2c9a1e --note "re-run tomorrow"
  pollgate ops list --provider openai-batch --json | jq '.operations[].operation_id'
`

func runOps(ctx context.Context, env Env) error {
	if len(env.Args) == 0 {
		fmt.Fprint(env.Stderr, opsUsage)
		return Usage("ops needs a subcommand (hint: pollgate ops list)")
	}
	sub, args := env.Args[0], env.Args[1:]
	switch sub {
	case "-h", "--help", "help":
		fmt.Fprint(env.Stdout, opsUsage)
		return nil
	case "list":
		return opsList(ctx, env, args)
	case "show":
		return opsShow(ctx, env, args)
	case "extend":
		return opsExtend(ctx, env, args)
	case "close", "allow-resubmission":
		return opsAction(ctx, env, sub, args)
	}
	return Usage("unknown ops subcommand %q (hint: pollgate ops -h)", sub)
}

// opsFlags builds the flag set of one ops subcommand.
func opsFlags(env Env, name string, cf *clientFlags) *flag.FlagSet {
	fs := flag.NewFlagSet("ops "+name, flag.ContinueOnError)
	fs.SetOutput(env.Stderr)
	fs.Usage = func() { fmt.Fprint(env.Stderr, opsUsage) }
	cf.register(fs, true)
	return fs
}

// parseOps parses args and checks the number of positional arguments.
func parseOps(fs *flag.FlagSet, args []string, name string, want int) ([]string, error) {
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, Usage("bad flags for ops %s (hint: pollgate ops -h)", name)
	}
	if len(pos) != want {
		if want == 0 {
			return nil, Usage("ops %s takes no arguments, got %q", name, pos)
		}
		return nil, Usage("ops %s needs one operation id (hint: pollgate ops list)", name)
	}
	return pos, nil
}

func opsList(ctx context.Context, env Env, args []string) error {
	var cf clientFlags
	fs := opsFlags(env, "list", &cf)
	phase := fs.String("phase", "", "only operations in this phase")
	provider := fs.String("provider", "", "only operations of this provider")
	limit := fs.Int("limit", 0, "at most N operations (default all)")
	if _, err := parseOps(fs, args, "list", 0); err != nil {
		return helpOK(err)
	}
	if *limit < 0 {
		return Usage("--limit must be positive")
	}
	c, err := newAdminClient(&cf, env.Getenv)
	if err != nil {
		return err
	}
	var all []*rules.Operation
	cursor := ""
	for {
		q := url.Values{}
		if *phase != "" {
			q.Set("phase", *phase)
		}
		if *provider != "" {
			q.Set("provider", *provider)
		}
		if cursor != "" {
			q.Set("cursor", cursor)
		}
		pageSize := 500
		if *limit > 0 {
			pageSize = min(pageSize, *limit-len(all))
		}
		q.Set("limit", strconv.Itoa(pageSize))
		var page admin.ListResponse
		if err := c.call(ctx, "GET", "/api/operations?"+q.Encode(), nil, &page); err != nil {
			return err
		}
		all = append(all, page.Operations...)
		cursor = page.NextCursor
		if cursor == "" || (*limit > 0 && len(all) >= *limit) {
			break
		}
	}
	if cf.json {
		if all == nil {
			all = []*rules.Operation{}
		}
		return printJSON(env.Stdout, admin.ListResponse{Operations: all, NextCursor: cursor})
	}
	if len(all) == 0 {
		fmt.Fprintln(env.Stdout, "no operations")
		return nil
	}
	tw := tabwriter.NewWriter(env.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "OPERATION\tPROVIDER\tJOB\tPHASE\tREASON\tSTATE\tREQUESTS\tDEADLINE (UTC)\tUPDATED (UTC)")
	for _, op := range all {
		reason := "-"
		if op.Escalation != nil {
			reason = string(op.Escalation.Reason)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d/%d\t%s\t%s\n", op.ID, op.Provider, cell(op.JobID, 28), op.Phase, reason,
			cell(op.LastState, 20), op.Used.StatusRequests, op.Budget.StatusRequests, stamp(op.DeadlineAt), stamp(op.UpdatedAt))
	}
	return tw.Flush()
}

func opsShow(ctx context.Context, env Env, args []string) error {
	var cf clientFlags
	fs := opsFlags(env, "show", &cf)
	pos, err := parseOps(fs, args, "show", 1)
	if err != nil {
		return helpOK(err)
	}
	c, err := newAdminClient(&cf, env.Getenv)
	if err != nil {
		return err
	}
	var sr admin.ShowResponse
	if err := c.call(ctx, "GET", "/api/operations/"+url.PathEscape(pos[0]), nil, &sr); err != nil {
		return err
	}
	if cf.json {
		return printJSON(env.Stdout, sr)
	}
	printOperation(env.Stdout, sr)
	return nil
}

func printOperation(w io.Writer, sr admin.ShowResponse) {
	op := sr.Operation
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	phase := string(op.Phase)
	if op.Escalation != nil {
		phase += " (" + string(op.Escalation.Reason) + ")"
	}
	row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
	row("operation", op.ID)
	row("provider", op.Provider)
	row("job", op.JobID)
	row("phase", phase)
	row("last state", orDash(op.LastState))
	if op.LastHTTP != 0 {
		row("last HTTP", fmt.Sprintf("%d at %s", op.LastHTTP, stamp(op.LastHTTPAt)))
	}
	row("started", stamp(op.StartedAt))
	row("deadline", stamp(op.DeadlineAt))
	row("requests", fmt.Sprintf("%d of %d used (transport failures %d of %d, early polls %d)", op.Used.StatusRequests, op.Budget.StatusRequests,
		op.Used.TransportFailures, op.Budget.TransportFailures, op.Used.EarlyPolls))
	if op.Phase == rules.PhaseWaiting && !op.NextPollAt.IsZero() {
		row("next poll", fmt.Sprintf("%s (%s)", stamp(op.NextPollAt), op.DelaySource))
	}
	for i, x := range op.Extensions {
		row(fmt.Sprintf("extension %d", i+1), fmt.Sprintf("%s and %d requests by %s at %s", shortDur(x.Duration.String()), x.StatusRequests, x.By, stamp(x.At)))
	}
	if op.Phase == rules.PhaseClosed {
		row("closed", fmt.Sprintf("by %s at %s", op.ClosedBy, stamp(op.ClosedAt)))
	}
	if op.ResubmissionAllowed {
		row("resubmission", "one resubmission allowed")
	}
	tw.Flush()
	if sr.Message != "" {
		fmt.Fprintf(w, "\nmessage:\n%s\n", wrap(sr.Message, "  ", 100))
	}
	if op.Escalation != nil && len(op.Escalation.Options) > 0 && (op.Phase == rules.PhaseEscalated || op.Phase == rules.PhaseStopped) {
		fmt.Fprintln(w, "\noptions:")
		hasClose := false
		for _, o := range op.Escalation.Options {
			fmt.Fprintf(w, "  - %s\n", o.Description)
			switch o.Action {
			case "extend":
				fmt.Fprintf(w, "      pollgate ops extend %s --for %s --requests %d\n", op.ID, shortDur(o.DurationText), o.StatusRequests)
			case "close":
				hasClose = true
				fmt.Fprintf(w, "      pollgate ops close %s\n", op.ID)
			case "allow_resubmission":
				fmt.Fprintf(w, "      pollgate ops allow-resubmission %s\n", op.ID)
			}
		}
		if !hasClose {
			fmt.Fprintf(w, "  - acknowledge and stop here\n      pollgate ops close %s\n", op.ID)
		}
	}
	fmt.Fprintln(w, "\nstory (UTC):")
	for _, l := range sr.Story {
		fmt.Fprintf(w, "  %s\n", l)
	}
}

func opsExtend(ctx context.Context, env Env, args []string) error {
	var cf clientFlags
	fs := opsFlags(env, "extend", &cf)
	dur := fs.Duration("for", 0, "additional time from now, within the offered bound (e.g. 15m)")
	requests := fs.Int("requests", 0, "additional status requests, within the offered bound")
	note := fs.String("note", "", "why (kept in the audit log)")
	by := fs.String("by", "", "who approves (default $USER)")
	pos, err := parseOps(fs, args, "extend", 1)
	if err != nil {
		return helpOK(err)
	}
	if *dur <= 0 || *requests <= 0 {
		return Usage("ops extend needs --for DURATION and --requests N (hint: pollgate ops show %s lists the offered bounds)", pos[0])
	}
	who, err := approver(*by, env.Getenv)
	if err != nil {
		return err
	}
	c, err := newAdminClient(&cf, env.Getenv)
	if err != nil {
		return err
	}
	var or admin.OperationResponse
	req := admin.ExtendRequest{Duration: dur.String(), StatusRequests: *requests, By: who, Note: *note}
	if err := c.call(ctx, "POST", "/api/operations/"+url.PathEscape(pos[0])+"/extend", req, &or); err != nil {
		return refused("extension", err)
	}
	if cf.json {
		return printJSON(env.Stdout, or)
	}
	op := or.Operation
	fmt.Fprintf(env.Stdout, "extended %s by %s with %d more status requests (approved by %s)\n", op.ID, shortDur(dur.String()), *requests, who)
	fmt.Fprintf(env.Stdout, "new deadline %s, budget %d status requests (%d used); the next poll is allowed now\n",
		stamp(op.DeadlineAt), op.Budget.StatusRequests, op.Used.StatusRequests)
	return nil
}

func opsAction(ctx context.Context, env Env, name string, args []string) error {
	var cf clientFlags
	fs := opsFlags(env, name, &cf)
	note := fs.String("note", "", "why (kept in the audit log)")
	by := fs.String("by", "", "who decides (default $USER)")
	pos, err := parseOps(fs, args, name, 1)
	if err != nil {
		return helpOK(err)
	}
	who, err := approver(*by, env.Getenv)
	if err != nil {
		return err
	}
	c, err := newAdminClient(&cf, env.Getenv)
	if err != nil {
		return err
	}
	var or admin.OperationResponse
	if err := c.call(ctx, "POST", "/api/operations/"+url.PathEscape(pos[0])+"/"+name, admin.ActionRequest{By: who, Note: *note}, &or); err != nil {
		return refused(name, err)
	}
	if cf.json {
		return printJSON(env.Stdout, or)
	}
	switch name {
	case "close":
		fmt.Fprintf(env.Stdout, "closed %s (%s acknowledged by %s); agents keep getting the escalation body\n",
			or.Operation.ID, reasonOf(or.Operation), who)
	default:
		fmt.Fprintf(env.Stdout, "allowed one resubmission for %s (by %s)\n", or.Operation.ID, who)
	}
	return nil
}

// refused prefixes a 409 answer so the operator sees it was a decision,
// not a failure.
func refused(what string, err error) error {
	var ae *apiError
	if errors.As(err, &ae) && ae.Status == 409 && !strings.Contains(ae.Body.Error, "refused") {
		return fmt.Errorf("%s refused: %w", what, err)
	}
	return err
}

func approver(by string, getenv func(string) string) (string, error) {
	for _, v := range []string{by, getenv("USER"), getenv("LOGNAME")} {
		if v = strings.TrimSpace(v); v != "" {
			return v, nil
		}
	}
	return "", Usage("cannot tell who decides: $USER is not set (hint: pass --by NAME)")
}

// helpOK turns -h into a clean exit.
func helpOK(err error) error {
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	return err
}

func reasonOf(op *rules.Operation) string {
	if op.Escalation == nil {
		return "no escalation"
	}
	return string(op.Escalation.Reason)
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05")
}

func cell(s string, n int) string {
	if s == "" {
		return "-"
	}
	if len(s) > n {
		return s[:n-1] + "~"
	}
	return s
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// shortDur prints "15m" for "15m0s".
func shortDur(s string) string {
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// wrap breaks text into lines of at most width columns (words longer than
// width stay whole), each starting with indent.
func wrap(text, indent string, width int) string {
	var b strings.Builder
	n := 0
	for _, word := range strings.Fields(text) {
		switch {
		case n == 0:
			b.WriteString(indent)
			n = len(indent)
		case n+1+len(word) > width:
			b.WriteString("\n" + indent)
			n = len(indent)
		default:
			b.WriteByte(' ')
			n++
		}
		b.WriteString(word)
		n += len(word)
	}
	return b.String()
}
