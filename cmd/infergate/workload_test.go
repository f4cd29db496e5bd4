package main

import (
	"reflect"
	"testing"

	"github.com/spf13/pflag"

	"github.com/infergate/infergate/trace"
)

// TestPlanSeedReseedsWorkloads: plan's --seed offsets the workload
// generators' seeds (0 keeps the defaults): another seed draws other
// requests from the same generator.
func TestPlanSeedReseedsWorkloads(t *testing.T) {
	load := func(kind string, seed uint64) []trace.Record {
		t.Helper()
		var w workloadFlags
		w.register(pflag.NewFlagSet("t", pflag.ContinueOnError))
		w.kind = kind
		w.reseed(seed)
		recs, err := w.load()
		if err != nil {
			t.Fatal(err)
		}
		return recs
	}
	for _, kind := range []string{workloadAzure, workloadSharedPrefix, workloadRAG} {
		a, b, a2 := load(kind, 0), load(kind, 1), load(kind, 0)
		if !reflect.DeepEqual(a, a2) {
			t.Errorf("%s: seed 0 not reproducible", kind)
		}
		if reflect.DeepEqual(a, b) {
			t.Errorf("%s: seeds 0 and 1 drew the same requests", kind)
		}
	}
}
