package cli

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

func runCLI(args ...string) (code int, stdout, stderr string) {
	var out, errb bytes.Buffer
	code = Run(context.Background(), args, Env{Stdout: &out, Stderr: &errb, Getenv: func(string) string { return "" }})
	return code, out.String(), errb.String()
}

// The dispatcher: usage errors exit 2 with the message on stderr; help is a
// success on stdout; every documented subcommand is registered.
func TestDispatch(t *testing.T) {
	if code, out, errs := runCLI(); code != ExitUsage || out != "" || !strings.Contains(errs, "Commands:") {
		t.Fatalf("no arguments: code %d stdout %q stderr %q", code, out, errs)
	}
	for _, h := range []string{"help", "-h", "--help"} {
		if code, out, _ := runCLI(h); code != ExitOK || !strings.Contains(out, "Commands:") {
			t.Fatalf("%s: code %d stdout %q", h, code, out)
		}
	}
	code, out, errs := runCLI("frobnicate")
	if code != ExitUsage || out != "" || !strings.Contains(errs, `pollgate: unknown command "frobnicate" (hint: run 'pollgate help'`) {
		t.Fatalf("unknown command: code %d stdout %q stderr %q", code, out, errs)
	}
	_, help, _ := runCLI("help")
	for _, name := range []string{"serve", "check", "env", "ca", "ops", "report", "audit"} {
		if _, ok := commands[name]; !ok || !strings.Contains(help, "  "+name+" ") {
			t.Errorf("command %q is not registered or not listed in help", name)
		}
	}
}
