package replica

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
)

func eps(loads ...int) []sched.Endpoint {
	out := make([]sched.Endpoint, len(loads))
	for i, l := range loads {
		out[i] = sched.Endpoint{Name: fmt.Sprintf("http://10.0.0.%d:8000", i), Ready: true, PendingPrefillTokens: l}
	}
	return out
}

func pending(e []sched.Endpoint) []int {
	var out []int
	for i := range e {
		out = append(out, e[i].PendingPrefillTokens)
	}
	return out
}

func TestWaterFill(t *testing.T) {
	f := fieldPrefill
	for _, c := range []struct {
		in     []int
		amount int64
		want   []int
	}{
		{[]int{0, 10, 20, 50}, 25, []int{17, 17, 20, 50}}, // 17+7 = 24 ≤ 25 < 18+8
		{[]int{0, 10, 20, 50}, 0, []int{0, 10, 20, 50}},
		{[]int{5, 5, 5}, 6, []int{7, 7, 7}},
		{[]int{0, 100}, 40, []int{40, 100}},
		{[]int{0, 10, 20, 50}, 1000, []int{270, 270, 270, 270}},
	} {
		e := eps(c.in...)
		waterFill(e, c.amount, f)
		if got := pending(e); !slices.Equal(got, c.want) {
			t.Errorf("waterFill(%v, %d) = %v, want %v", c.in, c.amount, got, c.want)
		}
	}
	e := eps(0, 10, 20)
	e[0].Ready = false // not a candidate: neither the least nor raised
	waterFill(e, 10, f)
	if got := pending(e); !slices.Equal(got, []int{0, 20, 20}) {
		t.Errorf("with endpoint 0 not ready: %v", got)
	}
	e = eps(1, 2)
	e[0].Ready, e[1].Ready = false, false
	waterFill(e, 10, f)
	if got := pending(e); !slices.Equal(got, []int{1, 2}) {
		t.Errorf("none ready: %v", got)
	}
}

func TestUnseen(t *testing.T) {
	var u Unseen
	ms := time.Millisecond
	u.Sent(100, 1*ms, 1000, 800)
	u.Sent(200, 2*ms, 3000, 2800)
	u.Sent(300, 3*ms, 1000, 800)
	l := u.Load(3*ms, time.Second)
	if l.InFlight != 3 {
		t.Fatalf("3 sent, none echoed: %+v", l)
	}
	// The mean (EWMA from the first): 1000 → 1000 + 2000/64 → … ≈ 1030.
	if l.InFlightTokens < 3*1000 || l.InFlightTokens > 3*1100 || l.PendingPrefill < 3*800 || l.PendingPrefill > 3*900 {
		t.Errorf("load %+v: want 3 × the mean decision (≈1030 prompt, ≈830 pending tokens)", l)
	}
	u.Echo(200, 0) // its own learn of stamp 200 came back: 100 and 200 seen
	if l := u.Load(3*ms, time.Second); l.InFlight != 1 {
		t.Errorf("after echo of 200: %+v, want 1 unseen", l)
	}
	u.Sent(400, 4*ms, 1000, 800)
	if l := u.Load(3*ms+time.Second+ms/2, time.Second); l.InFlight != 1 {
		t.Errorf("300 older than the max age: %+v, want only 400 left", l)
	}
	u.Echo(1<<40, 0)
	if l := u.Load(5*ms, time.Second); l.InFlight != 0 || l.InFlightTokens != 0 || l.PendingPrefill != 0 {
		t.Errorf("all echoed: %+v", l)
	}
	for i := range unseenCap + 10 {
		u.Sent(int64(1000+i), 5*ms, 1, 1)
	}
	if l := u.Load(5*ms, time.Second); l.InFlight != unseenCap {
		t.Errorf("beyond the cap: %d unseen, want %d", l.InFlight, unseenCap)
	}
}

// node returns a replica node named id whose peers (named ids) were
// heard from at time 0.
func node(id string, peers ...string) *Node {
	n := &Node{ID: id, Peers: NewPeers(time.Second)}
	for _, p := range peers {
		n.Peers.Update(p, 0, nil)
	}
	return n
}

func TestExpectLoneReplica(t *testing.T) {
	n := node("a")
	n.Unseen.Sent(1, 0, 1000, 1000)
	e := eps(0, 10, 20)
	e[1].Preferred = true // left from an earlier use of the snapshot
	n.Expect(e, 0)
	if got := pending(e); !slices.Equal(got, []int{0, 10, 20}) {
		t.Errorf("lone replica changed the loads: %v", got)
	}
	for i := range e {
		if e[i].Preferred {
			t.Errorf("lone replica: endpoint %d preferred", i)
		}
	}
	// A peer silent for longer than the TTL is not live.
	n = node("a", "b")
	n.Unseen.Sent(1, 0, 1000, 1000)
	e = eps(0, 10, 20)
	n.Expect(e, 2*time.Second)
	if got := pending(e); !slices.Equal(got, []int{0, 10, 20}) {
		t.Errorf("dead peer: loads changed: %v", got)
	}
}

