package trace

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"time"
)

// Azure LLM inference traces (Azure/AzurePublicDataset, the 2023 traces of
// the Splitwise paper, ISCA'24) are CSV files with the header
// TIMESTAMP,ContextTokens,GeneratedTokens: a wall-clock datetime and the
// prompt and output lengths of each request. They carry no prefix
// information; PrefixModel adds a synthetic one.

// azureTimeLayouts are the timestamp forms accepted, tried in order. The 2023
// files use "2023-11-16 18:15:46.6805900" (time.Parse accepts the fractional
// seconds without their being in the layout); the zone forms cover copies
// written with an offset. A timestamp without a zone is taken as UTC; only
// differences matter.
var azureTimeLayouts = []string{
	"2006-01-02 15:04:05",
	"2006-01-02 15:04:05Z07:00",
	time.RFC3339Nano,
}

// ReadAzure reads an Azure LLM inference trace (CSV with the header
// TIMESTAMP,ContextTokens,GeneratedTokens, in any column order; names
// compared case-insensitively; other columns ignored) and returns one Record
// per row: Timestamp is the row's time minus the first row's, InputLength is
// ContextTokens and OutputLength GeneratedTokens. Blank lines are skipped. It
// rejects, naming the 1-based line, a missing header column, a row with the
// wrong number of fields, an unparsable timestamp, a timestamp before the
// previous row's, ContextTokens < 1 or > 2^24, and GeneratedTokens < 0.
//
// The trace has no prefix information: m assigns the HashIDs (see
// PrefixModel; the zero PrefixModel gives every block an id of its own, so no
// request shares anything).
func ReadAzure(r io.Reader, m PrefixModel) ([]Record, error) {
	if err := m.validate(); err != nil {
		return nil, fmt.Errorf("azure trace: %w", err)
	}
	cr := csv.NewReader(r)
	cr.ReuseRecord = true
	header, err := cr.Read()
	if err != nil {
		if err == io.EOF {
			return nil, errors.New("azure trace line 1: empty file, want header TIMESTAMP,ContextTokens,GeneratedTokens")
		}
		return nil, fmt.Errorf("azure trace: %w", err)
	}
	col := map[string]int{"timestamp": -1, "contexttokens": -1, "generatedtokens": -1}
	for i, h := range header {
		h = strings.ToLower(strings.TrimSpace(strings.TrimPrefix(h, "\ufeff")))
		if j, ok := col[h]; ok && j < 0 {
			col[h] = i
		}
	}
	for _, name := range []string{"timestamp", "contexttokens", "generatedtokens"} {
		if col[name] < 0 {
			return nil, fmt.Errorf("azure trace line 1: header %q lacks column %s (want TIMESTAMP,ContextTokens,GeneratedTokens)",
				strings.Join(header, ","), name)
		}
	}
	cr.FieldsPerRecord = len(header)

	var (
		recs  []Record
		first time.Time
		prev  time.Time
	)
	for {
		row, err := cr.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			// csv.ParseError already names the line.
			return nil, fmt.Errorf("azure trace: %w", err)
		}
		line, _ := cr.FieldPos(0)
		ts, err := parseAzureTime(strings.TrimSpace(row[col["timestamp"]]))
		if err != nil {
			return nil, fmt.Errorf("azure trace line %d: %w", line, err)
		}
		in, err := strconv.Atoi(strings.TrimSpace(row[col["contexttokens"]]))
		if err != nil {
			return nil, fmt.Errorf("azure trace line %d: ContextTokens: %w", line, err)
		}
		out, err := strconv.Atoi(strings.TrimSpace(row[col["generatedtokens"]]))
		if err != nil {
			return nil, fmt.Errorf("azure trace line %d: GeneratedTokens: %w", line, err)
		}
		switch {
		case in < 1 || in > maxSynthTokens:
			return nil, fmt.Errorf("azure trace line %d: ContextTokens %d: must be in [1, %d]", line, in, maxSynthTokens)
		case out < 0:
			return nil, fmt.Errorf("azure trace line %d: GeneratedTokens %d: must not be negative", line, out)
		}
		if len(recs) == 0 {
			first, prev = ts, ts
		}
		if ts.Before(prev) {
			return nil, fmt.Errorf("azure trace line %d: timestamp %s is before the previous row's %s (trace must be sorted)",
				line, ts.Format(time.RFC3339Nano), prev.Format(time.RFC3339Nano))
		}
		off := ts.Sub(first)
		if off == math.MaxInt64 {
			return nil, fmt.Errorf("azure trace line %d: timestamp more than %v after the first", line, time.Duration(math.MaxInt64))
		}
		prev = ts
		recs = append(recs, Record{Timestamp: off, InputLength: in, OutputLength: out})
	}
	if err := m.Apply(recs); err != nil {
		return nil, fmt.Errorf("azure trace: %w", err)
	}
	return recs, nil
}

