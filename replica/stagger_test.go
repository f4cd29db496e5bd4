package replica

import (
	"testing"
	"time"
)

// bursts has n decide in bursts of k decisions one second apart, each
// burst's learns echoed delay later, its peers heard from at each burst;
// it returns the time of the next burst.
func bursts(n *Node, peers []string, count, k int, delay time.Duration) time.Duration {
	var t time.Duration
	stamp := int64(0)
	for b := range count {
		t = time.Duration(b) * time.Second
		for _, p := range peers {
			n.Peers.Update(p, t, nil)
		}
		for range k {
			stamp++
			n.Unseen.Sent(stamp, t, 1000, 1000)
		}
		n.Unseen.Echo(stamp, t+delay)
	}
	t += time.Second
	for _, p := range peers {
		n.Peers.Update(p, t, nil)
	}
	return t
}

func TestStagger(t *testing.T) {
	// Ranks by id among the live replicas a, b, c: 0, 1, 2.
	for _, c := range []struct {
		id    string
		peers []string
		delay time.Duration
		want  time.Duration
	}{
		{"a", []string{"b", "c"}, time.Millisecond, 0},
		{"b", []string{"a", "c"}, time.Millisecond, 3 * time.Millisecond},
		{"c", []string{"a", "b"}, time.Millisecond, 6 * time.Millisecond},
		{"c", []string{"a", "b"}, 5 * time.Millisecond, 30 * time.Millisecond},
		{"c", []string{"a", "b"}, 10 * time.Millisecond, MaxStagger},
		{"c", []string{"a", "b"}, 100 * time.Millisecond, MaxStagger},
	} {
		n := &Node{ID: c.id, Peers: NewPeers(time.Second)}
		if got := n.Stagger(0); got != 0 {
			t.Errorf("%s: nothing sent yet: waits %v", c.id, got)
		}
		now := bursts(n, c.peers, 10, 3, c.delay)
		if got := n.Stagger(now); got != c.want {
			t.Errorf("%s among %v, bursts echoed after %v: waits %v, want %v", c.id, c.peers, c.delay, got, c.want)
		}
		n.NoStagger = true
		if got := n.Stagger(now); got != 0 {
			t.Errorf("%s with NoStagger: waits %v", c.id, got)
		}
	}

	// Decisions spread in time (one a second, echoed within 1 ms) are not
	// a burst; nor does a lone replica wait.
	n := &Node{ID: "c", Peers: NewPeers(time.Second)}
	if now := bursts(n, []string{"a", "b"}, 20, 1, time.Millisecond); n.Stagger(now) != 0 {
		t.Errorf("spread decisions: waits %v", n.Stagger(now))
	}
	n = &Node{ID: "c", Peers: NewPeers(time.Second)}
	if now := bursts(n, nil, 20, 3, time.Millisecond); n.Stagger(now) != 0 {
		t.Errorf("lone replica: waits %v", n.Stagger(now))
	}
	// Peers gone silent for the TTL leave c alone: it waits nothing.
	n = &Node{ID: "c", Peers: NewPeers(time.Second)}
	now := bursts(n, []string{"a", "b"}, 10, 3, time.Millisecond)
	if got := n.Stagger(now + 2*time.Second); got != 0 {
		t.Errorf("dead peers: waits %v", got)
	}
	// One dead peer: c's rank falls to 1.
	n.Peers.Update("b", now+1500*time.Millisecond, nil)
	if got := n.Stagger(now + 1500*time.Millisecond); got != 3*time.Millisecond {
		t.Errorf("a dead: waits %v, want 3ms", got)
	}
}

func TestExpectStaggered(t *testing.T) {
	// While the decisions are staggered, nothing unseen is expected.
	n := &Node{ID: "b", Peers: NewPeers(time.Second)}
	now := bursts(n, []string{"a", "c"}, 10, 3, time.Millisecond)
	n.Unseen.Sent(1<<40, now, 3000, 2000) // unseen at now
	e := eps(0, 1000, 5000, 9000)
	n.Expect(e, now)
	if got := pending(e); got[0] != 0 || got[1] != 1000 {
		t.Errorf("staggered: loads changed: %v", got)
	}
	// Unstaggered, the same node expects its peers' unseen decisions.
	n.NoStagger = true
	e = eps(0, 1000, 5000, 9000)
	n.Expect(e, now)
	if got := pending(e); got[0] == 0 {
		t.Errorf("unstaggered: nothing expected: %v", got)
	}
}

func TestStaggerAllocs(t *testing.T) {
	n := &Node{ID: "b", Peers: NewPeers(time.Second)}
	now := bursts(n, []string{"a", "c"}, 10, 3, time.Millisecond)
	if a := testing.AllocsPerRun(100, func() { _ = n.Stagger(now) }); a != 0 {
		t.Errorf("Stagger allocates %v times", a)
	}
}