func TestExpectFills(t *testing.T) {
	n := node("a", "b", "c")
	e := eps(0, 1000, 5000, 9000)
	n.Expect(e, 0)
	if got := pending(e); !slices.Equal(got, []int{0, 1000, 5000, 9000}) {
		t.Errorf("nothing unseen: loads changed: %v", got)
	}
	// One decision of 2,000 pending tokens unseen: each of the two peers
	// is expected to have routed one too, 4,000 tokens onto the least
	// loaded: (L − 0) + (L − 1000) = 4000, L = 2500.
	n.Unseen.Sent(1, 0, 3000, 2000)
	for i, f := range []int{0, 3, 3, 3} {
		e[i].InFlight = f
	}
	n.Expect(e, 0)
	if got := pending(e); !slices.Equal(got, []int{2500, 2500, 5000, 9000}) {
		t.Errorf("one unseen: %v, want [2500 2500 5000 9000]", got)
	}
	if e[0].InFlight != 2 || e[1].InFlight != 3 {
		t.Errorf("in flight: %d %d, want 2 3 (2 requests onto the least loaded)", e[0].InFlight, e[1].InFlight)
	}
	// Its echo: nothing unseen any more.
	if _, err := n.Apply(AppendLearn(nil, "a", 1, "m", "http://10.0.0.0:8000", 3000, 2000, []uint64{1}), 0); err != nil {
		t.Fatal(err)
	}
	e = eps(0, 1000, 5000, 9000)
	n.Expect(e, 0)
	if got := pending(e); !slices.Equal(got, []int{0, 1000, 5000, 9000}) {
		t.Errorf("after the echo: %v", got)
	}
}

// TestExpectShares: live replicas' shares partition the pool, evenly,
// whatever order each configuration lists the endpoints in.
func TestExpectShares(t *testing.T) {
	ids := []string{"gw-b", "gw-a", "gw-c"}
	const n = 8
	owner := map[string]string{}
	for k, id := range ids {
		var peers []string
		for _, p := range ids {
			if p != id {
				peers = append(peers, p)
			}
		}
		nd := node(id, peers...)
		e := eps(make([]int, n)...)
		if k == 1 {
			slices.Reverse(e) // another configuration order
		}
		nd.Expect(e, 0)
		mine := 0
		for i := range e {
			if !e[i].Preferred {
				continue
			}
			mine++
			if o, ok := owner[e[i].Name]; ok {
				t.Errorf("%s in the shares of %s and %s", e[i].Name, o, id)
			}
			owner[e[i].Name] = id
		}
		if mine < n/len(ids) || mine > n/len(ids)+1 {
			t.Errorf("%s's share: %d of %d endpoints", id, mine, n)
		}
		// Cached: the same answer again.
		again := slices.Clone(e)
		nd.Expect(again, 0)
		for i := range e {
			if again[i].Preferred != e[i].Preferred {
				t.Errorf("%s: share changed on a second call", id)
			}
		}
	}
	if len(owner) != n {
		t.Errorf("%d of %d endpoints in some share", len(owner), n)
	}
	// One replica gone: the two left share the pool between them.
	nd := node("gw-a", "gw-b")
	e := eps(make([]int, n)...)
	nd.Expect(e, 0)
	mine := 0
	for i := range e {
		if e[i].Preferred {
			mine++
		}
	}
	if mine != n/2 {
		t.Errorf("two replicas: share of %d, want %d", mine, n/2)
	}
}

func TestExpectAllocs(t *testing.T) {
	n := node("a", "b", "c")
	e := eps(0, 1000, 5000, 9000, 200, 300, 400, 500)
	n.Unseen.Sent(1, 0, 3000, 2000)
	n.Expect(e, 0) // computes the share
	if a := testing.AllocsPerRun(100, func() { n.Expect(e, 0) }); a != 0 {
		t.Errorf("Expect: %.1f allocations per call, want 0", a)
	}
}

// BenchmarkExpect is a decision's cost of replicas on the request path
// with two live peers and four of this replica's decisions unseen.
func BenchmarkExpect(b *testing.B) {
	for _, size := range []int{8, 1000} {
		b.Run(fmt.Sprint(size), func(b *testing.B) {
			n := node("a", "b", "c")
			loads := make([]int, size)
			for i := range loads {
				loads[i] = (i * 7919) % 50_000
			}
			base := eps(loads...)
			e := slices.Clone(base)
			for i := range 4 {
				n.Unseen.Sent(int64(i), 0, 14_000, 12_000)
			}
			n.Expect(e, 0)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				copy(e, base)
				n.Expect(e, 0)
			}
		})
	}
}
