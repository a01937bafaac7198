package rules

import (
	"errors"
	"net/url"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"
)

func mustLoad(t testing.TB, path string) *Contract {
	t.Helper()
	c, err := Load(path)
	if err != nil {
		t.Fatalf("load %s: %v", path, err)
	}
	return c
}

func TestShippedContractLoads(t *testing.T) {
	c := mustLoad(t, "../providers.yaml")
	if len(c.Providers) < 6 {
		t.Fatalf("shipped contract has %d providers, want at least 6", len(c.Providers))
	}
	if len(c.Hash) != 12 {
		t.Fatalf("hash %q is not 12 hex digits", c.Hash)
	}
	for _, name := range []string{"openai-batch", "anthropic-message-batches", "replicate", "assemblyai", "azure-document-intelligence", "google-speech-lro"} {
		if c.ProviderByName(name) == nil {
			t.Errorf("provider %s missing", name)
		}
	}
	// R5: per-provider schedules differ from the defaults.
	if p := c.ProviderByName("replicate"); p.Policy.Backoff.Base != time.Second || p.Policy.Backoff.JitterFloor != 0.5 {
		t.Errorf("replicate backoff = %+v", p.Policy.Backoff)
	}
}

func TestDefaultsWhenSilent(t *testing.T) {
	c, err := Parse("min.yaml", []byte(`version: 1
providers:
  - name: min
    base_url: https://api.min.example
    status:
      request: GET /jobs/{id}
      state: state
      states: {waiting: [running], success: [done], failure: [broken]}
`))
	if err != nil {
		t.Fatal(err)
	}
	p := c.Providers[0]
	want := Policy{
		Deadline: 40 * time.Minute, MaxStatusRequests: 12, MaxTransportFailures: 3, MaxRateLimited: 3,
		Backoff:       Backoff{Base: 5 * time.Second, Max: 120 * time.Second, JitterFloor: 0.5},
		NotFoundGrace: 30 * time.Second, Lease: 30 * time.Second,
		Extension: ExtensionPolicy{Duration: 15 * time.Minute, StatusRequests: 4, MaxExtensions: 2},
		EarlyPoll: "reject",
	}
	if !reflect.DeepEqual(p.Policy, want) {
		t.Fatalf("policy = %+v\nwant     %+v", p.Policy, want)
	}
	if p.Escalation.StatusCode != 200 || p.Escalation.StateValue != "broken" {
		t.Fatalf("escalation defaults = %+v, want 200 and the first failure state", p.Escalation)
	}
	if p.AccountHeader != "Authorization" {
		t.Fatalf("account header default = %q", p.AccountHeader)
	}
	if c.Notify != nil || p.Notify != nil {
		t.Fatal("notify must be nil when absent")
	}
}

func TestPolicyMerge(t *testing.T) {
	c := mustLoad(t, "testdata/example.yaml")
	p := c.ProviderByName("example-exports")
	if p.Policy.Deadline != time.Hour || p.Policy.MaxStatusRequests != 12 {
		t.Fatalf("override not merged: %+v", p.Policy)
	}
	b := c.ProviderByName("bare")
	// Field-by-field merge inside backoff: the floor comes from defaults.
	if b.Policy.Backoff != (Backoff{Base: 500 * time.Millisecond, Max: 2 * time.Second, JitterFloor: 0.5}) {
		t.Fatalf("backoff merge: %+v", b.Policy.Backoff)
	}
	if b.Policy.BusinessDeadline != 10*time.Minute || b.Escalation.StateValue != "failed" {
		t.Fatalf("bare: %+v %+v", b.Policy, b.Escalation)
	}
	if c.Notify == nil || c.Notify.Webhook != "https://hooks.example.com/pollgate" {
		t.Fatalf("defaults.notify = %+v", c.Notify)
	}
	if b.BaseURL.String() != "http://127.0.0.1:8080/prefix" {
		t.Fatalf("base url normalised to %q", b.BaseURL)
	}
}

