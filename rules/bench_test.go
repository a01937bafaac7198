package rules

import (
	"net/url"
	"testing"
	"time"
)

// The proxy calls Match on every intercepted request and OnResponse on
// every governed answer; both must stay far below a network round trip.
func BenchmarkMatch(b *testing.B) {
	c := mustLoad(b, "../providers.yaml")
	u, _ := url.Parse("https://speech.googleapis.com/v1/operations/7612202767953098924")
	miss, _ := url.Parse("https://api.openai.com/v1/chat/completions")
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := c.Match("GET", u); !ok {
			b.Fatal("no match")
		}
		if _, ok := c.Match("POST", miss); ok {
			b.Fatal("match")
		}
	}
}

func BenchmarkOnResponse(b *testing.B) {
	c := mustLoad(b, "../providers.yaml")
	p := c.ProviderByName("openai-batch")
	op := NewOperation(p, c, "op", "batch_abc123", "acct", OriginFirstStatusCal, t0, nil)
	op.Used.StatusRequests = 1
	body := []byte(`{"id":"batch_abc123","object":"batch","status":"in_progress","output_file_id":null,"expires_at":1911557933,"request_counts":{"total":100,"completed":40,"failed":0}}`)
	r := resp(200, string(body), "x-request-id", "req_1")
	b.ReportAllocs()
	for b.Loop() {
		if d := OnResponse(p, op, r, t0.Add(time.Minute), fixedRand(0.5)); d.Action != ActWait {
			b.Fatal(d.Action)
		}
	}
}
