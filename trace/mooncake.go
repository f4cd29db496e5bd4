// Package trace reads public LLM request traces and turns them into requests a
// benchmark can send.
//
// The Mooncake traces (kvcache-ai/Mooncake, FAST'25) describe each request by
// its arrival time, input and output lengths and one hash id per 512-token
// block of the prompt. Hash ids are chained: an equal id at block position i
// means the whole prompt prefix up to and including block i is equal. Tokens
// synthesizes a prompt from those ids so that prefix sharing in the trace
// becomes real token-prefix sharing on the wire, and InfiniteCacheHitRate gives
// the hit-rate ceiling any cache-aware router is measured against.
package trace

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"time"

	"github.com/infergate/infergate/data"
)

// MooncakeBlockTokens is the number of prompt tokens one Mooncake hash id
// stands for (tokens per block).
const MooncakeBlockTokens = 512

// MaxLineBytes bounds one trace line (4 MiB). The longest line of the public
// Mooncake conversation trace is about 2 KiB; a 4 MiB line would describe a
// prompt of hundreds of millions of tokens, so a longer one is an error rather
// than an unbounded buffer.
const MaxLineBytes = 4 << 20

// Record is one request of a hash-id trace.
type Record struct {
	// Timestamp is the request's arrival time, measured from the start of the
	// trace (the first request's timestamp in the Mooncake traces is 0).
	Timestamp time.Duration
	// InputLength is the prompt length (tokens).
	InputLength int
	// OutputLength is the number of generated tokens (tokens).
	OutputLength int
	// HashIDs holds one id per MooncakeBlockTokens-token prompt block,
	// ceil(InputLength/MooncakeBlockTokens) of them; equal ids at equal
	// positions mean equal prefixes.
	HashIDs []int64
	// TokenIDs, if non-nil, is the literal prompt (InputLength token ids),
	// for workloads built from real text; Tokens returns it instead of
	// synthesizing from HashIDs. HashIDs must then still describe the same
	// prefix sharing (ContentHashIDs derives them from the tokens). Nil for
	// hash-id traces. Treat it as read-only: records may share it.
	TokenIDs []uint32
}

// mooncakeLine is the JSON shape of one trace line. Pointers detect missing
// fields; unknown fields are ignored.
type mooncakeLine struct {
	Timestamp    *float64 `json:"timestamp"` // ms from trace start
	InputLength  *int     `json:"input_length"`
	OutputLength *int     `json:"output_length"`
	HashIDs      []int64  `json:"hash_ids"`
}

// ReadMooncake reads a Mooncake hash-id trace: one JSON object per line with
// "timestamp" (milliseconds from trace start), "input_length" and
// "output_length" (tokens) and "hash_ids". Blank lines are skipped; unknown
// fields are ignored. It reads line by line (each at most MaxLineBytes) and
// rejects, naming the 1-based line number, malformed JSON, missing fields,
// negative or non-finite timestamps, timestamps out of order, input_length < 1,
// output_length < 0, negative hash ids, and a hash_ids count other than
// ceil(input_length/512).
func ReadMooncake(r io.Reader) ([]Record, error) {
	var recs []Record
	err := readLines(r, "mooncake trace", func(line int, b []byte) error {
		rec, err := parseMooncakeLine(b)
		if err != nil {
			return err
		}
		if n := len(recs); n > 0 && rec.Timestamp < recs[n-1].Timestamp {
			return fmt.Errorf("timestamp %v is before the previous request's %v (trace must be sorted)",
				rec.Timestamp, recs[n-1].Timestamp)
		}
		recs = append(recs, rec)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return recs, nil
}

// readLines calls fn with each non-blank line of r (trimmed, valid until fn
// returns) and its 1-based number, reading lines of at most MaxLineBytes. An
// error from fn or the reader is returned prefixed with what and the line.
func readLines(r io.Reader, what string, fn func(line int, b []byte) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), MaxLineBytes)
	line := 0
	for sc.Scan() {
		line++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		if err := fn(line, b); err != nil {
			return fmt.Errorf("%s line %d: %w", what, line, err)
		}
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return fmt.Errorf("%s line %d: longer than %d bytes", what, line+1, MaxLineBytes)
		}
		return fmt.Errorf("%s line %d: %w", what, line+1, err)
	}
	return nil
}

func parseMooncakeLine(b []byte) (Record, error) {
	var l mooncakeLine
	if err := json.Unmarshal(b, &l); err != nil {
		return Record{}, err
	}
	switch {
	case l.Timestamp == nil:
		return Record{}, errors.New(`missing "timestamp"`)
	case l.InputLength == nil:
		return Record{}, errors.New(`missing "input_length"`)
	case l.OutputLength == nil:
		return Record{}, errors.New(`missing "output_length"`)
	case l.HashIDs == nil:
		return Record{}, errors.New(`missing "hash_ids"`)
	}
	ts := *l.Timestamp
	// time.Duration holds about 292 years; cap well below to avoid overflow.
	if math.IsNaN(ts) || ts < 0 || ts > float64(math.MaxInt64/int64(time.Millisecond))/2 {
		return Record{}, fmt.Errorf("timestamp %v ms out of range", ts)
	}
	in, out := *l.InputLength, *l.OutputLength
	if in < 1 {
		return Record{}, fmt.Errorf("input_length %d: must be at least 1", in)
	}
	if out < 0 {
		return Record{}, fmt.Errorf("output_length %d: must not be negative", out)
	}
	if want := (in + MooncakeBlockTokens - 1) / MooncakeBlockTokens; len(l.HashIDs) != want {
		return Record{}, fmt.Errorf("%d hash_ids for input_length %d: want ceil(%d/%d) = %d",
			len(l.HashIDs), in, in, MooncakeBlockTokens, want)
	}
	for i, id := range l.HashIDs {
		if id < 0 {
			return Record{}, fmt.Errorf("hash_ids[%d] = %d: must not be negative", i, id)
		}
	}
	return Record{
		Timestamp:    time.Duration(math.Round(ts * float64(time.Millisecond))),
		InputLength:  in,
		OutputLength: out,
		HashIDs:      l.HashIDs,
	}, nil
}