func TestHashIsOfFileBytes(t *testing.T) {
	data, err := os.ReadFile("testdata/example.yaml")
	if err != nil {
		t.Fatal(err)
	}
	a, _ := Parse("a", data)
	b, _ := Parse("b", append(append([]byte(nil), data...), []byte("\n# comment\n")...))
	if a.Hash == b.Hash {
		t.Fatal("a changed file must change the hash")
	}
	a2, _ := Parse("a", data)
	if a.Hash != a2.Hash {
		t.Fatal("hash not deterministic")
	}
}

// validation: each problem kind yields a line with the right number and a hint.
func TestValidationProblems(t *testing.T) {
	const head = "version: 1\nproviders:\n"
	// provider builds a provider entry starting at line 3.
	provider := func(name, base, status string, extra ...string) string {
		s := "  - name: " + name + "\n    base_url: " + base + "\n    status:\n" + status
		for _, e := range extra {
			s += e
		}
		return s
	}
	okStatus := "      request: GET /v1/jobs/{job_id}\n      state: state\n      states: {waiting: [running], success: [done]}\n"

	tests := []struct {
		name string
		yaml string
		want string // substring of the problem line, including line number
		hint string // substring of the hint
	}{
		{"version", "version: 2\nproviders:\n" + provider("a", "https://a.example", okStatus), "x.yaml:1: version: unsupported schema version 2", "version: 1"},
		{"version missing", "providers:\n" + provider("a", "https://a.example", okStatus), "x.yaml:1: version: missing", "version: 1"},
		{"unknown top key", head + provider("a", "https://a.example", okStatus) + "extra: 1\n", `x.yaml:9: extra: unknown key`, "allowed keys"},
		{"unknown provider key with suggestion", head + provider("a", "https://a.example", okStatus, "    polcy: {deadline: 1m}\n"), `x.yaml:9: provider "a": polcy: unknown key`, "did you mean policy?"},
		{"duplicate name", head + provider("a", "https://a.example", okStatus) + provider("a", "https://b.example", okStatus), `x.yaml:9: provider "a": name: duplicate provider name`, "line 3"},
		{"invalid base_url", head + provider("a", "https:// bad", okStatus), `x.yaml:4: provider "a": base_url:`, "scheme://host"},
		{"base_url without scheme", head + provider("a", "api.example.com", okStatus), `x.yaml:4: provider "a": base_url: "api.example.com" has no http or https scheme`, "https://"},
		{"base_url with query", head + provider("a", "https://a.example/?x=1", okStatus), `x.yaml:4: provider "a": base_url:`, "move credentials"},
		{"overlap", head + provider("a", "https://same.example", okStatus) + provider("b", "https://same.example:443/", "      request: GET /v1/jobs/{id}\n      state: s\n      states: {waiting: [w], success: [s]}\n"),
			`x.yaml:9: provider "b": status.request: "GET /v1/jobs/{id}" on https://same.example:443 overlaps provider "a" (line 3) status.request "GET /v1/jobs/{job_id}"`, "distinct base_url"},
		{"state in two categories", head + provider("a", "https://a.example", "      request: GET /v1/jobs/{job_id}\n      state: state\n      states:\n        waiting: [running]\n        success: [done, running]\n"),
			`x.yaml:10: provider "a": status.states: "running" is both waiting and success`, "a state belongs to one category"},
		{"empty waiting", head + provider("a", "https://a.example", "      request: GET /v1/jobs/{job_id}\n      state: state\n      states: {success: [done]}\n"),
			`x.yaml:8: provider "a": status.states.waiting: no waiting state`, "[queued, running]"},
		{"empty success", head + provider("a", "https://a.example", "      request: GET /v1/jobs/{job_id}\n      state: state\n      states: {waiting: [w], success: []}\n"),
			`x.yaml:8: provider "a": status.states.success: no success state`, "[succeeded]"},
		{"invalid duration", head + provider("a", "https://a.example", okStatus, "    policy: {deadline: soon}\n"), `x.yaml:9: provider "a": policy.deadline: "soon" is not a duration`, "500ms"},
		{"duration without unit", head + provider("a", "https://a.example", okStatus, "    policy: {lease: 30}\n"), `x.yaml:9: provider "a": policy.lease: "30" has no unit`, "30s"},
		{"non-positive duration", head + provider("a", "https://a.example", okStatus, "    policy:\n      not_found_grace: 0s\n"), `x.yaml:10: provider "a": policy.not_found_grace: "0s" is not positive`, "greater than zero"},
		{"sub-millisecond duration", head + provider("a", "https://a.example", okStatus, "    policy: {deadline: 1500us}\n"), `policy.deadline: "1500us" is finer than a millisecond`, "whole milliseconds"},
		{"base > max", head + provider("a", "https://a.example", okStatus, "    policy:\n      backoff: {base: 10s, max: 5s}\n"), `x.yaml:10: provider "a": policy.backoff: base 10s is greater than max 5s`, "raise max"},
		{"jitter floor 0", head + provider("a", "https://a.example", okStatus, "    policy:\n      backoff: {jitter_floor: 0}\n"), `x.yaml:10: provider "a": policy.backoff.jitter_floor: 0 is outside (0,1]`, "fraction"},
		{"jitter floor above 1", head + provider("a", "https://a.example", okStatus, "    policy:\n      backoff: {jitter_floor: 1.5}\n"), `policy.backoff.jitter_floor: 1.5 is outside (0,1]`, "fraction"},
		{"unknown placeholder", head + provider("a", "https://a.example", okStatus, "    cancel:\n      request: POST /v1/jobs/{jobid}/cancel\n"), `x.yaml:10: provider "a": cancel.request: unknown placeholder {jobid}`, "known placeholders: job_id"},
		{"result field not required", head + provider("a", "https://a.example", okStatus, "    result:\n      request: GET {url}\n"), `x.yaml:10: provider "a": result.request: field {url} is not in status.success_requires`, "success_requires"},
		{"malformed gjson path", head + provider("a", "https://a.example", "      request: GET /v1/jobs/{job_id}\n      state: data..state\n      states: {waiting: [w], success: [s]}\n"),
			`x.yaml:7: provider "a": status.state: "data..state" is not a valid gjson path`, "dotted keys"},
		{"malformed gjson query", head + provider("a", "https://a.example", okStatus, "      error: items.#(code==\"x\"\n"), `x.yaml:9: provider "a": status.error:`, "dotted keys"},
		{"budget below 1", head + provider("a", "https://a.example", okStatus, "    policy: {max_transport_failures: 0}\n"), `x.yaml:9: provider "a": policy.max_transport_failures: 0 is below 1`, "at least 1"},
		{"unsafe status method", head + provider("a", "https://a.example", "      request: POST /v1/jobs/{job_id}\n      state: s\n      states: {waiting: [w], success: [s]}\n"), `status.request: method POST is not safe`, "R12"},
		{"no job id placeholder", head + provider("a", "https://a.example", "      request: GET /v1/jobs/{a}/{b}\n      state: s\n      states: {waiting: [w], success: [s]}\n"), `status.request: has several placeholders and none is {job_id}`, "{job_id}"},
		{"bad template", head + provider("a", "https://a.example", "      request: /v1/jobs/{job_id}\n      state: s\n      states: {waiting: [w], success: [s]}\n"), `x.yaml:6: provider "a": status.request:`, "METHOD"},
		{"submit guesses", head + provider("a", "https://a.example", okStatus, "    submit:\n      request: POST /v1/jobs\n"), `x.yaml:10: provider "a": submit: names neither job_id nor status_location`, "never guess"},
		{"early poll mode", head + provider("a", "https://a.example", okStatus, "    policy: {early_poll: queue}\n"), `policy.early_poll: unknown mode "queue"`, "reject"},
		{"escalation status", head + provider("a", "https://a.example", okStatus, "    escalation: {status_code: 99}\n"), `x.yaml:9: provider "a": escalation.status_code: 99 is not an HTTP status`, "200"},
		{"webhook", head + provider("a", "https://a.example", okStatus, "    notify: {webhook: not-a-url}\n"), `x.yaml:9: provider "a": notify.webhook: "not-a-url" is not an absolute http(s) URL`, "https://"},
		{"state_default outside table", head + provider("a", "https://a.example", okStatus+"      state_default: maybe\n"), `status.state_default: "maybe" is not in the state table`, "waiting"},
		{"business deadline longer", head + provider("a", "https://a.example", okStatus, "    policy: {deadline: 10m, business_deadline: 20m}\n"), `policy.business_deadline: 20m0s is longer than the deadline 10m0s`, "R19"},
		{"overlap literal and placeholder", head + provider("a", "https://same.example", okStatus) + provider("b", "https://same.example/v1", "      request: GET /{kind}/latest\n      state: s\n      states: {waiting: [w], success: [s]}\n"),
			`x.yaml:9: provider "b": status.request: "GET /{kind}/latest" on https://same.example/v1 overlaps provider "a"`, "distinct base_url"},
		{"overlap inside one provider", head + provider("a", "https://a.example", okStatus, "    result:\n      request: GET /v1/jobs/{job_id}\n"),
			`x.yaml:3: provider "a": result.request: "GET /v1/jobs/{job_id}" overlaps status.request`, "distinct method or path"},
		{"duplicate key", head + provider("a", "https://a.example", okStatus, "    base_url: https://b.example\n"), `x.yaml:9: provider "a": base_url: duplicate key`, "keep one"},
		{"budget not a number", head + provider("a", "https://a.example", okStatus, "    policy: {max_status_requests: many}\n"), `policy.max_status_requests: "many" is not a whole number`, "12"},
		{"status_location not a boolean", head + provider("a", "https://a.example", okStatus, "    submit: {request: POST /v1/jobs, status_location: yes}\n"), `submit.status_location: "yes" is not a boolean`, "true or false"},
		{"states not a list", head + provider("a", "https://a.example", "      request: GET /v1/jobs/{job_id}\n      state: s\n      states: {waiting: {a: b}, success: [s]}\n"), `status.states.waiting: must be a list`, "[a, b]"},
		{"merge key", "version: 1\nx: &p {deadline: 1m}\nproviders:\n" + provider("a", "https://a.example", okStatus, "    policy:\n      <<: *p\n"), `x.yaml:11: provider "a": policy.<<: YAML merge keys are not supported`, "defaults.policy"},
		{"not yaml", "version: 1\nproviders: [\n", "x.yaml:", "indentation"},
		{"empty", "", "x.yaml:1: the contract is empty", "version: 1"},
		{"no providers", "version: 1\nproviders: []\n", "x.yaml:2: providers: the list is empty", "at least one"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse("x.yaml", []byte(tc.yaml))
			var ve *ValidationError
			if !errors.As(err, &ve) {
				t.Fatalf("want a ValidationError, got %v", err)
			}
			for _, p := range ve.Problems {
				line := p.String()
				if strings.Contains(line, tc.want) {
					if p.Hint == "" || !strings.Contains(p.Hint, tc.hint) {
						t.Fatalf("problem %q: hint %q lacks %q", line, p.Hint, tc.hint)
					}
					if !strings.Contains(line, "(hint: ") {
						t.Fatalf("problem line has no hint: %q", line)
					}
					return
				}
			}
			t.Fatalf("no problem contains %q; got:\n%s", tc.want, err)
		})
	}
}

