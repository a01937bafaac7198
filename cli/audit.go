package cli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"pollgate/audit"
	"pollgate/ledger"
)

func init() {
	register("audit", "export the tamper-evident audit log, or verify an export offline", runAudit)
}

const auditUsage = `Usage:
  pollgate audit export [--out FILE] [--admin ADDR] [--data DIR] [--decrypt --key FILE]
  pollgate audit verify FILE

export writes every operation's audit chain as JSONL: one line per decision
(with its hash chain link) and one head line per operation. It asks the
running server's admin API; when no server answers at the admin address, it
reads the ledger in the data directory directly (the server must be stopped:
the embedded ledger allows one process at a time). It says on stderr which
source it used.

With --decrypt --key FILE, every line of an encrypted log also carries the
decrypted decision as "entry"; the chain fields stay as stored, so the
export still verifies.

verify checks an export offline - no server, ledger or key needed (R26):
every chain's order, links and hashes, and each head's count. It prints the
number of entries and operations checked, or the first broken entry and why.
FILE "-" reads standard input.

Exit codes:
  0  export written / every chain intact
  1  tampering found, or the export failed (server error, ledger locked, bad key)
  2  bad flags or arguments

Examples:
  pollgate audit export --out audit.jsonl
  pollgate audit export --data /var/lib/pollgate --out audit.jsonl   # server stopped
  pollgate audit export --decrypt --key /etc/pollgate/audit.key --out readable.jsonl
  pollgate audit verify audit.jsonl
`

func runAudit(ctx context.Context, env Env) error {
	if len(env.Args) == 0 {
		fmt.Fprint(env.Stderr, auditUsage)
		return Usage("audit needs a subcommand (hint: pollgate audit verify FILE)")
	}
	switch sub, args := env.Args[0], env.Args[1:]; sub {
	case "-h", "--help", "help":
		fmt.Fprint(env.Stdout, auditUsage)
		return nil
	case "export":
		return auditExport(ctx, env, args)
	case "verify":
		return auditVerify(env, args)
	default:
		return Usage("unknown audit subcommand %q (hint: pollgate audit -h)", sub)
	}
}

func auditFlags(env Env, name string) *flag.FlagSet {
	fs := flag.NewFlagSet("audit "+name, flag.ContinueOnError)
	fs.SetOutput(env.Stderr)
	fs.Usage = func() { fmt.Fprint(env.Stderr, auditUsage) }
	return fs
}

func auditExport(ctx context.Context, env Env, args []string) error {
	var cf clientFlags
	fs := auditFlags(env, "export")
	cf.register(fs, false)
	out := fs.String("out", "", "write to FILE (mode 0600) instead of standard output")
	decrypt := fs.Bool("decrypt", false, "add the decrypted entry to every line (needs --key)")
	keyFile := fs.String("key", "", "audit key file for --decrypt")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return Usage("bad flags for audit export (hint: pollgate audit -h)")
	}
	if len(pos) > 0 {
		return Usage("audit export takes no arguments, got %q (hint: --out FILE)", pos)
	}
	if *decrypt != (*keyFile != "") {
		return Usage("--decrypt and --key go together (hint: pollgate audit export --decrypt --key audit.key)")
	}
	var key []byte
	if *decrypt {
		if key, err = audit.LoadKey(*keyFile); err != nil {
			return err
		}
	}

	// Write to a temporary file next to --out, renamed on success, so a
	// failed export never leaves a file that looks complete.
	w := env.Stdout
	var tmp *os.File
	if *out != "" {
		tmp, err = os.CreateTemp(filepath.Dir(*out), ".pollgate-audit-*")
		if err != nil {
			return fmt.Errorf("failed to create %s: %w", *out, err)
		}
		defer os.Remove(tmp.Name())
		defer tmp.Close()
		if err := tmp.Chmod(0o600); err != nil {
			return fmt.Errorf("failed to create %s: %w", *out, err)
		}
		w = tmp
	}
	bw := bufio.NewWriter(w)
	var sink io.Writer = bw
	var dw *decryptWriter
	if key != nil {
		dw = &decryptWriter{w: bw, key: key}
		sink = dw
	}
	source, err := exportFrom(ctx, env, &cf, sink)
	if err != nil {
		return err
	}
	if dw != nil {
		if err := dw.flush(); err != nil {
			return err
		}
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("failed to write the export: %w", err)
	}
	if tmp != nil {
		if err := tmp.Sync(); err != nil {
			return fmt.Errorf("failed to write %s: %w", *out, err)
		}
		if err := tmp.Close(); err != nil {
			return fmt.Errorf("failed to write %s: %w", *out, err)
		}
		if err := os.Rename(tmp.Name(), *out); err != nil {
			return fmt.Errorf("failed to write %s: %w", *out, err)
		}
		fmt.Fprintf(env.Stderr, "pollgate: audit log exported from %s to %s (check it with: pollgate audit verify %s)\n", source, *out, *out)
		return nil
	}
	fmt.Fprintf(env.Stderr, "pollgate: audit log exported from %s\n", source)
	return nil
}

