package sim

import (
	"errors"
	"slices"
	"testing"
	"time"
)

func loraEngine(t *testing.T, lc LoRAConfig) *Engine {
	t.Helper()
	cfg := Config{Profile: Llama8BH100(), NumBlocks: 4096, LoRA: lc}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	return NewEngine(cfg)
}

func TestLoRAConfig(t *testing.T) {
	c := LoRAConfig{Adapters: []string{"a", "b"}}.WithDefaults()
	if c.MaxLoras != 1 || c.MaxCPULoras != 1 || c.LoadLatency != DefaultLoRALoadLatency {
		t.Fatalf("defaults %+v", c)
	}
	if c.AdapterID("a") != 1 || c.AdapterID("b") != 2 || c.AdapterID("z") != 0 || c.AdapterID("") != 0 {
		t.Fatal("adapter ids must be 1-based positions, 0 for unknown or base")
	}
	if (LoRAConfig{}).Enabled() || (LoRAConfig{}).Validate() != nil {
		t.Fatal("zero config must be valid and disabled")
	}
	for _, bad := range []LoRAConfig{
		{Adapters: []string{"a", "a"}},
		{Adapters: []string{""}},
		{Adapters: []string{"a"}, MaxLoras: -1},
		{MaxLoras: 2},
	} {
		if bad.Validate() == nil {
			t.Errorf("%+v validated", bad)
		}
	}
	if RootHash("", 42) != 42 || RootHash("a", 0) == RootHash("b", 0) || RootHash("a", 0) == RootHash("a", 1) || RootHash("a", 0) == 0 {
		t.Fatal("RootHash must be the identity for the base model and separate adapters and salts")
	}
}

func TestLoRAUnknownAdapter(t *testing.T) {
	e := loraEngine(t, LoRAConfig{Adapters: []string{"a"}})
	if err := e.Add(&Request{ID: "x", Tokens: seqTokens(1, 8), MaxTokens: 1, LoRA: "b"}, 0); !errors.Is(err, ErrUnknownLoRA) {
		t.Fatalf("unknown adapter: %v", err)
	}
	off := loraEngine(t, LoRAConfig{})
	if err := off.Add(&Request{ID: "x", Tokens: seqTokens(1, 8), MaxTokens: 1, LoRA: "a"}, 0); !errors.Is(err, ErrUnknownLoRA) {
		t.Fatalf("adapter with LoRA disabled: %v", err)
	}
}

// The adapter is part of block identity: the same prompt under another
// adapter or the base model does not hit, under the same adapter it does.
func TestLoRAPrefixIsolation(t *testing.T) {
	e := loraEngine(t, LoRAConfig{Adapters: []string{"a", "b"}, MaxLoras: 2})
	prompt := seqTokens(5000, 64)
	now := time.Duration(0)
	serve := func(id, lora string) int {
		t.Helper()
		must(t, e.Add(&Request{ID: id, Tokens: prompt, MaxTokens: 2, LoRA: lora}, now))
		var outs map[string][]Output
		now, outs = run(t, e, now)
		return outs[id][0].CachedTokens
	}
	if got := serve("a1", "a"); got != 0 {
		t.Fatalf("cold: %d cached", got)
	}
	if got := serve("b1", "b"); got != 0 {
		t.Fatalf("other adapter hit %d tokens", got)
	}
	if got := serve("base", ""); got != 0 {
		t.Fatalf("base model hit %d tokens of adapter blocks", got)
	}
	if got := serve("a2", "a"); got != 48 {
		t.Fatalf("same adapter: %d cached, want 48", got)
	}
	if got := serve("b2", "b"); got != 48 {
		t.Fatalf("same adapter b: %d cached, want 48", got)
	}
}