func TestValidationReportsEverythingAtOnce(t *testing.T) {
	_, err := Parse("providers.yaml", []byte(`version: 3
defaults:
  policy:
    backoff: {base: 2m, max: 1m, jitter_floor: 2}
providers:
  - name: Bad Name
    base_url: nope
    status:
      request: GET /v1/jobs/{job_id}
      state: "a..b"
      states:
        waiting: [running]
        success: [running]
    policy: {max_rate_limited: 0, deadline: 0s}
    cancel: {request: "POST /v1/jobs/{other}/cancel"}
    surprise: true
`))
	var ve *ValidationError
	if !errors.As(err, &ve) {
		t.Fatalf("want ValidationError, got %v", err)
	}
	wantLines := []string{
		"providers.yaml:1: version: unsupported schema version 3",
		"providers.yaml:4: defaults.policy.backoff.jitter_floor:",
		"providers.yaml:4: defaults.policy.backoff: base 2m0s is greater than max 1m0s",
		`providers.yaml:6: provider "Bad Name": name: must be lower-case`,
		`providers.yaml:7: provider "Bad Name": base_url: "nope" has no http or https scheme`,
		`providers.yaml:10: provider "Bad Name": status.state: "a..b" is not a valid gjson path`,
		`providers.yaml:13: provider "Bad Name": status.states: "running" is both waiting and success`,
		`providers.yaml:14: provider "Bad Name": policy.deadline: "0s" is not positive`,
		`providers.yaml:14: provider "Bad Name": policy.max_rate_limited: 0 is below 1`,
		`providers.yaml:15: provider "Bad Name": cancel.request: unknown placeholder {other}`,
		`providers.yaml:16: provider "Bad Name": surprise: unknown key`,
	}
	msg := err.Error()
	for _, w := range wantLines {
		if !strings.Contains(msg, w) {
			t.Errorf("missing %q", w)
		}
	}
	if len(ve.Problems) < len(wantLines) {
		t.Errorf("got %d problems, want at least %d:\n%s", len(ve.Problems), len(wantLines), msg)
	}
	// One line per problem, ordered by line number.
	lines := strings.Split(msg, "\n")
	if len(lines) != len(ve.Problems) {
		t.Fatalf("Error() has %d lines for %d problems", len(lines), len(ve.Problems))
	}
	for i := 1; i < len(ve.Problems); i++ {
		if ve.Problems[i].Line < ve.Problems[i-1].Line {
			t.Fatalf("problems not ordered by line:\n%s", msg)
		}
	}
	if t.Failed() {
		t.Log(msg)
	}
}