// LoadMooncake reads the Mooncake trace file at path (see ReadMooncake); a
// path "embedded:NAME" reads the copy embedded in the binary (package data).
func LoadMooncake(path string) ([]Record, error) {
	f, err := openPath(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	recs, err := ReadMooncake(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return recs, nil
}

// openPath opens path, or the embedded file it names when it starts with
// data.Embedded ("embedded:mooncake_conversation_trace.jsonl").
func openPath(path string) (io.ReadCloser, error) {
	if name, ok := strings.CutPrefix(path, data.Embedded); ok {
		return data.Open(name)
	}
	return os.Open(path)
}

// Token ids produced by Tokens lie in [MinTokenID, MaxTokenID): above the
// special and byte-level ids at the bottom of common vocabularies and below
// the size of Llama 3's 128,256-token vocabulary.
const (
	MinTokenID = 1000
	MaxTokenID = 128000
)

// Tokens appends the record's synthetic prompt, InputLength token ids, to dst
// and returns the extended slice.
//
// Each hash id h becomes a fixed sequence of MooncakeBlockTokens token ids
// that depends on h alone: token j of the block is
//
//	MinTokenID + splitmix64_j(h) mod (MaxTokenID - MinTokenID)
//
// where splitmix64_j(h) is the (j+1)-th output of Vigna's SplitMix64 generator
// seeded with h (the modulo bias, under 10⁻¹³, is irrelevant). The last block
// is cut to InputLength. Hence records with equal ids at equal positions get
// equal token prefixes, and distinct ids give unrelated blocks, so an engine's
// prefix cache sees exactly the sharing the trace describes.
//
// A record with TokenIDs set appends those instead.
func (r Record) Tokens(dst []uint32) []uint32 {
	if r.TokenIDs != nil {
		return append(dst, r.TokenIDs...)
	}
	left := r.InputLength
	for _, id := range r.HashIDs {
		n := min(left, MooncakeBlockTokens)
		if n <= 0 {
			break
		}
		dst = appendBlockTokens(dst, id, n)
		left -= n
	}
	return dst
}

// appendBlockTokens appends the first n tokens of hash id's block.
func appendBlockTokens(dst []uint32, id int64, n int) []uint32 {
	const span = MaxTokenID - MinTokenID
	state := uint64(id)
	for range n {
		// SplitMix64 (Steele, Lea, Flood 2014; Vigna's reference constants).
		state += 0x9e3779b97f4a7c15
		z := state
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
		z = (z ^ (z >> 27)) * 0x94d049bb133111eb
		z ^= z >> 31
		dst = append(dst, uint32(MinTokenID+z%span))
	}
	return dst
}

// InfiniteCacheHitRate returns the fraction of all input tokens that an
// infinitely large prefix cache shared by every request would serve: a block
// counts as a hit when its hash id appeared in an earlier request (chaining
// makes that mean the prefix up to it was seen), counting from the first block
// until the first miss; a hit block contributes its token count (512, or the
// remainder for the last block). No router can exceed this hit rate on the
// trace. It returns 0 for no input tokens.
func InfiniteCacheHitRate(records []Record) float64 {
	s := cacheCeiling(records)
	if s.tokens == 0 {
		return 0
	}
	return float64(s.hitTokens) / float64(s.tokens)
}

// InfiniteCacheBlockHitRate is InfiniteCacheHitRate counted in blocks rather
// than tokens: the fraction of all hash-id blocks that repeat an earlier
// request's prefix. It returns 0 for no blocks.
func InfiniteCacheBlockHitRate(records []Record) float64 {
	s := cacheCeiling(records)
	if s.blocks == 0 {
		return 0
	}
	return float64(s.hitBlocks) / float64(s.blocks)
}

// InfiniteCacheHits returns, per record, the input tokens the infinite
// cache of InfiniteCacheHitRate serves it (tokens), in record order: the
// hit rate of any subset of the records (the measured ones of a run with
// warm-up requests, one time window) is the sum of its entries over its
// input tokens, the earlier records still having filled the cache.
func InfiniteCacheHits(records []Record) []int {
	hits := make([]int, len(records))
	cacheCeilingHits(records, hits)
	return hits
}

type ceiling struct {
	tokens, hitTokens, blocks, hitBlocks int64
}

func cacheCeiling(records []Record) ceiling { return cacheCeilingHits(records, nil) }

// cacheCeilingHits is cacheCeiling, also storing each record's hit tokens in
// hits[i] when hits is not nil (len(records) long).
func cacheCeilingHits(records []Record, hits []int) ceiling {
	var c ceiling
	seen := make(map[int64]struct{})
	for i, r := range records {
		left := r.InputLength
		prefix := true
		for _, id := range r.HashIDs {
			n := min(left, MooncakeBlockTokens)
			if n <= 0 {
				break
			}
			left -= n
			c.tokens += int64(n)
			c.blocks++
			if _, ok := seen[id]; prefix && ok {
				c.hitTokens += int64(n)
				c.hitBlocks++
				if hits != nil {
					hits[i] += n
				}
			} else {
				prefix = false
			}
		}
		for _, id := range r.HashIDs {
			seen[id] = struct{}{}
		}
	}
	return c
}
