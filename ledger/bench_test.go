package ledger_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"pollgate/ledger"
)

// benchReservePlusComplete measures governed status calls: one Reserve and
// one Complete each, from parallelism goroutines per CPU (concurrent agents'
// status calls, which group commit turns into shared transactions) over
// 1,024 operations, and reports pairs/s.
func benchReservePlusComplete(b *testing.B, s ledger.Store, parallelism int) {
	ctx := context.Background()
	const nOps = 1024
	keys := make([]ledger.Key, nOps)
	for i := range keys {
		op := newOp(fmt.Sprintf("op_b%04d", i), fmt.Sprintf("job_b%04d", i))
		op.Budget.StatusRequests = 1 << 30
		op.DeadlineAt = t0.Add(24 * time.Hour)
		got, _, err := s.Create(ctx, op, entry("created", t0))
		if err != nil {
			b.Fatal(err)
		}
		keys[i] = ledger.KeyOf(got)
	}
	type statser interface{ CommitStats() (commits, steps int64) }
	var c0, n0 int64
	if st, ok := s.(statser); ok {
		c0, n0 = st.CommitStats()
	}
	var next, busy atomic.Int64
	now := t0.Add(time.Second)
	b.SetParallelism(parallelism)
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			k := keys[next.Add(1)%nOps]
			r, err := s.Reserve(ctx, k, "bench", time.Minute, now)
			if err != nil {
				b.Error(err)
				return
			}
			if r.Outcome != ledger.Reserved {
				busy.Add(1)
				continue
			}
			if _, err := s.Complete(ctx, r, r.Op, entry("polled", now)); err != nil {
				b.Error(err)
				return
			}
		}
	})
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(int64(b.N)-busy.Load())/elapsed.Seconds(), "pairs/s")
	b.ReportMetric(0, "ns/op")
	if st, ok := s.(statser); ok {
		if c, n := st.CommitStats(); c > c0 {
			b.ReportMetric(float64(n-n0)/float64(c-c0), "steps/commit")
		}
	}
}

// BenchmarkReservePlusComplete/bbolt runs with fsync on: the throughput comes
// from group commit.
func BenchmarkReservePlusComplete(b *testing.B) {
	for _, p := range []int{1, 32} {
		b.Run(fmt.Sprintf("bbolt/p%d", p), func(b *testing.B) {
			s, err := ledger.OpenBolt(b.TempDir(), ledger.BoltOptions{})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			benchReservePlusComplete(b, s, p)
		})
	}
	b.Run("redis/p32", func(b *testing.B) {
		benchReservePlusComplete(b, benchRedisStore(b), 32)
	})
}
