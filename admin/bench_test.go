package admin_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"pollgate/admin"
	"pollgate/admin/admintest"
	"pollgate/audit"
	"pollgate/rules"
)

// BenchmarkReport measures GET /api/report over a ledger of 5,000
// operations (bbolt, loopback HTTP).
//
//	go test -run '^$' -bench Report -benchtime 20x ./admin
func BenchmarkReport(b *testing.B) {
	c := admintest.Contract(b)
	store := admintest.Store(b, nil)
	p := c.ProviderByName("acme")
	rnd := rand.New(rand.NewPCG(1, 2))
	ctx := context.Background()
	for i := range 5000 {
		op := rules.NewOperation(p, c, fmt.Sprintf("op_%05d", i), fmt.Sprintf("job_%05d", i), "acct", rules.OriginSubmission, admintest.Start, rnd)
		if i%3 == 0 {
			op = rules.EscalateNow(p, op, rules.ReasonDeadlineExceeded, "bench", admintest.Start.Add(time.Duration(i)*time.Second)).Op
		}
		if _, _, err := store.Create(ctx, op, audit.Entry{Event: "created", Story: "bench"}); err != nil {
			b.Fatal(err)
		}
	}
	h := admin.New(admin.Config{Store: store, Contract: func() *rules.Contract { return c }, Token: "t",
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	srv := httptest.NewServer(h)
	defer srv.Close()
	b.ResetTimer()
	for range b.N {
		req, _ := http.NewRequest("GET", srv.URL+"/api/report", nil)
		req.Header.Set("Authorization", "Bearer t")
		resp, err := http.DefaultClient.Do(req)
		if err != nil || resp.StatusCode != 200 {
			b.Fatal(err, resp.Status)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}