func TestMatch(t *testing.T) {
	c := mustLoad(t, "../providers.yaml")
	ex := mustLoad(t, "testdata/example.yaml")
	tests := []struct {
		c        *Contract
		method   string
		url      string
		provider string
		kind     Kind
		jobID    string
		params   map[string]string
	}{
		{c, "GET", "https://api.openai.com/v1/batches/batch_abc123", "openai-batch", KindStatus, "batch_abc123", map[string]string{"batch_id": "batch_abc123"}},
		{c, "GET", "https://API.OpenAI.com:443/v1/batches/batch_abc123?x=1", "openai-batch", KindStatus, "batch_abc123", nil},
		{c, "POST", "https://api.openai.com/v1/batches", "openai-batch", KindSubmit, "", nil},
		{c, "POST", "https://api.openai.com/v1/batches/batch_abc123/cancel", "openai-batch", KindCancel, "batch_abc123", nil},
		{c, "GET", "https://api.openai.com/v1/files/file-xyz/content", "openai-batch", KindResult, "", map[string]string{"output_file_id": "file-xyz"}},
		{c, "GET", "https://api.anthropic.com/v1/messages/batches/msgbatch_013Zva2CMHLNnXjNJJKqJ2EF", "anthropic-message-batches", KindStatus, "msgbatch_013Zva2CMHLNnXjNJJKqJ2EF", nil},
		{c, "GET", "https://api.replicate.com/v1/predictions/gm3qorzdhgbfurvjtvhg6dckhu", "replicate", KindStatus, "gm3qorzdhgbfurvjtvhg6dckhu", nil},
		{c, "GET", "https://api.assemblyai.com/v2/transcript/5551722-f677-48a4-a0ab-a2e3a5a4f5d5", "assemblyai", KindStatus, "5551722-f677-48a4-a0ab-a2e3a5a4f5d5", nil},
		{c, "GET", "https://example-docintel.cognitiveservices.azure.com/documentintelligence/documentModels/prebuilt-layout/analyzeResults/3b9a9d3c-1d5e?api-version=2024-11-30", "azure-document-intelligence", KindStatus, "3b9a9d3c-1d5e", map[string]string{"model_id": "prebuilt-layout", "job_id": "3b9a9d3c-1d5e"}},
		{c, "POST", "https://example-docintel.cognitiveservices.azure.com/documentintelligence/documentModels/prebuilt-read:analyze?api-version=2024-11-30", "azure-document-intelligence", KindSubmit, "", map[string]string{"model_id": "prebuilt-read"}},
		{c, "GET", "https://speech.googleapis.com/v1/operations/7612202767953098924", "google-speech-lro", KindStatus, "7612202767953098924", nil},
		{c, "POST", "https://speech.googleapis.com/v1/speech:longrunningrecognize", "google-speech-lro", KindSubmit, "", nil},
		// Escaped placeholder values are unescaped.
		{ex, "GET", "https://api.example.com/v1/jobs/a%2Fb", "example-exports", KindStatus, "a/b", nil},
		// Spelling variants of a governed call are still governed.
		{c, "GET", "https://api.openai.com/v1/batches/batch_abc123/", "openai-batch", KindStatus, "batch_abc123", nil},
		{c, "GET", "https://api.openai.com/v1//batches/./batch_abc123", "openai-batch", KindStatus, "batch_abc123", nil},
		{c, "GET", "https://api.openai.com/v1/files/../batches/batch_abc123", "openai-batch", KindStatus, "batch_abc123", nil},
		// Base path prefix and explicit port.
		{ex, "GET", "http://127.0.0.1:8080/prefix/ops/42", "bare", KindStatus, "42", nil},
		// Not matched: wrong method, other host, port, prefix, extra segment, empty segment, field templates.
		{c, "DELETE", "https://api.openai.com/v1/batches/b", "", "", "", nil},
		{c, "GET", "https://api.openai.com.evil.example/v1/batches/b", "", "", "", nil},
		{c, "GET", "https://api.openai.com:8443/v1/batches/b", "", "", "", nil},
		{c, "GET", "http://api.openai.com/v1/batches/b", "", "", "", nil},
		{c, "GET", "https://api.openai.com/v1/batches/b/extra", "", "", "", nil},
		{c, "GET", "https://api.openai.com/v1/batches/", "", "", "", nil},
		{ex, "GET", "http://127.0.0.1:8080/ops/42", "", "", "", nil},
		{ex, "GET", "http://127.0.0.1:8080/prefixed/ops/42", "", "", "", nil},
		{c, "GET", "https://api.anthropic.com/v1/messages/batches/msgbatch_1/results", "", "", "", nil},
	}
	for _, tc := range tests {
		u, err := url.Parse(tc.url)
		if err != nil {
			t.Fatal(err)
		}
		m, ok := tc.c.Match(tc.method, u)
		if tc.provider == "" {
			if ok {
				t.Errorf("%s %s matched %s/%s, want no match", tc.method, tc.url, m.Provider.Name, m.Kind)
			}
			continue
		}
		if !ok {
			t.Errorf("%s %s: no match, want %s/%s", tc.method, tc.url, tc.provider, tc.kind)
			continue
		}
		if m.Provider.Name != tc.provider || m.Kind != tc.kind || m.JobID != tc.jobID {
			t.Errorf("%s %s: got %s/%s job %q, want %s/%s job %q", tc.method, tc.url, m.Provider.Name, m.Kind, m.JobID, tc.provider, tc.kind, tc.jobID)
		}
		if tc.params != nil && !reflect.DeepEqual(m.Params, tc.params) {
			t.Errorf("%s %s: params %v, want %v", tc.method, tc.url, m.Params, tc.params)
		}
	}
}

