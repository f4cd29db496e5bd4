package load

import (
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
)

func TestObservePrefill(t *testing.T) {
	var l Ledger
	if l.PrefillRate() != 0 {
		t.Fatal("rate known before any observation")
	}
	l.Observe(10000, time.Second) // 10k tokens/s
	if r := l.PrefillRate(); r != 10000 {
		t.Fatalf("first observation: %v", r)
	}
	for range 200 {
		l.Observe(2000, time.Second)
	}
	if r := l.PrefillRate(); r < 2000 || r > 2100 {
		t.Fatalf("after 200 observations of 2k tokens/s the rate is %v", r)
	}
	l.Observe(0, time.Second)
	l.Observe(100, 0)
	if r := l.PrefillRate(); r < 2000 || r > 2100 {
		t.Fatalf("empty observations moved the rate to %v", r)
	}
}

// TestShareLifecycle: a request adds its prompt and its uncached part, its
// first token releases the backlog and teaches the rate from the backlog it
// joined, and its end releases the rest, exactly once.
func TestShareLifecycle(t *testing.T) {
	var l Ledger
	var a, b Share
	l.Send(&a, 10000, 6000, 0) // 4,000 uncached
	l.Send(&b, 5000, 0, 10*time.Millisecond)
	if got := l.InFlightTokens(); got != 15000 {
		t.Fatalf("in-flight tokens %d, want 15000", got)
	}
	if got := l.PendingPrefill(); got != 9000 {
		t.Fatalf("pending prefill %d, want 9000", got)
	}
	// b joined a backlog of 9,000 tokens and got its first token 900 ms
	// later: 10,000 tokens/s.
	b.FirstToken(910 * time.Millisecond)
	if got := l.PrefillRate(); got != 10000 {
		t.Fatalf("learnt rate %v, want 10000", got)
	}
	b.FirstToken(2 * time.Second) // only the first counts
	if got, r := l.PendingPrefill(), l.PrefillRate(); got != 4000 || r != 10000 {
		t.Fatalf("after a second first token: pending %d rate %v, want 4000 and 10000", got, r)
	}
	b.Finish()
	b.Finish()
	a.Finish() // ended without a first token: its backlog is released too
	if n, p := l.InFlightTokens(), l.PendingPrefill(); n != 0 || p != 0 {
		t.Fatalf("after every request ended: %d in-flight tokens, %d pending", n, p)
	}
	if got := l.PrefillRate(); got != 10000 {
		t.Fatalf("a request ended without a first token moved the rate to %v", got)
	}
}

// TestSmallBacklogTeachesNothing: a backlog within one step's token budget
// says how long a step took, not how fast prefill is, so it is not
// observed (else an endpoint given more work looks faster).
func TestSmallBacklogTeachesNothing(t *testing.T) {
	var l Ledger
	var s Share
	l.Send(&s, MinObservedTokens-1, 0, 0)
	s.FirstToken(30 * time.Millisecond)
	if r := l.PrefillRate(); r != 0 {
		t.Fatalf("a %d-token backlog taught the rate %v", MinObservedTokens-1, r)
	}
	s.Finish()
	l.Send(&s, MinObservedTokens, 0, 0)
	s.FirstToken(time.Second)
	if r := l.PrefillRate(); r != MinObservedTokens {
		t.Fatalf("a %d-token backlog in 1 s taught %v tokens/s", MinObservedTokens, r)
	}
}

// TestShareFullyCached: a prompt predicted wholly cached still counts one
// token of backlog (the engine computes at least the last token).
func TestShareFullyCached(t *testing.T) {
	var l Ledger
	var s Share
	l.Send(&s, 64, 64, 0)
	if p := l.PendingPrefill(); p != 1 {
		t.Fatalf("pending %d, want 1", p)
	}
	s.Finish()
	var none Share
	l.Send(&none, 0, 0, 0) // not tokenized: nothing recorded
	none.FirstToken(time.Second)
	none.Finish()
	if n, p, r := l.InFlightTokens(), l.PendingPrefill(), l.PrefillRate(); n != 0 || p != 0 || r != 0 {
		t.Fatalf("untokenized request left %d tokens, %d pending, rate %v", n, p, r)
	}
}

// TestTryAcquireExact: the slot limit holds exactly under concurrency.
func TestTryAcquireExact(t *testing.T) {
	var l Ledger
	const limit, tries = 7, 64
	var wg sync.WaitGroup
	var mu sync.Mutex
	got := 0
	for range tries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if l.TryAcquire(limit) {
				mu.Lock()
				got++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if got != limit || l.InFlight() != limit {
		t.Fatalf("%d acquired, %d in flight; want %d", got, l.InFlight(), limit)
	}
	for range limit {
		l.Release()
	}
	if l.InFlight() != 0 {
		t.Fatalf("%d in flight after releasing every slot", l.InFlight())
	}
}

func TestFill(t *testing.T) {
	var l Ledger
	var s Share
	l.Acquire()
	l.Send(&s, 300, 100, 0)
	l.Observe(5000, time.Second)
	e := sched.Endpoint{Name: "e", Ready: true, Waiting: 3, PrefillTokensPerSecond: 7}
	l.Fill(&e)
	// The learnt rate (5000) is not routed on: the field is left as it was.
	want := sched.Endpoint{Name: "e", Ready: true, Waiting: 3, InFlight: 1, InFlightTokens: 300,
		PendingPrefillTokens: 200, PrefillTokensPerSecond: 7}
	if e.Name != want.Name || e.Ready != want.Ready || e.Waiting != want.Waiting || e.InFlight != want.InFlight ||
		e.InFlightTokens != want.InFlightTokens || e.PendingPrefillTokens != want.PendingPrefillTokens ||
		e.PrefillTokensPerSecond != want.PrefillTokensPerSecond {
		t.Fatalf("Fill: %+v, want %+v", e, want)
	}
}

// BenchmarkShare is one request's accounting: send, first token, finish.
func BenchmarkShare(b *testing.B) {
	var l Ledger
	b.ReportAllocs()
	for i := range b.N {
		var s Share
		l.Send(&s, 2048, 1024, time.Duration(i))
		s.FirstToken(time.Duration(i) + time.Millisecond)
		s.Finish()
	}
}
