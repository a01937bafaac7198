package cli

import (
	"bytes"
	"context"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"pollgate/ca"
)

func envRunCLI(t *testing.T, args []string, env map[string]string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := Run(context.Background(), args, Env{Stdout: &out, Stderr: &errb, Getenv: func(k string) string { return env[k] }})
	return code, out.String(), errb.String()
}

func TestEnvPrintsEvalableExports(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data dir with 'quote")
	if _, err := ca.Create(dir, ca.Options{}, os.Getenv); err != nil {
		t.Fatal(err)
	}
	code, out, errs := envRunCLI(t, []string{"env", "--data", dir, "--listen", "0.0.0.0:9090"}, nil)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("no sh")
	}
	script := out + `
printf '%s\n' "$HTTPS_PROXY" "$HTTP_PROXY" "$http_proxy" "$SSL_CERT_FILE" "$REQUESTS_CA_BUNDLE" "$CURL_CA_BUNDLE" "$NODE_EXTRA_CA_CERTS" "$NODE_USE_ENV_PROXY"`
	got, err := exec.Command(sh, "-c", script).Output()
	if err != nil {
		t.Fatalf("eval failed: %v\n%s", err, out)
	}
	abs, _ := filepath.Abs(dir)
	bundle, caFile := filepath.Join(abs, "bundle.pem"), filepath.Join(abs, "ca.pem")
	want := strings.Join([]string{"http://127.0.0.1:9090", "http://127.0.0.1:9090", "http://127.0.0.1:9090", bundle, bundle, bundle, caFile, "1"}, "\n") + "\n"
	if string(got) != want {
		t.Fatalf("after eval:\n%s\nwant:\n%s", got, want)
	}
}

func TestEnvWithoutCA(t *testing.T) {
	code, _, errs := envRunCLI(t, []string{"env", "--data", t.TempDir()}, nil)
	if code != ExitError || !strings.Contains(errs, "hint:") || !strings.Contains(errs, "ca init") {
		t.Fatalf("exit %d, stderr %q", code, errs)
	}
}

func TestEnvFromEnvironment(t *testing.T) {
	dir := t.TempDir()
	if _, err := ca.Create(dir, ca.Options{}, os.Getenv); err != nil {
		t.Fatal(err)
	}
	code, out, _ := envRunCLI(t, []string{"env"}, map[string]string{"POLLGATE_DATA": dir, "POLLGATE_LISTEN": "10.1.2.3:8443"})
	if code != 0 || !strings.Contains(out, "export HTTPS_PROXY=http://10.1.2.3:8443\n") {
		t.Fatalf("exit %d:\n%s", code, out)
	}
}

func TestCAInit(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	code, out, errs := envRunCLI(t, []string{"ca", "init", "--data", dir}, nil)
	if code != 0 || !strings.Contains(out, "ca.pem") {
		t.Fatalf("exit %d: %s %s", code, out, errs)
	}
	fi, err := os.Stat(filepath.Join(dir, "ca-key.pem"))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file: %v %v", err, fi)
	}
	first, _ := os.ReadFile(filepath.Join(dir, "ca.pem"))
	// Refuses to overwrite without --force.
	code, _, errs = envRunCLI(t, []string{"ca", "init", "--data", dir}, nil)
	if code != ExitError || !strings.Contains(errs, "--force") {
		t.Fatalf("second init: exit %d, %q", code, errs)
	}
	if again, _ := os.ReadFile(filepath.Join(dir, "ca.pem")); !bytes.Equal(again, first) {
		t.Fatal("refused init still changed ca.pem")
	}
	code, _, errs = envRunCLI(t, []string{"ca", "init", "--data", dir, "--force"}, nil)
	if code != 0 {
		t.Fatalf("--force: exit %d %s", code, errs)
	}
	if again, _ := os.ReadFile(filepath.Join(dir, "ca.pem")); bytes.Equal(again, first) {
		t.Fatal("--force did not replace the CA")
	}
}