func TestHosts(t *testing.T) {
	c := mustLoad(t, "testdata/example.yaml")
	if got := c.Hosts(); !reflect.DeepEqual(got, []string{"127.0.0.1", "api.example.com"}) {
		t.Fatalf("Hosts() = %v", got)
	}
}

func TestTemplateExpand(t *testing.T) {
	c := mustLoad(t, "../providers.yaml")
	az := c.ProviderByName("azure-document-intelligence")
	got, err := az.Status.Request.Expand(map[string]string{"model_id": "prebuilt-read", "job_id": "r 1/2"}, az.BaseURL)
	if err != nil {
		t.Fatal(err)
	}
	want := "https://example-docintel.cognitiveservices.azure.com/documentintelligence/documentModels/prebuilt-read/analyzeResults/r%201%2F2"
	if got != want {
		t.Fatalf("Expand = %q, want %q", got, want)
	}
	// Round trip: the expanded URL matches back to the same parameters.
	u, _ := url.Parse(got)
	if m, ok := c.Match("GET", u); !ok || m.JobID != "r 1/2" {
		t.Fatalf("expanded URL does not match back: %+v %v", m, ok)
	}
	if _, err := az.Status.Request.Expand(map[string]string{"job_id": "x"}, az.BaseURL); err == nil {
		t.Fatal("missing placeholder value must be an error")
	}
	an := c.ProviderByName("anthropic-message-batches")
	if got, err := an.Result.Request.Expand(map[string]string{"results_url": "https://api.anthropic.com/v1/messages/batches/b/results"}, an.BaseURL); err != nil || got != "https://api.anthropic.com/v1/messages/batches/b/results" {
		t.Fatalf("field template: %q %v", got, err)
	}
	if _, err := an.Result.Request.Expand(map[string]string{"results_url": "/relative"}, an.BaseURL); err == nil {
		t.Fatal("field template with a relative URL must be an error")
	}
	tmpl, err := parseTemplate("POST /v1/{job_id}:cancel?api-version=1")
	if err != nil {
		t.Fatal(err)
	}
	base, _ := url.Parse("https://h.example/base")
	if got, _ := tmpl.Expand(map[string]string{"job_id": "j"}, base); got != "https://h.example/base/v1/j:cancel?api-version=1" {
		t.Fatalf("prefix/suffix segment: %q", got)
	}
}

