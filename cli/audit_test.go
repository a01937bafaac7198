package cli

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"pollgate/audit"
	"pollgate/rules"
)

// exportFixture seeds two operations (3 and 2... entries) and exports them
// through the CLI from the running admin API.
func exportFixture(t *testing.T, key []byte) (*opsServer, string) {
	t.Helper()
	s := newOpsServer(t, key)
	s.seed.Escalated("acme", rules.ReasonDeadlineExceeded) // created, polled, escalated
	s.seed.Succeeded("globex")                             // created, polled, polled
	out := filepath.Join(t.TempDir(), "audit.jsonl")
	r := run(t, s.env(), "audit", "export", "--out", out)
	if r.code != 0 || !strings.Contains(r.stderr, "from the admin API") {
		t.Fatalf("audit export: %d %q", r.code, r.stderr)
	}
	if fi, err := os.Stat(out); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("export file: %v %v", fi, err)
	}
	return s, out
}

func readLines(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimRight(string(b), "\n"), "\n")
}

func writeLines(t *testing.T, lines []string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "tampered.jsonl")
	if err := os.WriteFile(p, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// R26: an edit, a deletion, a reordering or a truncation of the export is
// detected offline by `pollgate audit verify`, which names the first bad
// entry and exits 1.
func TestAuditVerifyDetectsTampering(t *testing.T) {
	_, out := exportFixture(t, nil)
	lines := readLines(t, out)
	// 3 entries + head, 3 entries + head.
	if len(lines) != 8 {
		t.Fatalf("export has %d lines:\n%s", len(lines), strings.Join(lines, "\n"))
	}
	var first audit.Envelope
	if err := json.Unmarshal([]byte(lines[0]), &first); err != nil {
		t.Fatal(err)
	}
	op := first.OperationID

	r := run(t, nil, "audit", "verify", out)
	if r.code != 0 || !strings.Contains(r.stdout, "ok: 6 entries in 2 operations checked, every chain intact") {
		t.Fatalf("verify intact export: %d %q %q", r.code, r.stdout, r.stderr)
	}
	// Also from standard input, with no server, ledger or key.
	var stdout, stderr bytes.Buffer
	raw, _ := os.ReadFile(out)
	if code := Run(context.Background(), []string{"audit", "verify", "-"}, Env{Stdin: bytes.NewReader(raw), Stdout: &stdout, Stderr: &stderr}); code != 0 {
		t.Errorf("verify from stdin: %d %s", code, stderr.String())
	}

	edit := func(line string) string {
		var env audit.Envelope
		if err := json.Unmarshal([]byte(line), &env); err != nil {
			t.Fatal(err)
		}
		env.Data = strings.Replace(env.Data, `"status_requests_used":1`, `"status_requests_used":0`, 1)
		if env.Data == "" || !strings.Contains(env.Data, `"status_requests_used":0`) {
			t.Fatalf("fixture: nothing to edit in %s", line)
		}
		b, _ := json.Marshal(env)
		return string(b)
	}
	cases := []struct {
		name  string
		lines []string
		want  string // regexp over stdout
	}{
		{"edited entry", []string{lines[0], edit(lines[1]), lines[2], lines[3]},
			`TAMPERED: line 2: operation ` + op + ` entry 2: hash does not match the entry's data \(entry edited\)`},
		{"deleted entry", []string{lines[0], lines[2], lines[3]},
			`TAMPERED: line 2: operation ` + op + ` entry 3: entries missing before this one`},
		{"reordered entries", []string{lines[0], lines[2], lines[1], lines[3]},
			`TAMPERED: line 2: operation ` + op + ` entry 3: `},
		{"truncated chain (last entry and head cut)", lines[:6],
			`TAMPERED: line 6: operation \S+ entry 2: chain head missing`},
		{"truncated mid-line", append(append([]string{}, lines[:7]...), lines[7][:len(lines[7])/2]),
			`TAMPERED: line 7: operation \S+ entry 3: chain head missing`},
		{"entry removed from the end, head kept", []string{lines[0], lines[1], lines[3]},
			`TAMPERED: line 3: operation ` + op + ` entry 3: chain truncated or extended: head says 3 entries, export has 2`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := run(t, nil, "audit", "verify", writeLines(t, c.lines))
			if r.code != 1 {
				t.Errorf("exit %d, want 1\n%s%s", r.code, r.stdout, r.stderr)
			}
			if !regexp.MustCompile(c.want).MatchString(r.stdout) {
				t.Errorf("stdout %q does not match /%s/", r.stdout, c.want)
			}
			if !strings.Contains(r.stderr, "fails verification at line") {
				t.Errorf("stderr %q", r.stderr)
			}
		})
	}
	if r := run(t, nil, "audit", "verify"); r.code != 2 {
		t.Errorf("verify without a file: %d", r.code)
	}
	if r := run(t, nil, "audit", "verify", filepath.Join(t.TempDir(), "none.jsonl")); r.code != 1 {
		t.Errorf("verify a missing file: %d", r.code)
	}
}