// exportFrom streams the export from the admin API, or from the data
// directory when no server answers. It returns where the export came from.
func exportFrom(ctx context.Context, env Env, cf *clientFlags, w io.Writer) (string, error) {
	c, cerr := newAdminClient(cf, env.Getenv)
	if cerr == nil {
		resp, err := c.request(ctx, "GET", "/api/audit/export", nil)
		if err == nil {
			defer resp.Body.Close()
			if _, err := io.Copy(w, resp.Body); err != nil {
				return "", fmt.Errorf("failed to read the export from %s: %w", c.base, err)
			}
			return "the admin API at " + c.base, nil
		}
		if !errors.Is(err, errUnreachable) {
			return "", err
		}
		cerr = err
	}
	dir := cf.dataDir(env.Getenv)
	if _, err := os.Stat(filepath.Join(dir, ledger.BoltFile)); err != nil {
		return "", fmt.Errorf("%v; and there is no ledger in %s to read instead (hint: start `pollgate serve`, pass --admin ADDR, or --data with the server's data directory; a Redis-backed server is exported through its admin API)", cerr, dir)
	}
	store, err := ledger.OpenBolt(dir, ledger.BoltOptions{LockTimeout: 500 * time.Millisecond})
	if err != nil {
		return "", fmt.Errorf("%w (hint: a running server holds the ledger; export through its admin API with --admin ADDR)", err)
	}
	defer store.Close()
	if err := store.Export(ctx, w); err != nil {
		return "", err
	}
	return "the ledger in " + dir, nil
}

// decryptWriter adds the decrypted entry to every encrypted envelope line
// of an export stream, leaving the chain fields (and head lines) as stored.
type decryptWriter struct {
	w   io.Writer
	key []byte
	buf []byte
	n   int // lines seen
}

func (d *decryptWriter) Write(p []byte) (int, error) {
	d.buf = append(d.buf, p...)
	for {
		i := bytes.IndexByte(d.buf, '\n')
		if i < 0 {
			return len(p), nil
		}
		if err := d.line(d.buf[:i]); err != nil {
			return 0, err
		}
		d.buf = d.buf[i+1:]
	}
}

func (d *decryptWriter) flush() error {
	if len(bytes.TrimSpace(d.buf)) == 0 {
		return nil
	}
	err := d.line(d.buf)
	d.buf = nil
	return err
}

func (d *decryptWriter) line(raw []byte) error {
	d.n++
	var env audit.Envelope
	var probe struct {
		Type string `json:"type"`
	}
	if json.Unmarshal(raw, &probe) != nil || probe.Type != "" || json.Unmarshal(raw, &env) != nil || !env.Encrypted {
		_, err := d.w.Write(append(raw, '\n'))
		return err
	}
	e, err := audit.DecodeEntry(env, d.key)
	if err != nil {
		return fmt.Errorf("line %d: %w", d.n, err)
	}
	out, err := json.Marshal(struct {
		audit.Envelope
		Entry audit.Entry `json:"entry"`
	}{env, e})
	if err != nil {
		return err
	}
	_, err = d.w.Write(append(out, '\n'))
	return err
}

func auditVerify(env Env, args []string) error {
	fs := auditFlags(env, "verify")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return Usage("bad flags for audit verify (hint: pollgate audit verify FILE)")
	}
	if len(pos) != 1 {
		return Usage("audit verify needs one export file (hint: pollgate audit export --out audit.jsonl && pollgate audit verify audit.jsonl)")
	}
	var r io.Reader
	name := pos[0]
	if name == "-" {
		r, name = env.Stdin, "standard input"
	} else {
		f, err := os.Open(name)
		if err != nil {
			return fmt.Errorf("failed to open the export: %w", err)
		}
		defer f.Close()
		r = f
	}
	rep, err := audit.Verify(r)
	if err != nil {
		return err
	}
	if rep.OK() {
		if rep.Entries == 0 {
			fmt.Fprintf(env.Stdout, "ok: %s holds no audit entries\n", name)
			return nil
		}
		fmt.Fprintf(env.Stdout, "ok: %d entries in %d operations checked, every chain intact\n", rep.Entries, rep.Operations)
		return nil
	}
	fmt.Fprintf(env.Stdout, "TAMPERED: %s\n", rep.FirstBad.String())
	fmt.Fprintf(env.Stdout, "(%d entries in %d operations read)\n", rep.Entries, rep.Operations)
	return Exit(ExitError, fmt.Errorf("audit log %s fails verification at line %d (hint: compare with an earlier export or the server's ledger)", name, rep.FirstBad.Line))
}