func TestValidGJSONPath(t *testing.T) {
	for _, ok := range []string{"state", "data.state", "items.0.state", `a\.b`, "items.#", `items.#(code=="x").msg`, "@this", "a|b", "status"} {
		if err := validGJSONPath(ok); err != nil {
			t.Errorf("%q rejected: %v", ok, err)
		}
	}
	for _, bad := range []string{"", " a", "a.", ".a", "a..b", `a\`, "a.(b", "a)", "a\nb", `a"b`} {
		if err := validGJSONPath(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestSegmentsOverlap(t *testing.T) {
	seg := func(p string) []segment {
		s, err := splitSegments(p)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	tests := []struct {
		a, b string
		want bool
	}{
		{"/v1/{id}:cancel", "/v1/{id}:start", false},
		{"/v1/{id}:cancel", "/v1/{x}", true},
		{"/v1/{id}", "/v1/latest", true},
		{"/v1/op-{id}", "/v1/latest", false},
		{"/v1/op-{id}", "/v1/op-7", true},
		{"/v1/jobs/{id}", "/v1/files/{id}", false},
		{"/v1/jobs/{id}", "/v1/jobs/{id}/cancel", false},
		{"/a", "/a", true},
	}
	for _, tc := range tests {
		if got := segmentsOverlap(seg(tc.a), seg(tc.b)); got != tc.want {
			t.Errorf("overlap(%s, %s) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
		if got := segmentsOverlap(seg(tc.b), seg(tc.a)); got != tc.want {
			t.Errorf("overlap(%s, %s) = %v, want %v (symmetry)", tc.b, tc.a, got, tc.want)
		}
	}
}

func TestStatusSpecBooleanStates(t *testing.T) {
	c := mustLoad(t, "../providers.yaml")
	for _, p := range c.Providers {
		if got, want := p.Status.BooleanStates(), p.Name == "google-speech-lro"; got != want {
			t.Errorf("%s: BooleanStates() = %v, want %v", p.Name, got, want)
		}
	}
}
