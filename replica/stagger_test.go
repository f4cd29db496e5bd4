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
		{"b", []string{"a", "c"}, time.Millisecond, 1250 * time.Microsecond},
		{"c", []string{"a", "b"}, time.Millisecond, 2500 * time.Microsecond},
		{"c", []string{"a", "b"}, 10 * time.Millisecond, 25 * time.Millisecond},
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
	if got := n.Stagger(now + 1500*time.Millisecond); got != 1250*time.Microsecond {
		t.Errorf("a dead: waits %v, want 1.25ms", got)
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
	if got := n.Stagger(0); got != 5*time.Millisecond {
		t.Fatalf("seeded 2ms, rank 2: waits %v, want 5ms", got)
	}
	n.Unseen.Sent(1, 0, 100, 100)
	n.Unseen.Echo(1, 10*time.Millisecond) // a first measured echo: the mean moves 1/8 towards it
	if got := n.Stagger(0); got != 2*(2*time.Millisecond+(8*time.Millisecond)/8)*5/4 {
		t.Fatalf("after one 10ms echo: waits %v", got)
	}
	n.Unseen.Seed(time.Microsecond)
	if got := n.Stagger(0); got != 7500*time.Microsecond {
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
