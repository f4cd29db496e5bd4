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
		a.Initial != 2 || a.Policy.ColdStart != DefaultColdStart {
		t.Fatalf("%+v", a)
	}
	if a, _ := ParseAutoscale("min=1,max=2,initial=0,cold_start=10s"); a.Initial != -1 || a.ColdStartOrPolicy() != 10*time.Second {
		t.Fatalf("initial=0: %+v", a)
	}
	for spec, want := range map[string]string{
		"max=4,interval=x":   "interval=x",
		"max=4,initial=9":    "initial=9",
		"max=4,bogus=1":      "unknown key",
		"min=1":              "max is required",
		"max=4,hold_ttl=-1s": "hold_ttl",
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
