package replica

import (
	"strconv"
	"testing"
	"time"
)

// BenchmarkApplyFlappingLoad: 63 peers report all 1,000 endpoints; one
// more sends one-entry reports naming a different endpoint each time.
func BenchmarkApplyFlappingLoad(b *testing.B) {
	const n = 1000
	node := &Node{ID: "a", Peers: NewPeers(time.Hour), Target: newURLTarget(n)}
	for i := range MaxPeers - 1 {
		node.Apply(loadReport("p"+strconv.Itoa(i), endpointURL, n), 0)
	}
	msgs := [2][]byte{
		loadReport("evil", func(int) string { return endpointURL(0) }, 1),
		loadReport("evil", func(int) string { return endpointURL(1) }, 1),
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(msgs[0])))
	for i := 0; b.Loop(); i++ {
		node.Apply(msgs[i&1], 0)
	}
}

// TestFlappingLoadReportCheap: a peer whose one-entry load reports name a
// different endpoint each time, beside 63 peers reporting 1,000
// endpoints, costs the reader a few allocations a report, not a rebuild
// of every peer's cells (7,031 allocations and 1.2 MB a 44-byte report
// before).
func TestFlappingLoadReportCheap(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under -race")
	}
	const n = 1000
	node := &Node{ID: "a", Peers: NewPeers(time.Hour), Target: newURLTarget(n)}
	for i := range MaxPeers - 1 {
		node.Apply(loadReport("p"+strconv.Itoa(i), endpointURL, n), 0)
	}
	msgs := [2][]byte{
		loadReport("evil", func(int) string { return endpointURL(0) }, 1),
		loadReport("evil", func(int) string { return endpointURL(1) }, 1),
	}
	i := 0
	if a := testing.AllocsPerRun(50, func() { node.Apply(msgs[i&1], 0); i++ }); a > 8 {
		t.Fatalf("a flapping one-entry load report allocates %v times", a)
	}
	// Every report's first entry carries in-flight 0, the peers' second 1.
	if a, b := node.Peers.Sum(endpointURL(0), 0).InFlight, node.Peers.Sum(endpointURL(1), 0).InFlight; a != 0 || b != MaxPeers-1 {
		t.Fatalf("in flight %d and %d, want 0 and %d", a, b, MaxPeers-1)
	}
}

// TestPeersViewMatchesCells: after any sequence of reports, credits and
// expiries, every endpoint's summed load is the sum over the live peers'
// cells (the incrementally kept view agrees with the table), and the view
// keeps no more URLs than twice the cells' and 64.
func TestPeersViewMatchesCells(t *testing.T) {
	const urls = 300
	p := NewPeers(10 * time.Millisecond)
	rng := uint64(1)
	next := func(n int) int {
		rng = rng*6364136223846793005 + 1442695040888963407
		return int(rng>>33) % n
	}
	now := time.Duration(0)
	for step := range 3000 {
		now += time.Duration(next(3)) * time.Millisecond
		id := "p" + strconv.Itoa(next(MaxPeers+8))
		switch next(3) {
		case 0, 1:
			var loads []LoadEntry
			for range next(40) {
				u := next(urls)
				loads = append(loads, LoadEntry{Endpoint: endpointURL(u), Load: Load{int64(u + 1), int64(step), 1}})
			}
			p.Update(id, now, loads)
		case 2:
			p.Routed(id, endpointURL(next(urls)), now, 5, 2)
		}
		if step%100 != 0 {
			continue
		}
		want := map[string]Load{}
		nonEmpty := 0
		for _, ps := range p.peers {
			if now-time.Duration(ps.at.Load()) > p.ttl {
				continue
			}
			for u, c := range ps.cells {
				l := want[u]
				l.InFlight += c.inFlight.Load()
				l.InFlightTokens += c.tokens.Load()
				l.PendingPrefill += c.prefil.Load()
				want[u] = l
			}
		}
		for u := range urls {
			if got := p.Sum(endpointURL(u), now); got != want[endpointURL(u)] {
				t.Fatalf("step %d: endpoint %d: view %+v, cells %+v", step, u, got, want[endpointURL(u)])
			}
		}
		v := p.view.Load()
		for _, uc := range v.byURL {
			if len(*uc.cells.Load()) > 0 {
				nonEmpty++
			}
		}
		if len(v.byURL) > 2*nonEmpty+65 {
			t.Fatalf("step %d: view keeps %d URLs for %d with cells", step, len(v.byURL), nonEmpty)
		}
		if live := p.Live(now); live > MaxPeers {
			t.Fatalf("%d live peers", live)
		}
	}
}

// TestRoutedSaturates: a peer that sends learns of the largest prompt the
// wire carries (2^40 tokens) and never a load report credits an endpoint
// at most that many tokens in flight, never a sum that grows without
// bound (and wraps negative after 2^23 learns, drawing every pick).
func TestRoutedSaturates(t *testing.T) {
	p := NewPeers(time.Hour)
	url := endpointURL(0)
	for range 4 {
		p.Routed("evil", url, 0, maxCount, maxCount)
	}
	if got := p.Sum(url, 0); got.InFlight != 4 || got.InFlightTokens != maxCount || got.PendingPrefill != maxCount {
		t.Fatalf("after 4 learns of %d tokens: %+v, want 4 in flight and %d tokens, %d pending", int64(maxCount), got, int64(maxCount), int64(maxCount))
	}
	p.Update("evil", 0, []LoadEntry{{Endpoint: url, Load: Load{1, 2, 3}}})
	if got := p.Sum(url, 0); got != (Load{1, 2, 3}) {
		t.Fatalf("a report after them: %+v", got)
	}
}
