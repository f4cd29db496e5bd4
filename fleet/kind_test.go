package fleet

import (
	"encoding/json"
	"testing"
)

func TestParseKind(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Kind
	}{
		{"vllm", VLLM},
		{"vLLM", VLLM},
		{" SGLang ", SGLang},
		{"llamacpp", LlamaCpp},
		{"llama.cpp", LlamaCpp},
		{"Llama-CPP", LlamaCpp},
		{"llama_cpp", LlamaCpp},
		{"llama-server", LlamaCpp},
		{"ollama", Ollama},
		{"TGI", TGI},
		{"text-generation-inference", TGI},
		{"sim", Sim},
	} {
		got, err := ParseKind(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParseKind(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"", "trtllm", "vllm2", "llama"} {
		if k, err := ParseKind(bad); err == nil {
			t.Errorf("ParseKind(%q) = %q, want an error", bad, k)
		}
	}
}

func TestKindsAreDescribed(t *testing.T) {
	ks := Kinds()
	if len(ks) != 6 {
		t.Fatalf("Kinds() = %v, want 6 kinds", ks)
	}
	ks[0] = "changed" // a copy: the package's list must not change
	if Kinds()[0] != VLLM {
		t.Fatal("Kinds returned the package's own slice")
	}
	for _, k := range Kinds() {
		in := k.Info()
		if !k.Valid() || in.Name == "" || in.HealthPath == "" {
			t.Errorf("%s: incomplete Info %+v", k, in)
		}
		if back, err := ParseKind(k.String()); err != nil || back != k {
			t.Errorf("ParseKind(%q) = %q, %v", k, back, err)
		}
		_, hasSpec := specs[k]
		if (in.MetricsPath != "") != hasSpec {
			t.Errorf("%s: MetricsPath %q but page spec present=%v", k, in.MetricsPath, hasSpec)
		}
		if in.OwnAccounting != (in.Signals == 0) {
			t.Errorf("%s: OwnAccounting %v with signals %b", k, in.OwnAccounting, in.Signals)
		}
	}
	if Kind("trtllm").Valid() || Kind("trtllm").Info().HealthPath != "" {
		t.Error("unknown kind reads as valid")
	}
}

func TestKindInfo(t *testing.T) {
	if in := Ollama.Info(); in.MetricsPath != "" || in.HealthPath != "/api/version" || !in.OwnAccounting || in.CachedTokens != "" {
		t.Errorf("Ollama: %+v", in)
	}
	if m := TGI.Info().Missing(); !m.Has(SignalKVUtil) || m.Has(SignalQueue) {
		t.Errorf("TGI missing %b, want KV util missing and queue present", m)
	}
	if m := VLLM.Info().Missing(); m != 0 {
		t.Errorf("vLLM missing %b, want none", m)
	}
	if Sim.Info().Signals != VLLM.Info().Signals || Sim.Info().MetricsPath != VLLM.Info().MetricsPath {
		t.Error("sim must read like vLLM")
	}
	for _, k := range []Kind{VLLM, SGLang, LlamaCpp, Sim} {
		if k.Info().CachedTokens != "usage.prompt_tokens_details.cached_tokens" {
			t.Errorf("%s: CachedTokens %q", k, k.Info().CachedTokens)
		}
	}
	for _, k := range []Kind{VLLM, SGLang, LlamaCpp, TGI} {
		if k.Info().HealthPath != "/health" || k.Info().MetricsPath != "/metrics" {
			t.Errorf("%s: paths %+v", k, k.Info())
		}
	}
}

func TestKindUnmarshalText(t *testing.T) {
	var cfg struct{ Engine Kind }
	if err := json.Unmarshal([]byte(`{"Engine":"llama.cpp"}`), &cfg); err != nil || cfg.Engine != LlamaCpp {
		t.Fatalf("got %q, %v", cfg.Engine, err)
	}
	if err := json.Unmarshal([]byte(`{"Engine":"nope"}`), &cfg); err == nil {
		t.Fatal("unknown kind accepted")
	}
}
