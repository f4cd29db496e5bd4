package sim

import (
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

func TestProfilesValid(t *testing.T) {
	ps := Profiles()
	if _, ok := ps[DefaultProfileName]; !ok {
		t.Fatal("default profile missing from Profiles()")
	}
	for name, p := range ps {
		if p.Name != name {
			t.Errorf("profile %q named %q", name, p.Name)
		}
		if err := p.Validate(); err != nil {
			t.Error(err)
		}
		t.Logf("%s: %.0f B/token KV, %d blocks of 16 (%d tokens)", name, p.KVBytesPerToken(), p.NumBlocks(16), p.NumBlocks(16)*16)
	}
}

func TestKVSizing(t *testing.T) {
	p := DefaultProfile()
	if got := p.KVBytesPerToken(); got != 327680 {
		t.Fatalf("70B KV bytes/token = %v, want 327680 (2×80×8×128×2)", got)
	}
	// (4×80GiB×0.9 − 141.2e9 − 0.05×4×80GiB) / (327680×16)
	if got := p.NumBlocks(16); got < 28000 || got > 29500 {
		t.Fatalf("70B TP4 KV blocks = %d, want ≈28.8k", got)
	}
	if got := Llama8BH100().KVBytesPerToken(); got != 131072 {
		t.Fatalf("8B KV bytes/token = %v, want 131072", got)
	}
	bad := p
	bad.TensorParallel = 1 // 141 GB of weights on one 80 GB GPU
	if bad.NumBlocks(16) != 0 {
		t.Fatal("a model that does not fit must have 0 blocks")
	}
	if (Config{Profile: bad}).Validate() == nil {
		t.Fatal("Validate must reject a model that does not fit")
	}
}

func TestLatencyTargets(t *testing.T) {
	p := DefaultProfile()
	prefill := p.PrefillTime(8192, 0)
	if prefill < 900*time.Millisecond || prefill > 1300*time.Millisecond {
		t.Errorf("70B TP4 8k prefill = %v, want 0.9–1.3 s", prefill)
	}
	itl := p.DecodeTime(16, 8192)
	if itl < 20*time.Millisecond || itl > 30*time.Millisecond {
		t.Errorf("70B TP4 decode batch 16 @8k = %v, want 20–30 ms", itl)
	}
	t.Logf("70B TP4: prefill 8k %v, decode b16@8k %v, decode b1@1k %v", prefill, itl, p.DecodeTime(1, 1024))
	q := Llama8BH100()
	t.Logf("8B H100: prefill 8k %v, decode b16@8k %v, decode b1@1k %v", q.PrefillTime(8192, 0), q.DecodeTime(16, 8192), q.DecodeTime(1, 1024))
}

func TestLatencyMonotonic(t *testing.T) {
	for _, p := range Profiles() {
		prev := time.Duration(0)
		for _, n := range []int{1, 16, 256, 1024, 4096, 8192} {
			d := p.PrefillTime(n, 0)
			if d <= prev && n > 256 { // small prefills are weight-bound and equal
				t.Errorf("%s: prefill %d tokens %v not longer than %v", p.Name, n, d, prev)
			}
			if d < prev {
				t.Errorf("%s: prefill time decreased at %d tokens", p.Name, n)
			}
			prev = d
		}
		// A cached prefix makes the same prompt cheaper to prefill.
		if full, hit := p.PrefillTime(8192, 0), p.PrefillTime(1024, 7168); hit >= full {
			t.Errorf("%s: prefix-hit prefill %v not faster than cold %v", p.Name, hit, full)
		}
		prev = 0
		for _, b := range []int{1, 8, 16, 64, 256} {
			d := p.DecodeTime(b, 4096)
			if d <= prev {
				t.Errorf("%s: decode batch %d %v not longer than %v", p.Name, b, d, prev)
			}
			prev = d
		}
		if p.DecodeTime(16, 16384) <= p.DecodeTime(16, 1024) {
			t.Errorf("%s: longer context must slow decode", p.Name)
		}
	}
	if (Profile{}).StepTime(StepCost{}) != 0 {
		t.Error("empty step must take no time")
	}
}

func TestEngineStepUsesLatencyModel(t *testing.T) {
	e := NewEngine(Config{})
	must(t, e.Add(&Request{ID: "a", Tokens: seqTokens(1, 8192), MaxTokens: 2}, 0))
	r := e.Step(0)
	if want := DefaultProfile().PrefillTime(8192, 0); r.Duration != want || len(r.Outputs) != 1 {
		t.Fatalf("8k prefill step %v with %d outputs, want %v and 1", r.Duration, len(r.Outputs), want)
	}
	if r := e.Step(0); r.Duration != DefaultProfile().DecodeTime(1, 8192) {
		t.Fatalf("decode step %v, want %v", r.Duration, DefaultProfile().DecodeTime(1, 8192))
	}
}

func TestProfileYAML(t *testing.T) {
	src := `
name: custom
layers: 32
hidden_size: 4096
num_key_value_heads: 8
head_dim: 128
params: 8.03e9
bytes_per_param: 2
tensor_parallel: 1
gpu_flops: 989e12
gpu_bandwidth: 3.35e12
gpu_memory: 85899345920
gpu_memory_utilization: 0.9
activation_reserve: 0.05
prefill_mfu: 0.45
decode_bandwidth_efficiency: 0.7
step_overhead: 2ms
`
	var p Profile
	if err := yaml.Unmarshal([]byte(src), &p); err != nil {
		t.Fatal(err)
	}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	want := Llama8BH100()
	if p.StepOverhead != 2*time.Millisecond || p.NumBlocks(16) != want.NumBlocks(16) {
		t.Fatalf("decoded %+v", p)
	}
}
