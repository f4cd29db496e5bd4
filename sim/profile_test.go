package sim

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
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
	if (GPUProfile{}).StepTime(StepCost{}) != 0 {
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

const customYAML = `
name: custom
model: meta-llama/Llama-3.1-8B-Instruct
layers: 32
hidden_size: 4096
num_attention_heads: 32
num_key_value_heads: 8
head_dim: 128
intermediate_size: 14336
vocab_size: 128256
params: 8.03e9
bytes_per_param: 2
tensor_parallel: 1
gpu_flops: 989e12
gpu_bandwidth: 3.35e12
gpu_memory: 85899345920
gpu_memory_utilization: 0.9
activation_reserve: 0.05
prefill_mfu: 0.317
decode_bandwidth_efficiency: 0.727
step_overhead: 1ms
`

func TestProfileYAML(t *testing.T) {
	p, err := ParseProfile([]byte(customYAML))
	if err != nil {
		t.Fatal(err)
	}
	want := Llama8BH100()
	if p.StepOverhead != time.Millisecond || p.NumBlocks(16) != want.NumBlocks(16) {
		t.Fatalf("decoded %+v", p)
	}
	if p.PrefillTime(8192, 0) != want.PrefillTime(8192, 0) || p.DecodeTime(16, 8192) != want.DecodeTime(16, 8192) {
		t.Fatal("a copy of the built-in 8B profile must time steps identically")
	}

	f := filepath.Join(t.TempDir(), "custom.yaml")
	if err := os.WriteFile(f, []byte(customYAML), 0o644); err != nil {
		t.Fatal(err)
	}
	if q, err := LoadProfile(f); err != nil || q != p {
		t.Fatalf("LoadProfile: %+v, %v", q, err)
	}
	if _, err := LoadProfile(filepath.Join(t.TempDir(), "missing.yaml")); err == nil {
		t.Fatal("LoadProfile of a missing file succeeded")
	}
	// The raw yaml.v3 decoding other code may do still works.
	var r GPUProfile
	if err := yaml.Unmarshal([]byte(customYAML), &r); err != nil || r != p {
		t.Fatalf("yaml.Unmarshal: %+v, %v", r, err)
	}
}

func TestProfileValidationErrors(t *testing.T) {
	cases := []struct {
		edit func(string) string
		want string
	}{
		{func(s string) string { return strings.Replace(s, "layers: 32", "layrs: 32", 1) }, "field layrs not found"},
		{func(s string) string { return strings.Replace(s, "hidden_size: 4096", "hidden_size: 0", 1) }, "hidden_size must be > 0"},
		{func(s string) string {
			return strings.Replace(s, "intermediate_size: 14336", "intermediate_size: 13336", 1)
		}, "params 8.03e+09 disagrees with the architecture"},
		{func(s string) string {
			return strings.Replace(s, "num_key_value_heads: 8", "num_key_value_heads: 5", 1)
		}, "multiple of num_key_value_heads"},
		{func(s string) string { return strings.Replace(s, "prefill_mfu: 0.317", "prefill_mfu: 1.5", 1) }, "prefill_mfu must be <= 1"},
		{func(s string) string {
			return strings.Replace(s, "gpu_memory_utilization: 0.9", "gpu_memory_utilization: 0", 1)
		}, "gpu_memory_utilization must be in (0,1]"},
		{func(s string) string { return strings.Replace(s, "step_overhead: 1ms", "step_overhead: -1ms", 1) }, "step_overhead must not be negative"},
		{func(s string) string { return strings.Replace(s, "step_overhead: 1ms", "step_overhead: soon", 1) }, "decode profile"},
		{func(s string) string { return strings.Replace(s, "name: custom\n", "", 1) }, "name must be set"},
	}
	for _, c := range cases {
		_, err := ParseProfile([]byte(c.edit(customYAML)))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("want error containing %q, got %v", c.want, err)
		}
	}
}

// TestDerivedQuantities pins the architecture-derived numbers the docstrings quote.
func TestDerivedQuantities(t *testing.T) {
	ps := Profiles()
	for _, c := range []struct {
		name               string
		layer, arch        float64 // LayerMatmulParams, ArchParams
		kvPerToken         float64
		blocksLo, blocksHi int
	}{
		{"llama-3.1-8b-h100", 218.1e6, 8.030e9, 131072, 27000, 27300},
		{"llama-3.1-70b-4xh100", 855.6e6, 70.55e9, 327680, 28700, 28850},
		{"llama-3.1-70b-8xh200", 855.6e6, 70.55e9, 327680, 150000, 170000},
		{"qwen3-32b-2xh100", 487.6e6, 32.76e9, 262144, 19000, 19300},
	} {
		p := ps[c.name]
		if math.Abs(p.LayerMatmulParams()-c.layer) > 0.001*c.layer || math.Abs(p.ArchParams()-c.arch) > 0.001*c.arch {
			t.Errorf("%s: layer %.4g arch %.4g params, want %.4g %.4g", c.name, p.LayerMatmulParams(), p.ArchParams(), c.layer, c.arch)
		}
		if p.KVBytesPerToken() != c.kvPerToken {
			t.Errorf("%s: KV %v B/token, want %v", c.name, p.KVBytesPerToken(), c.kvPerToken)
		}
		if b := p.NumBlocks(16); b < c.blocksLo || b > c.blocksHi {
			t.Errorf("%s: %d blocks of 16, want %d–%d", c.name, b, c.blocksLo, c.blocksHi)
		}
		if p.NumBlocksAt(0.95, 16) <= p.NumBlocks(16) || p.NumBlocksAt(p.GPUMemoryUtilization, 16) != p.NumBlocks(16) {
			t.Errorf("%s: NumBlocksAt does not follow gpu_memory_utilization", c.name)
		}
	}
}

