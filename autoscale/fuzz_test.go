package autoscale

import (
	"strings"
	"testing"
	"time"
)

// FuzzParseConfig: any spec either fails with an error or yields a valid
// configuration whose Scaler decides within [Min, Max] on any signals;
// nothing panics. Seed corpus: testdata/fuzz/FuzzParseConfig and below.
func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{
		"min=0,max=8", "min=1,max=6,target=28", "max=4,target=off,rate=3", "max=2,kv=-1,queue=-1,ttft=500ms",
		"max=4096,up_window=1h,down_window=0s,up_period=1s,up_percent=0,up_engines=0,down_percent=100",
		"max=4,interval=5s,hold_ttl=1m", "max=4,,", "=", "max=1e9", "max=4,target=NaN", "max=4,target=+Inf",
	} {
		f.Add(s, 3, 100, 0.5)
	}
	f.Fuzz(func(t *testing.T, spec string, ready, load int, kv float64) {
		if len(spec) > 4096 {
			return
		}
		c, rest, err := ParseConfig(spec)
		if err != nil {
			return
		}
		for _, r := range rest {
			if !strings.Contains(r, "=") {
				t.Fatalf("rest item %q without =", r)
			}
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("ParseConfig(%q) returned an invalid config: %v", spec, err)
		}
		s, err := New(c)
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		sig := Signals{Ready: ready % 5000, InFlight: load, Queued: load / 2, KVUtil: kv, Waiting: load / 3, ArrivalRate: kv * 10, TTFT: time.Duration(load) * time.Millisecond}
		for i := range 3 {
			d := s.Decide(time.Duration(i)*time.Second, sig)
			if d.Desired < c.Min || d.Desired > c.Max {
				t.Fatalf("%q: desired %d outside [%d, %d]", spec, d.Desired, c.Min, c.Max)
			}
		}
	})
}
