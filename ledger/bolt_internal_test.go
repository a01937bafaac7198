package ledger

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"pollgate/audit"
	"pollgate/rules"
)

var ti0 = time.Date(2026, 1, 2, 10, 0, 0, 0, time.UTC)

func internalOp(id, job string) *rules.Operation {
	return &rules.Operation{ID: id, Provider: "acme", JobID: job, Account: "a", Phase: rules.PhaseWaiting,
		StartedAt: ti0, DeadlineAt: ti0.Add(time.Hour), UpdatedAt: ti0, Budget: rules.Budget{StatusRequests: 10}}
}

// Fault injection: a transaction that fails after some steps of a batch
// wrote fails every step of the batch with ErrUnavailable, and none of
// their writes survive. The writer keeps serving later steps.
func TestBoltBatchFailureWritesNothing(t *testing.T) {
	s, err := OpenBolt(t.TempDir(), BoltOptions{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	op, _, err := s.Create(ctx, internalOp("op_1", "job_1"), audit.Entry{Event: "created", Time: ti0})
	if err != nil {
		t.Fatal(err)
	}
	k := KeyOf(op)

	// Hold the writer so the next steps queue up into one batch.
	hold, held := make(chan struct{}), make(chan struct{})
	go s.run(ctx, "hold", func(tx *bolt.Tx) error { close(held); <-hold; return nil })
	<-held

	var wg sync.WaitGroup
	errs := make([]error, 5)
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = s.Reserve(ctx, k, "w", time.Minute, ti0.Add(time.Duration(i+1)*time.Second))
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		errs[4] = s.run(ctx, "fail", func(tx *bolt.Tx) error {
			// Writes first, then the disk "fails".
			if err := tx.Bucket(bucketOps).Put([]byte("junk"), []byte("{}")); err != nil {
				return wf(err)
			}
			return wf(errors.New("injected: no space left on device"))
		})
	}()
	// Wait until all five are queued behind the held step.
	for len(s.queue) < 5 {
		time.Sleep(time.Millisecond)
	}
	close(hold)
	wg.Wait()
	for i, err := range errs {
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("step %d of the failed batch: %v, want ErrUnavailable", i, err)
		}
	}
	got, err := s.Get(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if got.Used.StatusRequests != 0 || got.Used.EarlyPolls != 0 || got.Lease.Fence != 0 {
		t.Fatalf("a failed batch left writes behind: %+v %+v", got.Used, got.Lease)
	}
	s.db.View(func(tx *bolt.Tx) error {
		if tx.Bucket(bucketOps).Get([]byte("junk")) != nil {
			t.Fatal("the failing step's write survived")
		}
		return nil
	})
	// The writer still works.
	if r, err := s.Reserve(ctx, k, "w", time.Minute, ti0.Add(time.Second)); err != nil || r.Outcome != Reserved {
		t.Fatalf("after a failed batch: %v %v", r.Outcome, err)
	}
}

// Fault injection: the file is closed underneath the store.
func TestBoltClosedFileIsUnavailable(t *testing.T) {
	s, err := OpenBolt(t.TempDir(), BoltOptions{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	op, _, err := s.Create(ctx, internalOp("op_1", "job_1"), audit.Entry{Event: "created", Time: ti0})
	if err != nil {
		t.Fatal(err)
	}
	s.db.Close()
	if _, err := s.Reserve(ctx, KeyOf(op), "w", time.Minute, ti0); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Reserve on a closed file: %v", err)
	}
	if _, err := s.GetByID(ctx, "op_1"); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("GetByID on a closed file: %v", err)
	}
	if err := s.Ping(ctx); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Ping on a closed file: %v", err)
	}
}