// BenchmarkStagger is the request path's cost of a turn's length: a
// replica ranked 1 of 3 in bursts (the wait itself excluded).
func BenchmarkStagger(b *testing.B) {
	n := &Node{ID: "b", Peers: NewPeers(time.Second)}
	now := bursts(n, []string{"a", "c"}, 10, 3, time.Millisecond)
	b.ReportAllocs()
	for b.Loop() {
		if n.Stagger(now) == 0 {
			b.Fatal("no wait")
		}
	}
}

// TestStaggerSeeded: a seeded replica (Unseen.Seed) staggers its very
// first decision, by the seeded delay; its own echoes then replace the
// seed; decisions spread in time stop the waits within about 20; a seed
// never overwrites a measured delay.
func TestStaggerSeeded(t *testing.T) {
	n := &Node{ID: "c", Peers: NewPeers(time.Second)}
	n.Peers.Update("a", 0, nil)
	n.Peers.Update("b", 0, nil)
	if got := n.Stagger(0); got != 0 {
		t.Fatalf("unseeded: waits %v", got)
	}
	n.Unseen.Seed(2 * time.Millisecond)
	if got := n.Stagger(0); got != 12*time.Millisecond {
		t.Fatalf("seeded 2ms, rank 2: waits %v, want 12ms", got)
	}
	n.Unseen.Sent(1, 0, 100, 100)
	n.Unseen.Echo(1, 10*time.Millisecond) // a first measured echo: the mean moves 1/8 towards it
	if got := n.Stagger(0); got != 2*(2*time.Millisecond+(8*time.Millisecond)/8)*3 {
		t.Fatalf("after one 10ms echo: waits %v", got)
	}
	n.Unseen.Seed(time.Microsecond)
	if got := n.Stagger(0); got != 18*time.Millisecond {
		t.Fatalf("a seed overwrote the measured delay: waits %v", got)
	}
	// Decisions a second apart: within ~20 no longer bursty.
	waits := 0
	for i := range 40 {
		at := time.Duration(i+1) * time.Second
		n.Peers.Update("a", at, nil)
		n.Peers.Update("b", at, nil)
		if n.Stagger(at) > 0 {
			waits++
		}
		n.Unseen.Sent(int64(i+2), at, 100, 100)
		n.Unseen.Echo(int64(i+2), at+time.Millisecond)
	}
	if waits == 0 || waits > 25 {
		t.Fatalf("spread decisions waited %d times of 40: want the first ones only", waits)
	}
	lone := &Node{ID: "c", Peers: NewPeers(time.Second)}
	lone.Unseen.Seed(time.Millisecond)
	if got := lone.Stagger(0); got != 0 {
		t.Fatalf("a lone seeded replica waits %v", got)
	}
}

// TestStaggerTurn: a staggered decision's turn comes when every live
// replica ranked before it has had a learn applied (Node.Apply) since one
// exchange delay before the decision arrived, or at its deadline: learns
// of replicas ranked after it, of dead replicas, or from before the
// window do not count; load reports are not learns.
func TestStaggerTurn(t *testing.T) {
	const ms = time.Millisecond
	learn := func(n *Node, id string, at time.Duration) {
		t.Helper()
		if _, err := n.Apply(AppendLearn(nil, id, 0, "m", "http://e0", 16, 16, []uint64{1}), at); err != nil {
			t.Fatal(err)
		}
	}
	newNode := func(id string) (*Node, time.Duration) {
		n := &Node{ID: id, Peers: NewPeers(time.Second), Target: target{&recorder{got: map[int][][]uint64{}}, map[string]int{"http://e0": 0}}}
		return n, bursts(n, []string{"a", "b", "d"}, 10, 3, ms) // echoes of 1 ms
	}

	// c, ranked 2 of a, b, c, d: waits for a and b.
	n, now := newNode("c")
	turn, ok := n.Turn(now)
	if !ok || turn.Since != now+ms || turn.Deadline != now+6*ms {
		t.Fatalf("turn %+v %v, want since now+1ms, deadline now+6ms", turn, ok)
	}
	if got := n.Stagger(now); got != 6*ms {
		t.Fatalf("Stagger %v, want the deadline's 6ms", got)
	}
	if got := n.Due(turn, now); got != Waiting {
		t.Fatalf("at arrival: %v", got)
	}
	learn(n, "a", now-ms-1) // before the window: an earlier burst's
	learn(n, "d", now+100*time.Microsecond)
	if got := n.Due(turn, now+100*time.Microsecond); got != Waiting {
		t.Fatalf("an old learn of a and d's (ranked after): %v", got)
	}
	learn(n, "a", now+200*time.Microsecond)
	learn(n, "b", now+300*time.Microsecond)
	if got := n.Due(turn, now+300*time.Microsecond); got != Waiting {
		t.Fatalf("a's and b's learns sent before c's decision arrived (applied within a delay of it): %v", got)
	}
	learn(n, "a", now+ms)
	if got := n.Due(turn, now+ms); got != Waiting {
		t.Fatalf("a's learn, not b's: %v", got)
	}
	if _, err := n.Apply(AppendLoad(nil, "b", 0, nil), now+1050*time.Microsecond); err != nil {
		t.Fatal(err)
	}
	if got := n.Due(turn, now+1050*time.Microsecond); got != Waiting {
		t.Fatalf("b's load report taken for a learn: %v", got)
	}
	learn(n, "b", now+1100*time.Microsecond)
	if got := n.Due(turn, now+1100*time.Microsecond); got != Learnt {
		t.Fatalf("a's and b's learns applied a delay after the arrival: %v, want learns", got)
	}

	// Nothing from b: the deadline.
	n, now = newNode("c")
	turn, _ = n.Turn(now)
	learn(n, "a", now+200*time.Microsecond)
	if got := n.Due(turn, turn.Deadline-1); got != Waiting {
		t.Fatalf("just before the deadline: %v", got)
	}
	if got := n.Due(turn, turn.Deadline); got != Deadline {
		t.Fatalf("at the deadline: %v, want deadline", got)
	}

	// A learn applied before the arrival does not count, however
	// recent: a's decisions since are not in it (b, ranked 1, waits for
	// a); one a delay after the arrival does.
	n, now = newNode("b")
	learn(n, "a", now)
	turn, _ = n.Turn(now)
	if got := n.Due(turn, now); got != Waiting {
		t.Fatalf("a's learn applied at the arrival: %v, want waiting", got)
	}
	learn(n, "a", now+ms)
	if got := n.Due(turn, now+ms); got != Learnt {
		t.Fatalf("a's learn one delay after the arrival: %v, want learns", got)
	}

	// A replica ranked before that went silent for the TTL is not waited
	// for (nor ranked before: c's rank falls to 1).
	n, now = newNode("c")
	later := now + 1500*time.Millisecond
	n.Peers.Update("b", later, nil)
	n.Peers.Update("d", later, nil)
	turn, _ = n.Turn(later)
	if turn.Deadline != later+3*ms {
		t.Fatalf("a dead: deadline %v after arrival, want 3ms", turn.Deadline-later)
	}
	learn(n, "b", later+ms)
	if got := n.Due(turn, later+ms); got != Learnt {
		t.Fatalf("a dead, b's learn applied: %v, want learns", got)
	}
}

