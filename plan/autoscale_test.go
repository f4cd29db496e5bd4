package plan

import (
	"bytes"
	"context"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
)

// waveTrace is a quiet phase, a burst and a quiet phase again (gaps in ms):
// 4,096-token prompts, 16 output tokens.
func waveTrace() []trace.Record {
	var recs []trace.Record
	at := time.Duration(0)
	add := func(n int, gap time.Duration) {
		for range n {
			i := len(recs)
			ids := make([]int64, 8)
			for k := range ids {
				ids[k] = int64(i*8 + k)
			}
			recs = append(recs, trace.Record{Timestamp: at, InputLength: 8 * 512, OutputLength: 16, HashIDs: ids})
			at += gap
		}
	}
	add(60, 2*time.Second)         // 2 minutes at 0.5 req/s
	add(240, 250*time.Millisecond) // 1 minute at 4 req/s
	add(120, 2*time.Second)        // 4 minutes at 0.5 req/s
	return recs
}

func TestParseAutoscale(t *testing.T) {
	a, err := ParseAutoscale("min=0,max=6,target=8,interval=5s,hold_ttl=1m,initial=2")
	if err != nil {
		t.Fatal(err)
	}
	if a.Policy.Max != 6 || a.Policy.TargetInFlight != 8 || a.Interval != 5*time.Second || a.HoldTTL != time.Minute ||
		a.Initial != 2 || a.Startup != DefaultStartup || a.fixedColdStart {
		t.Fatalf("%+v", a)
	}
	if a, err := ParseAutoscale("max=2,startup=remote,image_cached=false"); err != nil ||
		a.Startup != (sim.StartupInput{Source: sim.SourceRemote}) {
		t.Fatalf("startup=remote,image_cached=false: %+v, %v", a, err)
	}
	if a, _ := ParseAutoscale("min=1,max=2,initial=0,cold_start=10s"); a.Initial != -1 || a.ColdStartOrPolicy() != 10*time.Second {
		t.Fatalf("initial=0: %+v", a)
	}
	for spec, want := range map[string]string{
		"max=4,interval=x":                    "interval=x",
		"max=4,initial=9":                     "initial=9",
		"max=4,bogus=1":                       "unknown key",
		"min=1":                               "max is required",
		"max=4,hold_ttl=-1s":                  "hold_ttl",
		"max=4,startup=s3":                    "startup=s3",
		"max=4,image_cached=maybe":            "image_cached=maybe",
		"max=4,cold_start=9s,startup=nvme":    "give one",
		"max=4,cache=hot":                     "cache=hot",
		"max=4,cache=cold,startup=nvme":       "give one",
		"max=4,cache=cold,cold_start=9s":      "give one",
		"max=4,engines_per_node=2":            "need cache=",
		"max=4,cache=cold,engines_per_node=0": "engines_per_node=0",
		"max=4,cache=cold,peers=maybe":        "peers=maybe",
	} {
		if _, err := ParseAutoscale(spec); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want %q", spec, err, want)
		}
	}
}

func TestBurstMask(t *testing.T) {
	var recs []measure.Record
	for i := range 60 { // one a second for a minute
		recs = append(recs, measure.Record{ArrivalMs: float64(i) * 1000})
	}
	for i := range 180 { // three a second for a minute
		recs = append(recs, measure.Record{ArrivalMs: 60000 + float64(i)*1000/3})
	}
	for i := range 60 {
		recs = append(recs, measure.Record{ArrivalMs: 120000 + float64(i)*1000})
	}
	mask := BurstMask(recs)
	for i, in := range mask {
		if want := i >= 60 && i < 240; in != want {
			t.Fatalf("record %d at %v ms: burst %v, want %v", i, recs[i].ArrivalMs, in, want)
		}
	}
}

// TestAutoscaleAgainstStatic: plan's autoscaled run is compared with the
// smallest static size meeting the SLO; it costs fewer GPU-hours than the
// largest fleet, the report says so, and the result is deterministic.
func TestAutoscaleAgainstStatic(t *testing.T) {
	a, err := ParseAutoscale("min=1,max=4,target=2,down_window=1m,interval=5s,cold_start=20s")
	if err != nil {
		t.Fatal(err)
	}
	opts := Options{Records: waveTrace(), Engines: []int{1, 2, 4}, Policies: []string{sched.LeastRequest},
		SLO: mustSLO(t, "ttft_p90=5s"), Workers: 2, NoReferences: true, Autoscale: a}
	res, err := Run(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Rows) != 4 || len(res.Autoscale) != 1 {
		t.Fatalf("%d rows, %d comparisons", len(res.Rows), len(res.Autoscale))
	}
	c := res.Autoscale[0]
	auto := &res.Rows[c.Row]
	if auto.Scale == nil || auto.Scale.Started == 0 || auto.Scale.PeakEngines < 2 {
		t.Fatalf("autoscaled row %+v", auto.Scale)
	}
	if c.Static < 0 || res.Rows[c.Static].Scale != nil {
		t.Fatalf("static row %d", c.Static)
	}
	static := &res.Rows[c.Static]
	largest := &res.Rows[2]
	if largest.Engines != 4 || c.GPUHours >= largest.GPUHours || c.GPUHours <= 0 {
		t.Fatalf("autoscaled GPU-hours %.4f against the 4-engine fleet's %.4f", c.GPUHours, largest.GPUHours)
	}
	if want := 1 - c.GPUHours/static.GPUHours; c.Saving != want {
		t.Fatalf("saving %v, want %v", c.Saving, want)
	}
	// GPU-hours of a static row: engines × duration × tensor parallelism.
	tp := opts.Engine.WithDefaults().Profile.TensorParallel
	if want := float64(static.Engines*tp) * static.Summary.DurationS / 3600; static.GPUHours != want {
		t.Fatalf("static GPU-hours %v, want %v", static.GPUHours, want)
	}
	if auto.BurstRequests == 0 || static.BurstRequests != auto.BurstRequests {
		t.Fatalf("burst requests %d and %d", auto.BurstRequests, static.BurstRequests)
	}
	if res.Recommendation == nil || res.Rows[res.Recommendation.Row].Scale != nil {
		t.Fatalf("recommendation %+v: must be a static fleet", res.Recommendation)
	}
	var buf bytes.Buffer
	if err := res.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"least-request autoscaled", "autoscaled least-request (min=1,max=4", "best static fleet:", "of GPU-hours", "in bursts"} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, buf.String())
		}
	}
	var html bytes.Buffer
	if err := res.WriteHTML(&html); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(html.String(), "Autoscaling") || !strings.Contains(html.String(), "engines over time") {
		t.Error("the HTML page has no autoscaling section")
	}
	var js bytes.Buffer
	if err := res.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var back Result
	if err := json.Unmarshal(js.Bytes(), &back); err != nil || len(back.Autoscale) != 1 || back.Rows[c.Row].Scale == nil {
		t.Fatalf("JSON round trip: %v", err)
	}

	again, err := Run(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(again.Autoscale, res.Autoscale) || !reflect.DeepEqual(again.Rows[c.Row].Scale, auto.Scale) {
		t.Fatal("autoscaled run differs between two sweeps")
	}
}

