package sched

import (
	"strings"
	"testing"
)

// TestBalance: routing.balance is the one two-threshold test; its deprecated
// aliases (hot_spot, prefix.balance_*_threshold) set it field by field, and
// two that disagree are refused.
func TestBalance(t *testing.T) {
	on, off, off2 := true, false, false
	for _, tc := range []struct {
		name string
		cfg  Config
		want Balance
		dep  int // deprecation warnings
		err  string
	}{
		{"default", Config{}, Balance{Abs: 32, Rel: 3}, 0, ""},
		{"balance", Config{Balance: Balance{Abs: 5, Rel: 1.5}}, Balance{Abs: 5, Rel: 1.5}, 0, ""},
		{"hot-spot", Config{HotSpot: HotSpotConfig{Abs: 4}}, Balance{Abs: 4, Rel: 3}, 1, ""},
		{"prefix", Config{Prefix: PrefixConfig{BalanceAbsThreshold: 12, BalanceRelThreshold: 2}}, Balance{Abs: 12, Rel: 2}, 1, ""},
		{"same", Config{Balance: Balance{Abs: 12}, Prefix: PrefixConfig{BalanceAbsThreshold: 12}}, Balance{Abs: 12, Rel: 3}, 1, ""},
		{"mixed", Config{HotSpot: HotSpotConfig{Rel: 2}, Prefix: PrefixConfig{BalanceAbsThreshold: 12}}, Balance{Abs: 12, Rel: 2}, 2, ""},
		{"disagree", Config{Balance: Balance{Abs: 8}, HotSpot: HotSpotConfig{Abs: 9}}, Balance{}, 1, "routing.balance.abs 8 and routing.hot_spot.abs 9 disagree"},
		{"negative", Config{Balance: Balance{Abs: -1}}, Balance{}, 0, "routing.balance.abs -1"},
		{"rel", Config{Balance: Balance{Rel: 0.5}}, Balance{}, 0, "routing.balance.rel 0.5"},
		{"keep-fastest-off", Config{Balance: Balance{KeepFastest: &off}}, Balance{Abs: 32, Rel: 3, KeepFastest: &off}, 0, ""},
		{"keep-fastest-on", Config{Balance: Balance{KeepFastest: &on}}, Balance{Abs: 32, Rel: 3, KeepFastest: &on}, 0, ""},
		{"keep-fastest-hot-spot", Config{HotSpot: HotSpotConfig{KeepFastest: &off}}, Balance{Abs: 32, Rel: 3, KeepFastest: &off}, 1, ""},
		{"keep-fastest-same", Config{Balance: Balance{KeepFastest: &off}, HotSpot: HotSpotConfig{KeepFastest: &off2}}, Balance{Abs: 32, Rel: 3, KeepFastest: &off}, 1, ""},
		{"keep-fastest-disagree", Config{Balance: Balance{KeepFastest: &on}, HotSpot: HotSpotConfig{KeepFastest: &off}}, Balance{}, 1, "routing.balance.keep_fastest true and routing.hot_spot.keep_fastest false disagree"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if n := len(tc.cfg.Deprecated()); n != tc.dep {
				t.Errorf("%d deprecation warnings, want %d: %q", n, tc.dep, tc.cfg.Deprecated())
			}
			b, err := tc.cfg.balance()
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				if err := Validate(tc.cfg); err == nil {
					t.Fatal("Validate accepted it")
				}
				return
			}
			if err != nil || !sameBalance(b, tc.want) {
				t.Fatalf("balance %+v, %v; want %+v", b, err, tc.want)
			}
			// Both users of the test get the same one.
			for _, name := range []string{Prefix, CacheAware} {
				c := tc.cfg
				c.Policy = name
				p := newProfileT(t, c, Pool{Capacity: caps(2, 10)})
				switch name {
				case Prefix:
					if got := p.picker.(prefixRulePicker).balance; !sameBalance(got, tc.want) {
						t.Errorf("prefix rule balance %+v", got)
					}
				case CacheAware:
					f := p.filters[2].(hotSpotFilter)
					if got := f.cfg; !sameBalance(got, tc.want) {
						t.Errorf("hot-spot balance %+v", got)
					}
					// keep_fastest on unless set off: the filter then prices.
					if keep := tc.want.KeepFastest == nil || *tc.want.KeepFastest; (f.cost != nil) != keep {
						t.Errorf("hot-spot filter pricing %v, want %v (keep_fastest)", f.cost != nil, keep)
					}
				}
			}
		})
	}
}

// sameBalance compares two balance tests by value (KeepFastest is a
// pointer: set or not, and what it says).
func sameBalance(a, b Balance) bool {
	return a.Abs == b.Abs && a.Rel == b.Rel && (a.KeepFastest == nil) == (b.KeepFastest == nil) && a.keepFastest() == b.keepFastest()
}

// keep_fastest: the hot-spot filter keeps an overloaded candidate only while
// its estimated TTFT is below every other candidate's that is not
// overloaded; a tie, or a backlog that makes it slower, moves the request
// (the rag workload's warm followers, sched/README.md "The rag and agentic
// cells").
func TestHotSpotKeepFastest(t *testing.T) {
	cfg := func(keep bool) Config {
		return Config{Policy: "h", Balance: Balance{Abs: 2, Rel: 1.5, KeepFastest: &keep}, Profiles: map[string]ProfileConfig{"h": {
			Filters: []string{FilterHotSpot},
			Scorers: []ScorerConfig{{Type: ScorerPrecisePrefix, Weight: 0}, {Type: ScorerCost, Weight: 1}},
		}}}
	}
	// A 12,800-token document (800 blocks) and a short question: endpoint 0
	// holds the document and has 10 requests in flight, the others none.
	doc := req(tokens(12_900, 1))
	pool := Pool{Capacity: caps(3, 100000), Precise: fm(800, 0, 0)}
	eps := ready(3)
	eps[0].InFlight = 10
	if d := newProfileT(t, cfg(false), pool).Pick(doc, eps); d.Endpoint == 0 {
		t.Fatalf("without keep_fastest the hot endpoint stayed: %+v", d)
	}
	p := newProfileT(t, cfg(true), pool)
	if d := p.Pick(doc, eps); d.Endpoint != 0 {
		t.Fatalf("warm follower: %+v, want its hot home (100 tokens to prefill against 12,900)", d)
	}
	// Its home busy with 20,000 tokens of another prefill: elsewhere is sooner.
	eps[0].PendingPrefillTokens = 20_000
	if d := p.Pick(doc, eps); d.Endpoint == 0 {
		t.Fatalf("warm follower behind 20,000 tokens: %+v, want an endpoint that is not hot", d)
	}
	// A cold prompt: every estimate equal, the tie moves it.
	eps[0].PendingPrefillTokens = 0
	cold := Pool{Capacity: caps(3, 100000), Precise: fm(0, 0, 0)}
	for range 20 {
		if d := newProfileT(t, cfg(true), cold).Pick(doc, eps); d.Endpoint == 0 {
			t.Fatalf("cold prompt on a tie: %+v, want an endpoint that is not hot", d)
		}
	}
	// The filter never empties the set and leaves a cool fleet alone.
	c := &Cycle{p: p, Req: doc, Eps: ready(3), matched: make([]int, 3), other: make([]int, 3)}
	if got := p.filters[0].Filter(c, []int{0, 1, 2}); !equalInts(got, []int{0, 1, 2}) {
		t.Fatalf("no endpoint hot: %v, want all", got)
	}
}