func TestStaggerDueAllocs(t *testing.T) {
	n := &Node{ID: "c", Peers: NewPeers(time.Second)}
	now := bursts(n, []string{"a", "b", "d"}, 10, 3, time.Millisecond)
	turn, _ := n.Turn(now)
	if a := testing.AllocsPerRun(100, func() { _, _ = n.Turn(now); _ = n.Due(turn, now) }); a != 0 {
		t.Errorf("Turn and Due allocate %v times", a)
	}
}

// BenchmarkStaggerDue is a waiting decision's check at each learn the
// reader applies: a replica ranked 2 of 4.
func BenchmarkStaggerDue(b *testing.B) {
	n := &Node{ID: "c", Peers: NewPeers(time.Second)}
	now := bursts(n, []string{"a", "b", "d"}, 10, 3, time.Millisecond)
	turn, _ := n.Turn(now)
	b.ReportAllocs()
	for b.Loop() {
		if n.Due(turn, now) != Waiting {
			b.Fatal("due")
		}
	}
}

// TestStaggerDeadlineTail: a turn's deadline is made of the 90th
// percentile of the last 32 echoes (nearest rank), not their mean: 4 slow
// echoes of 32 (12.5%) set it, 3 (9.4%) do not; the window forgets older
// echoes; the since-window and the burst test keep the mean.
func TestStaggerDeadlineTail(t *testing.T) {
	const ms = time.Millisecond
	deadline := func(slow int) (Turn, time.Duration) {
		n := &Node{ID: "b", Peers: NewPeers(time.Hour)}
		n.Peers.Update("a", 0, nil)
		n.Peers.Update("c", 0, nil)
		stamp := int64(0)
		for i := range 64 { // bursts of 2, one echo each
			at := time.Duration(i) * time.Second
			d := ms
			if i >= 32 && i%8 == 0 && (i-32)/8 < slow {
				d = 20 * ms // slow echoes among the last 32
			}
			if i < 32 && i%4 == 0 {
				d = 40 * ms // older ones, out of the window
			}
			stamp++
			n.Unseen.Sent(stamp, at, 100, 100)
			stamp++
			n.Unseen.Sent(stamp, at, 100, 100)
			n.Unseen.Echo(stamp, at+d)
		}
		now := 100 * time.Second
		turn, ok := n.Turn(now)
		if !ok {
			t.Fatalf("%d slow echoes: not staggered", slow)
		}
		return turn, now
	}
	turn, now := deadline(4)
	if got := turn.Deadline - now; got != MaxStagger {
		t.Errorf("4 echoes of 20 ms in the last 32: deadline %v after arrival, want MaxStagger (3 × the 90th percentile, 60ms, capped)", got)
	}
	if mean := turn.Since - now; mean >= 20*ms || mean <= ms {
		t.Errorf("since-window %v: want the echoes' mean, between 1 and 20 ms", mean)
	}
	turn, now = deadline(3)
	if got := turn.Deadline - now; got != 3*ms {
		t.Errorf("3 echoes of 20 ms in the last 32: deadline %v after arrival, want 3ms", got)
	}
}