func parseAzureTime(s string) (time.Time, error) {
	for _, layout := range azureTimeLayouts {
		if t, err := time.Parse(layout, s); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("TIMESTAMP %q: want a datetime like 2023-11-16 18:15:46.6805900", s)
}

// LoadAzure reads the Azure trace file at path (see ReadAzure).
func LoadAzure(path string, m PrefixModel) ([]Record, error) {
	f, err := openPath(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	recs, err := ReadAzure(f, m)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return recs, nil
}

// PrefixModel is a synthetic prefix-sharing model for traces that give only
// lengths (the Azure traces). Its output is invented, not measured: use it to
// ask "what if this arrival and length pattern had this much sharing", and
// report its parameters with any result.
//
// Blocks are MooncakeBlockTokens (512) tokens with chained hash ids, as in
// the Mooncake traces. For request i, in trace order:
//
//  1. Session continuation: with probability SessionProb (i > 0), request i
//     continues an earlier one, its parent j, drawn uniformly from the
//     SessionWindow requests before it. It reuses the parent's leading
//     min(⌊in_j/512⌋, ⌊in_i/512⌋) block ids: the parent's whole blocks that
//     also fit whole in request i (so a parent's partial last block is never
//     shared, and a child shorter than its parent shares a truncated
//     history). Chains form when a parent was itself a continuation.
//  2. System prompt: every request begins with the same SystemPromptTokens
//     tokens. Block b gets the system prompt's id when it lies wholly inside
//     it ((b+1)·512 ≤ SystemPromptTokens), even when request i's prompt ends
//     inside that block (its tokens are then a prefix of the system prompt's
//     block). A block straddling the system prompt's end gets a fresh id, so
//     only ⌊SystemPromptTokens/512⌋ whole blocks are shared.
//  3. Every other block gets a fresh id (from AzureIDBase; see there).
//
// Each request draws the same random numbers whatever the parameters, so
// changing SessionProb changes which requests continue a session, not the
// parent a continuing request picks. The zero value shares nothing.
type PrefixModel struct {
	// SystemPromptTokens is the length of the system prompt every request
	// starts with (tokens; default 0, none).
	SystemPromptTokens int
	// SessionProb is the probability that a request continues an earlier
	// request's session (default 0, never).
	SessionProb float64
	// SessionWindow is how many preceding requests a continuation draws its
	// parent from (requests; default 64, about 12 s of the Azure
	// conversation trace at its 5.5 requests/s). Must be ≥ 1 when
	// SessionProb > 0.
	SessionWindow int
	// Seed fixes the draws and the hash-id offset (default 1).
	Seed uint64
}

// DefaultPrefixModel returns the documented defaults: no system prompt, no
// session continuation (so no sharing at all), window 64, seed 1.
func DefaultPrefixModel() PrefixModel {
	return PrefixModel{SessionWindow: 64, Seed: 1}
}

func (m PrefixModel) validate() error {
	switch {
	case m.SystemPromptTokens < 0 || m.SystemPromptTokens > maxSynthTokens:
		return fmt.Errorf("prefix model: system prompt tokens %d: must be in [0, %d]", m.SystemPromptTokens, maxSynthTokens)
	case !(m.SessionProb >= 0 && m.SessionProb <= 1):
		return fmt.Errorf("prefix model: session probability %v: must be in [0, 1]", m.SessionProb)
	case m.SessionWindow < 0 || (m.SessionProb > 0 && m.SessionWindow < 1):
		return fmt.Errorf("prefix model: session window %d: must be at least 1 when the session probability is positive", m.SessionWindow)
	}
	return nil
}

// Apply sets the HashIDs of recs (which must have InputLength ≥ 1 and
// arrive in trace order) as described on PrefixModel, replacing any already
// there. The result depends on m and the records' input lengths alone.
func (m PrefixModel) Apply(recs []Record) error {
	if err := m.validate(); err != nil {
		return err
	}
	if len(recs) > maxSynthRequests {
		return fmt.Errorf("prefix model: %d records: at most %d", len(recs), maxSynthRequests)
	}
	const B = MooncakeBlockTokens
	total := 0
	for i, r := range recs {
		if r.InputLength < 1 || r.InputLength > maxSynthTokens {
			return fmt.Errorf("prefix model: record %d: input length %d: must be in [1, %d]", i, r.InputLength, maxSynthTokens)
		}
		total += (r.InputLength + B - 1) / B
	}
	if total > maxSynthBlocks {
		return fmt.Errorf("prefix model: %d blocks: at most %d", total, maxSynthBlocks)
	}
	sysBlocks := m.SystemPromptTokens / B
	next := idBase(AzureIDBase, m.Seed)
	sysID := next
	next += int64(sysBlocks)

	ids := make([]int64, total)   // one backing array for all records
	rnd := newRNG(m.Seed, 0x415a) // "AZ"
	for i := range recs {
		in := recs[i].InputLength
		n := (in + B - 1) / B
		h := ids[:n:n]
		ids = ids[n:]
		u, pick := rnd.float64(), rnd.next()
		inherit := 0
		if i > 0 && u < m.SessionProb {
			w := min(i, m.SessionWindow)
			parent := recs[i-1-int(pick%uint64(w))]
			inherit = min(parent.InputLength/B, in/B)
			copy(h, parent.HashIDs[:inherit])
		}
		for b := inherit; b < n; b++ {
			if b < sysBlocks {
				h[b] = sysID + int64(b)
			} else {
				h[b] = next
				next++
			}
		}
		recs[i].HashIDs = h
	}
	return nil
}
