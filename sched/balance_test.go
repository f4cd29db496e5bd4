package sched

import (
	"strings"
	"testing"
)

// TestBalance: routing.balance is the one two-threshold test; its deprecated
// aliases (hot_spot, prefix.balance_*_threshold) set it field by field, and
// two that disagree are refused.
func TestBalance(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		want Balance
		dep  int // deprecation warnings
		err  string
	}{
		{"default", Config{}, Balance{32, 3}, 0, ""},
		{"balance", Config{Balance: Balance{Abs: 5, Rel: 1.5}}, Balance{5, 1.5}, 0, ""},
		{"hot-spot", Config{HotSpot: HotSpotConfig{Abs: 4}}, Balance{4, 3}, 1, ""},
		{"prefix", Config{Prefix: PrefixConfig{BalanceAbsThreshold: 12, BalanceRelThreshold: 2}}, Balance{12, 2}, 1, ""},
		{"same", Config{Balance: Balance{Abs: 12}, Prefix: PrefixConfig{BalanceAbsThreshold: 12}}, Balance{12, 3}, 1, ""},
		{"mixed", Config{HotSpot: HotSpotConfig{Rel: 2}, Prefix: PrefixConfig{BalanceAbsThreshold: 12}}, Balance{12, 2}, 2, ""},
		{"disagree", Config{Balance: Balance{Abs: 8}, HotSpot: HotSpotConfig{Abs: 9}}, Balance{}, 1, "routing.balance.abs 8 and routing.hot_spot.abs 9 disagree"},
		{"negative", Config{Balance: Balance{Abs: -1}}, Balance{}, 0, "routing.balance.abs -1"},
		{"rel", Config{Balance: Balance{Rel: 0.5}}, Balance{}, 0, "routing.balance.rel 0.5"},
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
			if err != nil || b != tc.want {
				t.Fatalf("balance %+v, %v; want %+v", b, err, tc.want)
			}
			// Both users of the test get the same one.
			for _, name := range []string{Prefix, CacheAware} {
				c := tc.cfg
				c.Policy = name
				p := newProfileT(t, c, Pool{Capacity: caps(2, 10)})
				switch name {
				case Prefix:
					if got := p.picker.(prefixRulePicker).balance; got != tc.want {
						t.Errorf("prefix rule balance %+v", got)
					}
				case CacheAware:
					if got := p.filters[2].(hotSpotFilter).cfg; got != tc.want {
						t.Errorf("hot-spot balance %+v", got)
					}
				}
			}
		})
	}
}
