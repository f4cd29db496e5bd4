package trace

import (
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
)

const azurePath = "../data/azure_llm2023_conv.csv"

func TestReadAzure(t *testing.T) {
	for _, tc := range []struct {
		name, in string
	}{
		{"azure format", "TIMESTAMP,ContextTokens,GeneratedTokens\n" +
			"2023-11-16 18:15:46.6805900,374,44\n" +
			"\n" +
			"2023-11-16 18:15:50.9951690,1025,0\n" +
			"2023-11-16 18:16:46.6805900,1,109\n"},
		{"bom, reordered, crlf, zones", "\ufeffGeneratedTokens,contexttokens,Timestamp,extra\r\n" +
			"44,374,2023-11-16T18:15:46.68059Z,x\r\n" +
			"0,1025,2023-11-16 19:15:50.995169+01:00,y\r\n" +
			"109,1,2023-11-16 18:16:46.68059,z\r\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			recs, err := ReadAzure(strings.NewReader(tc.in), PrefixModel{})
			if err != nil {
				t.Fatal(err)
			}
			want := []Record{
				{Timestamp: 0, InputLength: 374, OutputLength: 44},
				{Timestamp: 4314579 * time.Microsecond, InputLength: 1025, OutputLength: 0},
				{Timestamp: time.Minute, InputLength: 1, OutputLength: 109},
			}
			if len(recs) != len(want) {
				t.Fatalf("%d records, want %d", len(recs), len(want))
			}
			for i, w := range want {
				g := recs[i]
				if g.Timestamp != w.Timestamp || g.InputLength != w.InputLength || g.OutputLength != w.OutputLength {
					t.Errorf("record %d = %v %d %d, want %v %d %d", i, g.Timestamp, g.InputLength, g.OutputLength, w.Timestamp, w.InputLength, w.OutputLength)
				}
				if len(g.HashIDs) != (w.InputLength+511)/512 {
					t.Errorf("record %d: %d hash ids for %d tokens", i, len(g.HashIDs), w.InputLength)
				}
			}
			if InfiniteCacheBlockHitRate(recs) != 0 {
				t.Error("the zero PrefixModel shares blocks")
			}
		})
	}
}