// MaxLoras=1 with two adapters interleaved: never two adapters in the running
// batch, base-model requests pass deferred ones, everything finishes.
func TestLoRAMaxLorasInterleaved(t *testing.T) {
	e := loraEngine(t, LoRAConfig{Adapters: []string{"a", "b"}, MaxLoras: 1, MaxCPULoras: 2})
	order := []struct{ id, lora string }{{"a1", "a"}, {"b1", "b"}, {"c1", ""}, {"a2", "a"}, {"b2", "b"}, {"a3", "a"}, {"b3", "b"}}
	for i, r := range order {
		must(t, e.Add(&Request{ID: r.id, Tokens: seqTokens(100*i, 40), MaxTokens: 4, LoRA: r.lora}, 0))
	}
	done := map[string]bool{}
	var now time.Duration
	for step := 0; e.HasWork(); step++ {
		if step > 10000 {
			t.Fatal("did not drain")
		}
		res := e.Step(now)
		now += res.Duration
		adapters := map[string]bool{}
		for _, s := range e.running {
			if s.lora != "" {
				adapters[s.lora] = true
			}
		}
		for _, o := range res.Outputs {
			if o.Finished {
				done[o.ID] = true
			}
			if s := e.byID[o.ID]; s != nil && s.lora != "" {
				adapters[s.lora] = true
			}
		}
		if len(adapters) > 1 {
			t.Fatalf("step %d runs adapters %v", step, adapters)
		}
		if step == 0 {
			var ids []string
			for _, s := range e.running {
				ids = append(ids, s.id)
			}
			if want := []string{"a1", "c1", "a2", "a3"}; !slices.Equal(ids, want) {
				t.Fatalf("first step runs %v, want %v (b requests deferred, later ones pass them)", ids, want)
			}
			st := e.Stats()
			if st.Waiting != 3 || st.WaitingDeferred != 3 || !slices.Equal(st.RunningLoRAs, []string{"a"}) || !slices.Equal(st.WaitingLoRAs, []string{"b"}) {
				t.Fatalf("stats after first step: %+v", st)
			}
		}
		checkEngine(t, e)
	}
	if len(done) != len(order) {
		t.Fatalf("finished %v, want all %d", done, len(order))
	}
	if st := e.Stats(); st.LoRALoads != 2 || st.RunningLoRAs != nil || st.WaitingDeferred != 0 {
		t.Fatalf("final stats %+v", st)
	}
}

// Loading a non-resident adapter adds LoadLatency once to the step that
// admits it; resident adapters cost nothing; the LRU holds MaxCPULoras.
func TestLoRALoadLatency(t *testing.T) {
	const lat = 50 * time.Millisecond
	e := loraEngine(t, LoRAConfig{Adapters: []string{"a", "b"}, MaxLoras: 1, MaxCPULoras: 1, LoadLatency: lat})
	prof := e.Config().Profile
	var now time.Duration
	id := 0
	serve := func(lora string, n int) (loads []int) {
		t.Helper()
		for range n {
			id++
			must(t, e.Add(&Request{ID: string(rune('A' + id)), Tokens: seqTokens(1000*id, 32), MaxTokens: 3, LoRA: lora}, now))
		}
		for e.HasWork() {
			res := e.Step(now)
			if want := prof.StepTime(res.Cost) + time.Duration(res.LoRALoads)*lat; res.Duration != want {
				t.Fatalf("step %v, want %v (%d loads)", res.Duration, want, res.LoRALoads)
			}
			now += res.Duration
			loads = append(loads, res.LoRALoads)
		}
		return loads
	}
	if l := serve("a", 2); l[0] != 1 || slices.Max(l[1:]) != 0 {
		t.Fatalf("two requests of a cold adapter: loads per step %v, want one load in the first step", l)
	}
	if l := serve("a", 1); slices.Max(l) != 0 {
		t.Fatalf("resident adapter loaded again: %v", l)
	}
	if l := serve("", 1); slices.Max(l) != 0 {
		t.Fatalf("base model loaded an adapter: %v", l)
	}
	serve("b", 1) // evicts a (MaxCPULoras 1)
	if l := serve("a", 1); l[0] != 1 {
		t.Fatalf("evicted adapter not reloaded: %v", l)
	}
	if got := e.Stats().LoRALoads; got != 3 {
		t.Fatalf("%d loads, want 3", got)
	}

	// With room for both, switching back and forth loads each once.
	e = loraEngine(t, LoRAConfig{Adapters: []string{"a", "b"}, MaxLoras: 1, MaxCPULoras: 2, LoadLatency: lat})
	for _, l := range []string{"a", "b", "a", "b"} {
		serve(l, 1)
	}
	if got := e.Stats().LoRALoads; got != 2 {
		t.Fatalf("%d loads with max_cpu_loras 2, want 2", got)
	}
}