func TestCAInitNameConstraints(t *testing.T) {
	tmp := t.TempDir()
	config := filepath.Join(tmp, "providers.yaml")
	contract := strings.Replace(e2eContract, "%s", "30s", 1)
	contract = strings.Replace(contract, "%d", "3", 1)
	contract = strings.Replace(contract, "%s", "https://api.example.com", 1)
	if err := os.WriteFile(config, []byte(contract), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(tmp, "data")
	code, out, errs := envRunCLI(t, []string{"ca", "init", "--data", dir, "--config", config, "--name-constraints"}, nil)
	if code != 0 || !strings.Contains(out, "name constraints: api.example.com") {
		t.Fatalf("exit %d: %s %s", code, out, errs)
	}
	a, err := ca.Load(dir, ca.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if c := a.Certificate(); !c.PermittedDNSDomainsCritical || len(c.PermittedDNSDomains) != 1 || c.PermittedDNSDomains[0] != "api.example.com" {
		t.Fatalf("constraints: %v critical=%v", c.PermittedDNSDomains, c.PermittedDNSDomainsCritical)
	}
}

func TestServeFlagsFromEnvironment(t *testing.T) {
	cfg, err := serveParseFlags(Env{Args: []string{"--listen", "127.0.0.1:1"}, Getenv: func(k string) string {
		return map[string]string{"POLLGATE_LISTEN": "0.0.0.0:2", "POLLGATE_ADMIN": "127.0.0.1:3", "POLLGATE_DATA": "/d",
			"POLLGATE_REDIS_URL": "redis://r:6379/0", "POLLGATE_UPSTREAM_CA": "/ca.pem", "POLLGATE_CONFIG": "/p.yaml", "POLLGATE_MAX_BODY": "2MiB", "POLLGATE_RETENTION": "24h"}[k]
	}, Stderr: &bytes.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.listen != "127.0.0.1:1" || cfg.admin != "127.0.0.1:3" || cfg.data != "/d" || cfg.redis != "redis://r:6379/0" ||
		cfg.upstreamCA != "/ca.pem" || cfg.config != "/p.yaml" || cfg.maxBody != 2<<20 || cfg.retention != 24*time.Hour {
		t.Fatalf("flags over env: %+v", cfg)
	}
	def, err := serveParseFlags(Env{Getenv: func(string) string { return "" }, Stderr: &bytes.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	if def.listen != "127.0.0.1:8080" || def.admin != "127.0.0.1:8081" || def.data != "./pollgate-data" || def.maxBody != 1<<20 || def.config != "providers.yaml" || def.retention != 7*24*time.Hour {
		t.Fatalf("defaults: %+v", def)
	}
	if _, err := serveParseFlags(Env{Args: []string{"--max-body", "lots"}, Getenv: func(string) string { return "" }, Stderr: &bytes.Buffer{}}); err == nil {
		t.Fatal("bad --max-body accepted")
	}
	for _, bad := range []string{"forever", "0s", "-1h"} {
		if _, err := serveParseFlags(Env{Args: []string{"--retention", bad}, Getenv: func(string) string { return "" }, Stderr: &bytes.Buffer{}}); err == nil {
			t.Fatalf("bad --retention %q accepted", bad)
		}
	}
}

func TestServeRefuser(t *testing.T) {
	listen, _ := net.ResolveTCPAddr("tcp", "0.0.0.0:8080")
	admin, _ := net.ResolveTCPAddr("tcp", "127.0.0.1:8081")
	refuse := serveRefuser(listen, admin)
	for hp, want := range map[string]bool{
		"127.0.0.1:8080":           true, // the proxy itself (listening on all addresses)
		"localhost:8081":           true, // the admin listener
		"127.0.0.1:8081":           true,
		"169.254.169.254:80":       true, // cloud metadata
		"api.openai.com:443":       false,
		"127.0.0.1:9000":           false,
		"metadata.google.internal": true,
	} {
		if got := refuse(hp); got != want {
			t.Errorf("refuse(%q) = %v, want %v", hp, got, want)
		}
	}
}

// Without --config and without ./providers.yaml, serve runs on the
// embedded default contract when main provides one.
func TestServeEmbeddedContract(t *testing.T) {
	if _, err := os.Stat("providers.yaml"); err == nil {
		t.Skip("a providers.yaml exists in the test directory")
	}
	shipped, err := os.ReadFile("../providers.yaml")
	if err != nil {
		t.Skipf("no shipped contract: %v", err)
	}
	old := EmbeddedContract
	EmbeddedContract = shipped
	defer func() { EmbeddedContract = old }()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stderr := &e2eBuffer{}
	done := make(chan int, 1)
	go func() {
		done <- Run(ctx, []string{"serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--data", t.TempDir()},
			Env{Stdout: io.Discard, Stderr: stderr, Getenv: func(string) string { return "" }})
	}()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(stderr.String(), "pollgate: proxy on") && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("serve exited %d:\n%s", code, stderr.String())
	}
	if !strings.Contains(stderr.String(), "embedded default contract") {
		t.Fatalf("embedded contract not used:\n%s", stderr.String())
	}
}
