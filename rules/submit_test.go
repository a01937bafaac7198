package rules

import (
	"net/url"
	"strings"
	"testing"
)

// R14: take the status resource the provider names; never guess.
func TestParseSubmission(t *testing.T) {
	c := mustLoad(t, "../providers.yaml")
	ex := mustLoad(t, "testdata/example.yaml")
	u := func(s string) *url.URL {
		x, err := url.Parse(s)
		if err != nil {
			t.Fatal(err)
		}
		return x
	}
	tests := []struct {
		name      string
		p         *Provider
		resp      Response
		reqURL    string
		jobID     string
		statusURL string
		err       string
	}{
		{"openai body id", c.ProviderByName("openai-batch"), resp(200, `{"id":"batch_abc123","object":"batch","status":"validating"}`),
			"https://api.openai.com/v1/batches", "batch_abc123", "https://api.openai.com/v1/batches/batch_abc123", ""},
		{"google operation name", c.ProviderByName("google-speech-lro"), resp(200, `{"name":"7612202767953098924"}`),
			"https://speech.googleapis.com/v1/speech:longrunningrecognize", "7612202767953098924", "https://speech.googleapis.com/v1/operations/7612202767953098924", ""},
		{"azure Operation-Location", c.ProviderByName("azure-document-intelligence"),
			resp(202, ``, "Operation-Location", "https://example-docintel.cognitiveservices.azure.com/documentintelligence/documentModels/prebuilt-layout/analyzeResults/3b9a9d3c-1d5e?api-version=2024-11-30"),
			"https://example-docintel.cognitiveservices.azure.com/documentintelligence/documentModels/prebuilt-layout:analyze?api-version=2024-11-30",
			"3b9a9d3c-1d5e", "https://example-docintel.cognitiveservices.azure.com/documentintelligence/documentModels/prebuilt-layout/analyzeResults/3b9a9d3c-1d5e?api-version=2024-11-30", ""},
		{"relative Location resolved", ex.ProviderByName("example-exports"), resp(202, `{}`, "Location", "/v1/jobs/exp_71c"),
			"https://api.example.com/v1/exports", "exp_71c", "https://api.example.com/v1/jobs/exp_71c", ""},
		{"body id wins, location kept", ex.ProviderByName("example-exports"), resp(202, `{"job_id":"exp_9"}`, "Location", "https://api.example.com/v1/jobs/exp_9"),
			"https://api.example.com/v1/exports", "exp_9", "https://api.example.com/v1/jobs/exp_9", ""},
		{"numeric job id", ex.ProviderByName("example-exports"), resp(201, `{"job_id":12345}`),
			"https://api.example.com/v1/exports", "12345", "https://api.example.com/v1/jobs/12345", ""},
		{"neither", c.ProviderByName("openai-batch"), resp(200, `{"object":"batch"}`), "https://api.openai.com/v1/batches", "", "", "names no job id"},
		{"location ignored without status_location", c.ProviderByName("openai-batch"), resp(201, `{}`, "Location", "https://api.openai.com/v1/batches/b1"),
			"https://api.openai.com/v1/batches", "", "", "never guessed"},
		{"location that is not a status URL", c.ProviderByName("azure-document-intelligence"), resp(202, ``, "Operation-Location", "https://example-docintel.cognitiveservices.azure.com/elsewhere/1"),
			"https://example-docintel.cognitiveservices.azure.com/documentintelligence/documentModels/m:analyze", "", "", "does not match status.request"},
		{"submit failed", c.ProviderByName("openai-batch"), resp(400, `{"error":{"message":"bad"}}`), "https://api.openai.com/v1/batches", "", "", "HTTP 400"},
		{"body not JSON", c.ProviderByName("openai-batch"), resp(200, `not json`), "https://api.openai.com/v1/batches", "", "", "names no job id"},
		{"no submit in contract", ex.ProviderByName("bare"), resp(200, `{"id":"x"}`), "http://127.0.0.1:8080/prefix/x", "", "", "no submit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := ParseSubmission(tc.p, tc.resp, u(tc.reqURL))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if s.JobID != tc.jobID || s.StatusURL != tc.statusURL {
				t.Fatalf("got %+v, want job %q url %q", s, tc.jobID, tc.statusURL)
			}
		})
	}
}

// R4: credentials are only kept as keyed fingerprints.
func TestAccountFingerprint(t *testing.T) {
	key := []byte("0123456789abcdef0123456789abcdef")
	a := AccountFingerprint(key, "Bearer sk-live-1")
	if len(a) != len("acct_")+16 || !strings.HasPrefix(a, "acct_") || strings.Contains(a, "sk-live") {
		t.Fatalf("fingerprint %q", a)
	}
	if a != AccountFingerprint(key, "Bearer sk-live-1") {
		t.Fatal("not deterministic")
	}
	if a == AccountFingerprint(key, "Bearer sk-live-2") || a == AccountFingerprint([]byte("other key"), "Bearer sk-live-1") {
		t.Fatal("different credential or key must differ")
	}
	if AccountFingerprint(key, "") != "anonymous" {
		t.Fatal(`empty credential must be "anonymous"`)
	}
}

func TestRequestFingerprint(t *testing.T) {
	u := func(s string) *url.URL { x, _ := url.Parse(s); return x }
	a := RequestFingerprint("POST", u("https://api.example.com/v1/exports?b=2&a=1"), []byte(`{"x": 1, "y": [1, 2], "z": {"k": "v", "a": 1.50}}`))
	same := []string{
		RequestFingerprint("post", u("https://API.example.com:443/v1/exports?a=1&b=2"), []byte(`{"z":{"a":1.50,"k":"v"},"y":[1,2],"x":1}`)),
		RequestFingerprint("POST", u("https://api.example.com/v1/exports?a=1&b=2#frag"), []byte("\n{\"x\":1,\"y\":[1,2],\"z\":{\"k\":\"v\",\"a\":1.50}}\n")),
	}
	for i, s := range same {
		if s != a {
			t.Errorf("variant %d: fingerprint differs", i)
		}
	}
	differ := []string{
		RequestFingerprint("PUT", u("https://api.example.com/v1/exports?a=1&b=2"), []byte(`{"x":1,"y":[1,2],"z":{"k":"v","a":1.50}}`)),
		RequestFingerprint("POST", u("https://api.example.com/v1/exports?a=1&b=3"), []byte(`{"x":1,"y":[1,2],"z":{"k":"v","a":1.50}}`)),
		RequestFingerprint("POST", u("https://api.example.com/v1/exports?a=1&b=2"), []byte(`{"x":1,"y":[2,1],"z":{"k":"v","a":1.50}}`)),
		RequestFingerprint("POST", u("https://api.example.com/v1/exports?a=1&b=2"), []byte(`{"x":1,"y":[1,2],"z":{"k":"v","a":1.5}}`)),
		RequestFingerprint("POST", u("https://api.example.com:8443/v1/exports?a=1&b=2"), []byte(`{"x":1,"y":[1,2],"z":{"k":"v","a":1.50}}`)),
	}
	for i, d := range differ {
		if d == a {
			t.Errorf("difference %d not seen", i)
		}
	}
	if len(a) != 64 {
		t.Fatalf("fingerprint %q is not hex SHA-256", a)
	}
	// Non-JSON bodies are hashed as sent.
	if RequestFingerprint("POST", u("https://h/x"), []byte("a=1")) == RequestFingerprint("POST", u("https://h/x"), []byte("a=2")) {
		t.Fatal("form bodies must differ")
	}
}
