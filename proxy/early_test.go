package proxy

import (
	"sync"
	"testing"
	"time"

	"pollgate/ledger"
)

// A tight-looping agent's early polls are summed per job and written in a
// few steps, and every one of them is counted by the time the gate stops.
func TestEarlyGateCoalescesPerJob(t *testing.T) {
	var mu sync.Mutex
	writes := map[ledger.Key][]int{}
	g := newEarlyGate(4, func(earlyPoll) { t.Error("per-poll counter used although the store can add several") },
		func(ep earlyPoll) {
			mu.Lock()
			writes[ep.key] = append(writes[ep.key], ep.n)
			mu.Unlock()
		})
	a := ledger.Key{Provider: "p", Account: "acct", JobID: "a"}
	b := ledger.Key{Provider: "p", Account: "acct", JobID: "b"}
	now := time.Unix(1_800_000_000, 0)
	for i := 0; i < 1000; i++ {
		g.record(earlyPoll{key: a, at: now})
		if i%10 == 0 {
			g.record(earlyPoll{key: b, at: now})
		}
	}
	g.drain()
	g.record(earlyPoll{key: a, at: now}) // after a flush: counted again at stop
	g.stop()
	g.record(earlyPoll{key: b, at: now}) // after stop: written on the request path

	mu.Lock()
	defer mu.Unlock()
	sum := func(ns []int) (s int) {
		for _, n := range ns {
			s += n
		}
		return s
	}
	if sum(writes[a]) != 1001 || sum(writes[b]) != 101 {
		t.Fatalf("counted %d early polls of a and %d of b, want 1001 and 101 (writes %v / %v)", sum(writes[a]), sum(writes[b]), writes[a], writes[b])
	}
	// 1000 polls inside one interval become one write, not 1000.
	if len(writes[a]) > 4 {
		t.Fatalf("job a was written %d times for 1001 early polls: %v", len(writes[a]), writes[a])
	}
}