// TestAutoscaleModelledColdStart: without cold_start= the autoscaled
// fleet's start-up is the engine profile's start-up model for the spec's
// source (a cold node: remote, image pulled; a warm one: page cache, image
// cached), each started engine is ready that long after its start, and
// the report names the source and phases; cold_start= overrides it.
func TestAutoscaleModelledColdStart(t *testing.T) {
	run := func(spec string) (Result, *Autoscale) {
		t.Helper()
		a, err := ParseAutoscale(spec)
		if err != nil {
			t.Fatal(err)
		}
		opts := Options{Records: waveTrace(), Engines: []int{2}, Policies: []string{sched.LeastRequest},
			SLO: mustSLO(t, "ttft_p90=5s"), Workers: 2, NoReferences: true, Autoscale: a}
		res, err := Run(context.Background(), opts)
		if err != nil {
			t.Fatal(err)
		}
		if a.Phases != nil {
			t.Fatal("Run wrote the caller's Autoscale")
		}
		return res, a
	}
	prof := (&Options{}).Engine.WithDefaults().Profile
	for _, tc := range []struct {
		spec string
		in   sim.StartupInput
		text string
	}{
		{"min=1,max=4,target=2,down_window=1m,interval=5s,startup=remote,image_cached=false",
			sim.StartupInput{Source: sim.SourceRemote}, "weights from remote, image pulled"},
		{"min=1,max=4,target=2,down_window=1m,interval=5s", DefaultStartup, "weights from page_cache, image cached"},
	} {
		res, _ := run(tc.spec)
		want, err := prof.StartupPhases(tc.in)
		if err != nil {
			t.Fatal(err)
		}
		s := res.Rows[res.Autoscale[0].Row].Scale
		if s.ColdStartS != want.Total().Seconds() || s.Startup != string(tc.in.Source) || s.ImageCached != tc.in.ImageCached ||
			s.ImagePullS != want.ImagePull.Seconds() || s.WeightsS != want.WeightsLoad.Seconds() || s.WarmUpS != want.WarmUp.Seconds() {
			t.Errorf("%s: scale row %+v, want phases %+v", tc.spec, s, want)
		}
		for _, st := range s.Starts {
			if st.Ready != st.At+want.Total() && !st.Cancelled {
				t.Errorf("%s: engine %d started at %v, ready at %v: want +%v", tc.spec, st.Engine, st.At, st.Ready, want.Total())
			}
		}
		var buf bytes.Buffer
		if err := res.WriteTable(&buf); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(buf.String(), tc.text) || !strings.Contains(buf.String(), "modelled") {
			t.Errorf("%s: the table does not say %q:\n%s", tc.spec, tc.text, buf.String())
		}
	}
	// cache=cold: every start reads through its node's artifact cache; the
	// first start on each node (one engine per node here, no peers) reads
	// from the origin, a restart on a node from its page cache.
	res, _ := run("min=1,max=4,target=2,down_window=1m,interval=5s,cache=cold,image_cached=false")
	s := res.Rows[res.Autoscale[0].Row].Scale
	remote, _ := prof.StartupPhases(sim.StartupInput{Source: sim.SourceRemote})
	if s.Cache != "cold" || s.Startup != string(sim.SourceRemote) || s.ColdStartS != remote.Total().Seconds() ||
		s.StartsBySource[string(sim.SourceRemote)] == 0 {
		t.Errorf("cache=cold: %+v", s)
	}
	var buf bytes.Buffer
	if err := res.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), "through node caches, cold at start") || !strings.Contains(buf.String(), "starts by source: remote") {
		t.Errorf("cache=cold: the table does not say so:\n%s", buf.String())
	}
	// cold_start= overrides the model and says so.
	res, _ = run("min=1,max=4,target=2,down_window=1m,interval=5s,cold_start=20s")
	if s := res.Rows[res.Autoscale[0].Row].Scale; s.ColdStartS != 20 || s.Startup != "" {
		t.Errorf("cold_start=20s: %+v", s)
	}
}