// TestAttentionUsesQDim checks the attention term scales with num_heads ×
// head_dim, not hidden_size: Qwen3-32B attends over 8192 dims with a 5120 model.
func TestAttentionUsesQDim(t *testing.T) {
	q := Profiles()["qwen3-32b-2xh100"]
	var a, b StepCost
	a.Add(1024, 0)
	b.Add(1024, 4096)
	extra := q.FLOPs(b) - q.FLOPs(a) // only the attention term differs
	want := 4 * float64(q.Layers) * 64 * 128 * (1024 * 4096)
	if math.Abs(extra-want) > 1e-6*want {
		t.Fatalf("attention FLOPs for 1024×4096 extra pairs = %.4g, want %.4g (4·L·heads·head_dim·pairs)", extra, want)
	}
	// No embedding lookup in the FLOPs; the LM head counts once per sequence.
	var c StepCost
	c.Add(1, 0)
	lin := 2*float64(q.Layers)*q.LayerMatmulParams() + 2*q.EmbeddingParams() + 4*float64(q.Layers)*8192
	if f := q.FLOPs(c); math.Abs(f-lin) > 1e-9*lin {
		t.Fatalf("one-token FLOPs %.6g, want %.6g", f, lin)
	}
}

func TestProfileNamesMatchFiles(t *testing.T) {
	names := ProfileNames()
	for _, want := range []string{"llama-3.1-8b-h100", "llama-3.1-70b-4xh100", "llama-3.1-70b-8xh200", "qwen3-32b-2xh100"} {
		if !slices.Contains(names, want) {
			t.Errorf("profile %q missing from %v", want, names)
		}
	}
	if !slices.IsSorted(names) {
		t.Errorf("ProfileNames not sorted: %v", names)
	}
	ps := Profiles()
	delete(ps, DefaultProfileName)
	if _, ok := Profiles()[DefaultProfileName]; !ok {
		t.Fatal("Profiles() must return a fresh map")
	}
}

// TestProfileTable checks the profile table of sim/CALIBRATION.md
// ("Profiles") against the profiles: every built-in profile has a row, and
// its tensor parallelism, KV blocks of 16 tokens, cold 8k-token prefill and
// decode steps (batch 16 at 8k context, batch 1 at 1k) are what the model
// computes, written as the table writes them. Run with -v to print the rows.
func TestProfileTable(t *testing.T) {
	doc, err := os.ReadFile("CALIBRATION.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string][]string{}
	for line := range strings.SplitSeq(string(doc), "\n") {
		cells := strings.Split(strings.Trim(line, "| "), " | ")
		if len(cells) == 6 && strings.HasPrefix(cells[0], "`") {
			name, _, _ := strings.Cut(strings.TrimPrefix(cells[0], "`"), "`")
			rows[name] = cells[1:]
		}
	}
	thousands := func(n int) string {
		s := strconv.Itoa(n)
		for i := len(s) - 3; i > 0; i -= 3 {
			s = s[:i] + "," + s[i:]
		}
		return s
	}
	prefill := func(d time.Duration) string {
		if d < time.Second {
			return fmt.Sprintf("%d ms", d.Round(time.Millisecond).Milliseconds())
		}
		return fmt.Sprintf("%.3f s", d.Seconds())
	}
	decode := func(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond)) }
	for _, name := range ProfileNames() {
		p := Profiles()[name]
		want := []string{strconv.Itoa(p.TensorParallel), thousands(p.NumBlocks(16)), prefill(p.PrefillTime(8192, 0)),
			decode(p.DecodeTime(16, 8192)), decode(p.DecodeTime(1, 1024))}
		t.Logf("| `%s` | %s |", name, strings.Join(want, " | "))
		got, ok := rows[name]
		if !ok {
			if slices.Contains(tableExempt, name) {
				continue
			}
			t.Errorf("CALIBRATION.md has no row for profile %s", name)
			continue
		}
		if !slices.Equal(got, want) {
			t.Errorf("CALIBRATION.md row of %s: %q, the profile gives %q", name, got, want)
		}
	}
}

// tableExempt are built-in profiles the CALIBRATION.md table leaves out:
// fitted to a machine, not to published measurements (see their YAML).
var tableExempt = []string{"tiny-llama-cpu-ollama"}

// A profile file's tokenizer is resolved against the file's folder.
func TestLoadProfileTokenizerPath(t *testing.T) {
	raw, err := os.ReadFile("profiles/llama-3.1-8b-h100.yaml")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, tc := range []struct{ key, want string }{{"tok/llama3", filepath.Join(dir, "tok/llama3")}, {"/models/x", "/models/x"}} {
		f := filepath.Join(dir, "p.yaml")
		if err := os.WriteFile(f, append(raw, []byte("\ntokenizer: "+tc.key+"\n")...), 0o644); err != nil {
			t.Fatal(err)
		}
		p, err := LoadProfile(f)
		if err != nil || p.Tokenizer != tc.want {
			t.Errorf("tokenizer %q: %q, %v; want %q", tc.key, p.Tokenizer, err, tc.want)
		}
	}
}