func TestReadAzureErrors(t *testing.T) {
	const h = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
	const ok = "2023-11-16 18:15:46.6805900,374,44\n"
	for _, tc := range []struct {
		name, in string
		m        PrefixModel
		want     string
	}{
		{"empty", "", PrefixModel{}, "line 1: empty file"},
		{"header", "time,ContextTokens,GeneratedTokens\n" + ok, PrefixModel{}, "line 1: header"},
		{"bad time", h + ok + "yesterday,1,1\n", PrefixModel{}, `line 3: TIMESTAMP "yesterday"`},
		{"unsorted", h + ok + ok + "2023-11-16 18:15:46.6,374,44\n", PrefixModel{}, "line 4: timestamp"},
		{"fields", h + ok + "2023-11-16 18:15:47,1\n", PrefixModel{}, "line 3"},
		{"context int", h + "2023-11-16 18:15:47,x,1\n", PrefixModel{}, "line 2: ContextTokens"},
		{"generated int", h + "2023-11-16 18:15:47,1,1.5\n", PrefixModel{}, "line 2: GeneratedTokens"},
		{"zero context", h + ok + "\n" + "2023-11-16 18:15:47,0,1\n", PrefixModel{}, "line 4: ContextTokens 0"},
		{"huge context", h + "2023-11-16 18:15:47,99999999,1\n", PrefixModel{}, "ContextTokens 99999999"},
		{"negative generated", h + "2023-11-16 18:15:47,1,-1\n", PrefixModel{}, "line 2: GeneratedTokens -1"},
		{"model prob", h + ok, PrefixModel{SessionProb: 1.5, SessionWindow: 1}, "session probability 1.5"},
		{"model nan", h + ok, PrefixModel{SessionProb: math.NaN(), SessionWindow: 1}, "session probability NaN"},
		{"model window", h + ok, PrefixModel{SessionProb: 0.5}, "session window 0"},
		{"model system", h + ok, PrefixModel{SystemPromptTokens: -1}, "system prompt tokens -1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadAzure(strings.NewReader(tc.in), tc.m)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestPrefixModel(t *testing.T) {
	lengths := []int{100, 1500, 700, 2048, 3000, 1024, 512, 5000}
	mk := func() []Record {
		recs := make([]Record, len(lengths))
		for i, n := range lengths {
			recs[i] = Record{Timestamp: time.Duration(i) * time.Second, InputLength: n, OutputLength: 1}
		}
		return recs
	}
	for _, tc := range []struct {
		name string
		m    PrefixModel
		// want(i, j) is the number of leading blocks records i < j share.
		want func(i, j int) int
	}{
		{"zero: nothing shared", PrefixModel{}, func(i, j int) int { return 0 }},
		{"system prompt 1024", PrefixModel{SystemPromptTokens: 1024, Seed: 5}, func(i, j int) int {
			// Block b is shared when both have it: records shorter than the
			// system prompt have its first ⌈in/512⌉ blocks, cut.
			return min(2, (lengths[i]+511)/512, (lengths[j]+511)/512)
		}},
		{"straddling system prompt 1000", PrefixModel{SystemPromptTokens: 1000, Seed: 5}, func(i, j int) int { return 1 }},
		{"every request continues the previous", PrefixModel{SessionProb: 1, SessionWindow: 1, Seed: 5}, func(i, j int) int {
			// Chain: i shares with i+1 their whole common blocks, and the
			// share along the chain is the minimum over the links.
			n := math.MaxInt
			for k := i; k <= j; k++ {
				n = min(n, lengths[k]/512)
			}
			return n
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			recs := mk()
			if err := tc.m.Apply(recs); err != nil {
				t.Fatal(err)
			}
			toks := make([][]uint32, len(recs))
			for i, r := range recs {
				if len(r.HashIDs) != (r.InputLength+511)/512 {
					t.Fatalf("record %d: %d ids for %d tokens", i, len(r.HashIDs), r.InputLength)
				}
				for _, id := range r.HashIDs {
					if id < AzureIDBase || id >= AzureIDBase+1<<40 {
						t.Fatalf("record %d: id %d outside the Azure range", i, id)
					}
				}
				toks[i] = r.Tokens(nil)
			}
			for i := range recs {
				for j := i + 1; j < len(recs); j++ {
					want := tc.want(i, j)
					if got := commonBlocks(recs[i].HashIDs, recs[j].HashIDs); got != want {
						t.Errorf("records %d, %d share %d leading blocks, want %d", i, j, got, want)
					}
					// Equal ids must mean equal tokens, as far as both go.
					wantTok := min(want*512, lengths[i], lengths[j])
					if got := commonTokens(toks[i], toks[j]); got < wantTok {
						t.Errorf("records %d, %d share %d leading tokens, want at least %d", i, j, got, wantTok)
					}
				}
			}
		})
	}
}

func TestPrefixModelApplyErrors(t *testing.T) {
	if err := (PrefixModel{}).Apply([]Record{{InputLength: 0}}); err == nil || !strings.Contains(err.Error(), "record 0: input length 0") {
		t.Fatalf("error %v", err)
	}
}

func TestLoadAzure(t *testing.T) {
	plain, err := LoadAzure(azurePath, DefaultPrefixModel())
	if err != nil {
		t.Fatal(err)
	}
	if len(plain) != 19366 {
		t.Fatalf("%d records, want 19366", len(plain))
	}
	var in, out int
	for _, r := range plain {
		in += r.InputLength
		out += r.OutputLength
	}
	// Sums and span measured independently (Python) on the same file.
	if in != 22361870 || out != 4088665 {
		t.Errorf("token sums %d in, %d out; want 22361870, 4088665", in, out)
	}
	if last := plain[len(plain)-1].Timestamp; last != 3501721937*time.Microsecond {
		t.Errorf("last arrival %v, want 58m21.721937s", last)
	}
	if got := InfiniteCacheHitRate(plain); got != 0 {
		t.Errorf("default model hit ceiling %v, want 0", got)
	}

	m := PrefixModel{SystemPromptTokens: 512, SessionProb: 0.3, SessionWindow: 64, Seed: 7}
	a, err := LoadAzure(azurePath, m)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := LoadAzure(azurePath, m)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same model gave different traces")
	}
	hit := InfiniteCacheHitRate(a)
	t.Logf("hit ceiling with %+v: %.3f", m, hit)
	if hit <= 0.1 || hit >= 0.9 {
		t.Errorf("hit ceiling %v: want a moderate value", hit)
	}
	m.Seed++
	c, _ := LoadAzure(azurePath, m)
	if reflect.DeepEqual(a, c) {
		t.Fatal("another seed gave the same trace")
	}
}
