package cli

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

func runCheckCmd(t *testing.T, env map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = Run(context.Background(), append([]string{"check"}, args...), Env{
		Stdout: &out, Stderr: &errb,
		Getenv: func(k string) string { return env[k] },
	})
	return code, out.String(), errb.String()
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

const goodContract = `version: 1
providers:
  - name: one
    base_url: https://api.one.example
    status:
      request: GET /v1/jobs/{job_id}
      state: state
      states: {waiting: [running], success: [done]}
  - name: two
    base_url: https://api.two.example
    status:
      request: GET /v1/ops/{id}
      state: status
      states: {waiting: [queued], success: [ok]}
`

func TestCheckShippedContract(t *testing.T) {
	code, out, errOut := runCheckCmd(t, nil, "--config", "../providers.yaml")
	if code != ExitOK {
		t.Fatalf("shipped providers.yaml: exit %d\n%s", code, errOut)
	}
	if !regexp.MustCompile(`^ok: [6-9] providers \(contract [0-9a-f]{12}\)\n$`).MatchString(out) {
		t.Fatalf("unexpected output %q", out)
	}
}

func TestCheckGood(t *testing.T) {
	path := writeFile(t, "good.yaml", goodContract)
	code, out, _ := runCheckCmd(t, nil, "--config", path)
	if code != ExitOK || !regexp.MustCompile(`^ok: 2 providers \(contract [0-9a-f]{12}\)\n$`).MatchString(out) {
		t.Fatalf("exit %d, output %q", code, out)
	}
}

func TestCheckConfigFromEnvironment(t *testing.T) {
	path := writeFile(t, "env.yaml", goodContract)
	code, out, errOut := runCheckCmd(t, map[string]string{"POLLGATE_CONFIG": path})
	if code != ExitOK || !strings.HasPrefix(out, "ok: 2 providers") {
		t.Fatalf("POLLGATE_CONFIG not used: exit %d %q %q", code, out, errOut)
	}
	// The flag wins over the environment.
	bad := writeFile(t, "bad.yaml", "version: 2\n")
	code, _, _ = runCheckCmd(t, map[string]string{"POLLGATE_CONFIG": path}, "--config", bad)
	if code != ExitError {
		t.Fatalf("--config did not override POLLGATE_CONFIG: exit %d", code)
	}
}

func TestCheckReportsEveryProblem(t *testing.T) {
	path := writeFile(t, "providers.yaml", `version: 1
providers:
  - name: a
    base_url: ftp://nowhere
    status:
      request: GET /v1/jobs/{job_id}
      state: state
      states: {waiting: [running], success: [running]}
    policy: {deadline: -5m, max_status_requests: 0}
`)
	code, out, errOut := runCheckCmd(t, nil, "--config", path)
	if code != ExitError {
		t.Fatalf("exit %d, want 1", code)
	}
	if out != "" {
		t.Fatalf("nothing belongs on stdout for a bad contract, got %q", out)
	}
	for _, want := range []string{
		path + `:4: provider "a": base_url: "ftp://nowhere" has no http or https scheme (hint: `,
		path + `:8: provider "a": status.states: "running" is both waiting and success (hint: a state belongs to one category)`,
		path + `:9: provider "a": policy.deadline: "-5m" is not positive (hint: `,
		path + `:9: provider "a": policy.max_status_requests: 0 is below 1 (hint: `,
		"4 problems found",
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("missing %q in\n%s", want, errOut)
		}
	}
}

func TestCheckMissingFileAndUsage(t *testing.T) {
	code, _, errOut := runCheckCmd(t, nil, "--config", filepath.Join(t.TempDir(), "absent.yaml"))
	if code != ExitError || !strings.Contains(errOut, "failed to read contract") || !strings.Contains(errOut, "hint:") {
		t.Fatalf("missing file: exit %d %q", code, errOut)
	}
	code, _, _ = runCheckCmd(t, nil, "--nope")
	if code != ExitUsage {
		t.Fatalf("bad flag: exit %d, want 2", code)
	}
	code, _, _ = runCheckCmd(t, nil, "extra-arg")
	if code != ExitUsage {
		t.Fatalf("extra argument: exit %d, want 2", code)
	}
	code, _, errOut = runCheckCmd(t, nil, "-h")
	if code != ExitOK || !strings.Contains(errOut, "Examples:") {
		t.Fatalf("-h: exit %d %q", code, errOut)
	}
}
