package sched

import "testing"

// TestGrowKeepsLearnt: every built-in policy is a Grower. A policy built
// for 64 slots learns four prompts, each on the one endpoint ready for it
// (0, 10, 40, 63); grown to 130 slots, with only the prompt's home and
// the new endpoint 129 ready, the policies with an index route each
// prompt home with all its blocks matched, and a prompt learnt on 129
// goes there; every policy picks in range over 130 endpoints.
func TestGrowKeepsLearnt(t *testing.T) {
	homes := []int{0, 10, 40, 63}
	for _, name := range Names() {
		p := mustNew(t, Config{Policy: name}, 64)
		g, ok := p.(Grower)
		if !ok {
			t.Fatalf("%s is not a Grower", name)
		}
		for k, home := range homes {
			eps := ready(64)
			for i := range eps {
				eps[i].Ready = i == home
			}
			if d := p.Pick(req(tokens(1600, uint32(1+k*5000))), eps); d.Endpoint != home {
				t.Fatalf("%s: prompt %d picked %d, the only ready endpoint is %d", name, k, d.Endpoint, home)
			}
		}
		settle(p)
		if err := g.Grow(130); err != nil {
			t.Fatal(err)
		}
		if err := g.Grow(10); err != nil { // smaller: nothing changes
			t.Fatal(err)
		}
		if r, ok := p.(Resizer); ok {
			for i := 64; i < 130; i++ {
				r.SetCapacity(i, 10000)
			}
		}
		indexed := name == Prefix || name == CacheAware
		for k, home := range homes {
			eps := ready(130)
			for i := range eps {
				eps[i].Ready = i == home || i == 129
			}
			d := p.Pick(req(tokens(1600, uint32(1+k*5000))), eps)
			if d.Endpoint != home && d.Endpoint != 129 {
				t.Fatalf("%s: picked %d, not a ready endpoint", name, d.Endpoint)
			}
			if indexed && (d.Endpoint != home || d.MatchedBlocks != 100) {
				t.Fatalf("%s: after the grow prompt %d went to %d (%d blocks matched), its home is %d", name, k, d.Endpoint, d.MatchedBlocks, home)
			}
		}
		eps := ready(130)
		for i := range eps {
			eps[i].Ready = i == 129
		}
		fresh := req(tokens(1600, 900000))
		if d := p.Pick(fresh, eps); d.Endpoint != 129 {
			t.Fatalf("%s: picked %d, the only ready endpoint is 129", name, d.Endpoint)
		}
		settle(p)
		eps = ready(130)
		if d := p.Pick(fresh, eps); indexed && (d.Endpoint != 129 || d.MatchedBlocks != 100) {
			t.Fatalf("%s: the prompt learnt on the new endpoint 129 went to %d (%d blocks)", name, d.Endpoint, d.MatchedBlocks)
		}
	}
}

// settle applies what p's decisions queued (Settler), as the gateway's
// settler does.
func settle(p Policy) {
	if s, ok := p.(Settler); ok {
		s.Settle()
	}
}