// With the server stopped, export reads the data directory; while another
// process holds the ledger and no API answers, it says so.
func TestAuditExportFromDataDir(t *testing.T) {
	s := newOpsServer(t, nil)
	s.seed.Escalated("acme", rules.ReasonJobNotFound)
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	down := ln.Addr().String()
	ln.Close()
	env := map[string]string{"POLLGATE_ADMIN_TOKEN": testToken}

	// Ledger still open (a server whose admin port we cannot reach).
	r := run(t, env, "audit", "export", "--admin", down, "--data", s.dir)
	if r.code != 1 || !strings.Contains(r.stderr, "locked by another process") {
		t.Errorf("locked ledger: %d %q", r.code, r.stderr)
	}
	s.srv.Close()
	if err := s.store.Close(); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "a.jsonl")
	r = run(t, env, "audit", "export", "--admin", down, "--data", s.dir, "--out", out)
	if r.code != 0 || !strings.Contains(r.stderr, "from the ledger in "+s.dir) {
		t.Fatalf("export from data dir: %d %q", r.code, r.stderr)
	}
	if r := run(t, nil, "audit", "verify", out); r.code != 0 || !strings.Contains(r.stdout, "3 entries in 1 operations") {
		t.Errorf("verify: %d %q", r.code, r.stdout)
	}
	// Neither a server nor a ledger: exit 1 with a hint.
	if r := run(t, env, "audit", "export", "--admin", down, "--data", t.TempDir()); r.code != 1 || !strings.Contains(r.stderr, "no ledger in") {
		t.Errorf("nothing to export: %d %q", r.code, r.stderr)
	}
}

// R26: encrypted entries verify without the key; --decrypt adds the
// readable entry and the export still verifies.
func TestAuditExportDecrypt(t *testing.T) {
	key := bytes.Repeat([]byte{0x42}, audit.KeySize)
	keyFile := filepath.Join(t.TempDir(), "audit.key")
	if err := os.WriteFile(keyFile, []byte(hex.EncodeToString(key)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s, out := exportFixture(t, key)
	raw, _ := os.ReadFile(out)
	if strings.Contains(string(raw), "submitted job") {
		t.Fatal("encrypted export holds plaintext stories")
	}
	if r := run(t, nil, "audit", "verify", out); r.code != 0 {
		t.Fatalf("verify encrypted export without key: %d %q", r.code, r.stdout)
	}
	dec := filepath.Join(t.TempDir(), "readable.jsonl")
	if r := run(t, s.env(), "audit", "export", "--decrypt", "--key", keyFile, "--out", dec); r.code != 0 {
		t.Fatalf("export --decrypt: %d %q", r.code, r.stderr)
	}
	n := 0
	for _, l := range readLines(t, dec) {
		var line struct {
			Type  string       `json:"type"`
			Entry *audit.Entry `json:"entry"`
		}
		if err := json.Unmarshal([]byte(l), &line); err != nil {
			t.Fatal(err)
		}
		if line.Type == "" {
			if line.Entry == nil || line.Entry.Story == "" {
				t.Errorf("line without decrypted entry: %s", l)
			}
			n++
		}
	}
	if n != 6 {
		t.Errorf("%d decrypted entries, want 6", n)
	}
	if r := run(t, nil, "audit", "verify", dec); r.code != 0 {
		t.Errorf("decrypted export no longer verifies: %q", r.stdout)
	}
	// Wrong key: exit 1, nothing written.
	bad := filepath.Join(t.TempDir(), "bad.key")
	os.WriteFile(bad, bytes.Repeat([]byte{1}, audit.KeySize), 0o600)
	out2 := filepath.Join(t.TempDir(), "x.jsonl")
	if r := run(t, s.env(), "audit", "export", "--decrypt", "--key", bad, "--out", out2); r.code != 1 || !strings.Contains(r.stderr, "wrong audit key") {
		t.Errorf("wrong key: %d %q", r.code, r.stderr)
	}
	if _, err := os.Stat(out2); !os.IsNotExist(err) {
		t.Errorf("a failed export left %s", out2)
	}
	if r := run(t, s.env(), "audit", "export", "--decrypt"); r.code != 2 {
		t.Errorf("--decrypt without --key: %d", r.code)
	}
}
