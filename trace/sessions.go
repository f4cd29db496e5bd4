package trace

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"
)

// Encoder turns text into token ids; *prefix.Tokenizer (cl100k_base) is one.
// Encode must be deterministic.
type Encoder interface {
	Encode(text string) []uint32
}

// Question is one MT-bench question (lm-sys/FastChat,
// fastchat/llm_judge/data/mt_bench/question.jsonl): a user turn per element
// of Turns, the later ones following up on the earlier answers.
type Question struct {
	ID       int      `json:"question_id"`
	Category string   `json:"category"`
	Turns    []string `json:"turns"`
}

// ReadMTBench reads MT-bench questions, one JSON object per line with
// "question_id", "category" and "turns" (unknown fields ignored, blank lines
// skipped). It rejects, naming the 1-based line, malformed JSON, a missing
// question_id, no turns, and an empty turn.
func ReadMTBench(r io.Reader) ([]Question, error) {
	var qs []Question
	err := readLines(r, "mt-bench", func(_ int, b []byte) error {
		var q struct {
			Question
			ID *int `json:"question_id"`
		}
		if err := json.Unmarshal(b, &q); err != nil {
			return err
		}
		switch {
		case q.ID == nil:
			return errors.New(`missing "question_id"`)
		case len(q.Turns) == 0:
			return errors.New(`no "turns"`)
		}
		for i, t := range q.Turns {
			if t == "" {
				return fmt.Errorf("turn %d is empty", i+1)
			}
		}
		q.Question.ID = *q.ID
		qs = append(qs, q.Question)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return qs, nil
}

// LoadMTBench reads the MT-bench question file at path (see ReadMTBench).
func LoadMTBench(path string) ([]Question, error) {
	f, err := openPath(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	qs, err := ReadMTBench(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return qs, nil
}

// Session is one multi-turn conversation. Its turns must be sent in order,
// each after the previous turn's answer has arrived and the user has thought
// for ThinkTime (closed loop); Flatten estimates open-loop arrivals instead.
type Session struct {
	// Start is when the first turn is sent, from the start of the workload.
	Start time.Duration
	// ThinkTime is the pause between receiving an answer and sending the
	// next turn.
	ThinkTime time.Duration
	// Turns are the requests, with literal prompts (Record.TokenIDs; turn
	// k's prompt is a prefix of turn k+1's) and content-derived HashIDs.
	// Their Timestamp is 0: arrivals depend on the serving system; see
	// Flatten.
	Turns []Record
}

// ChatOptions parameterizes ChatSessions.
type ChatOptions struct {
	// Sessions is the number of conversations (default 80, one per MT-bench
	// question). Session i asks question perm[i mod len(questions)] for a
	// seed-shuffled permutation perm, so with more sessions than questions
	// questions repeat (and repeated first turns share their whole prompt).
	Sessions int
	// SystemPromptTokens is the length of the system prompt all sessions
	// share: the first SystemPromptTokens tokens of the sonnet text
	// (vLLM's benchmarks/sonnet.txt) (tokens; default 2048).
	SystemPromptTokens int
	// AnswerTokens is the output length of every turn, and the length of
	// each synthetic earlier answer carried in later turns' history: a run
	// of AnswerTokens consecutive sonnet tokens from a seed-drawn offset
	// (wrapping around) (tokens; default 256).
	AnswerTokens int
	// Rate is the Poisson rate of session starts (sessions/s); 0 starts
	// every session at t=0 (default 1).
	Rate float64
	// ThinkTime is every session's pause between an answer and the next
	// turn (default 5 s).
	ThinkTime time.Duration
	// Seed fixes the question order, the answers and the start times
	// (default 1).
	Seed uint64
}

// DefaultChatOptions returns the documented defaults: 80 sessions, a
// 2048-token system prompt, 256-token answers, 1 session start per second,
// 5 s think time, seed 1.
func DefaultChatOptions() ChatOptions {
	return ChatOptions{
		Sessions:           80,
		SystemPromptTokens: 2048,
		AnswerTokens:       256,
		Rate:               1,
		ThinkTime:          5 * time.Second,
		Seed:               1,
	}
}

// Chat template pieces around each user turn. They are plain text (no
// model's chat template): the engine sees completions, and only prefix
// structure matters here.
const (
	chatUserPrefix = "\n\nUSER: "
	chatUserSuffix = "\nASSISTANT: "
)

// ChatSessions builds multi-turn chat sessions from real text: questions
// (MT-bench) asked under a shared system prompt cut from sonnet (the text
// of vLLM's sonnet.txt), tokenized with enc. Turn k of a session has the
// prompt
//
//	system ++ Σ_{j<k} (user(q_j) ++ answer_j) ++ user(q_k)
//
// where system is the first o.SystemPromptTokens tokens of enc(sonnet),
// user(q) is enc("\n\nUSER: " + q + "\nASSISTANT: ") and answer_j is o.AnswerTokens
// sonnet tokens from a seed-drawn offset. Each piece is tokenized on its own
// and the pieces are concatenated, so turn k's tokens are exactly a prefix of
// turn k+1's, and all sessions share the system prompt's tokens. Each turn
// asks for o.AnswerTokens output tokens. The earlier answers are synthetic:
// a served model's real answer would differ, so the engine's cache of its
// own generated tokens never matches the next turn (only the prompt part is
// reused), which understates the reuse of a live chat; a closed-loop driver
// could splice in the real answers.
//
// Sessions start at Poisson arrivals of rate o.Rate (the first at 0). The
// records carry literal prompts (Record.TokenIDs, the turns of a session
// sharing one backing array) and HashIDs from ContentHashIDs.
func ChatSessions(questions []Question, sonnet string, enc Encoder, o ChatOptions) ([]Session, error) {
	switch {
	case enc == nil:
		return nil, errors.New("chat sessions: no encoder")
	case len(questions) == 0:
		return nil, errors.New("chat sessions: no questions")
	case o.Sessions < 1 || o.Sessions > maxSynthRequests:
		return nil, fmt.Errorf("chat sessions: sessions %d: must be in [1, %d]", o.Sessions, maxSynthRequests)
	case o.SystemPromptTokens < 0:
		return nil, fmt.Errorf("chat sessions: system prompt tokens %d: must not be negative", o.SystemPromptTokens)
	case o.AnswerTokens < 0 || o.AnswerTokens > maxSynthTokens:
		return nil, fmt.Errorf("chat sessions: answer tokens %d: must be in [0, %d]", o.AnswerTokens, maxSynthTokens)
	case o.ThinkTime < 0:
		return nil, fmt.Errorf("chat sessions: think time %v: must not be negative", o.ThinkTime)
	}
	if err := checkRate(o.Rate); err != nil {
		return nil, fmt.Errorf("chat sessions: %w", err)
	}
	for i, q := range questions {
		if len(q.Turns) == 0 {
			return nil, fmt.Errorf("chat sessions: question %d (id %d) has no turns", i, q.ID)
		}
	}
	text := enc.Encode(sonnet)
	if len(text) < o.SystemPromptTokens {
		return nil, fmt.Errorf("chat sessions: sonnet text has %d tokens, fewer than the %d-token system prompt", len(text), o.SystemPromptTokens)
	}
	if o.AnswerTokens > 0 && len(text) == 0 {
		return nil, errors.New("chat sessions: empty sonnet text cannot supply answers")
	}
	system := text[:o.SystemPromptTokens]

	// Tokenize each distinct user turn once.
	user := make([][][]uint32, len(questions))
	for i, q := range questions {
		user[i] = make([][]uint32, len(q.Turns))
		for k, t := range q.Turns {
			user[i][k] = enc.Encode(chatUserPrefix + t + chatUserSuffix)
		}
	}

	r := newRNG(o.Seed, 0x4d54) // "MT"
	perm := make([]int, len(questions))
	for i := range perm {
		perm[i] = i
	}
	shuffle(r, perm)
	starts := arrivals(r, o.Sessions, o.Rate)

	sessions := make([]Session, o.Sessions)
	for s := range sessions {
		qi := perm[s%len(perm)]
		turns := user[qi]
		size := len(system)
		for k, u := range turns {
			size += len(u)
			if k < len(turns)-1 {
				size += o.AnswerTokens
			}
		}
		full := make([]uint32, 0, size)
		full = append(full, system...)
		recs := make([]Record, len(turns))
		for k, u := range turns {
			if k > 0 {
				off := r.intn(len(text))
				for j := range o.AnswerTokens {
					full = append(full, text[(off+j)%len(text)])
				}
			}
			full = append(full, u...)
			n := len(full)
			recs[k] = Record{
				InputLength:  n,
				OutputLength: o.AnswerTokens,
				HashIDs:      ContentHashIDs(full[:n:n]),
				TokenIDs:     full[:n:n],
			}
		}
		sessions[s] = Session{Start: starts[s], ThinkTime: o.ThinkTime, Turns: recs}
	}
	return sessions, nil
}

// ContentHashIDs returns chained hash ids for a literal prompt, one per
// MooncakeBlockTokens-token block (the last possibly partial), so that
// literal-token records take part in hash-id accounting such as
// InfiniteCacheHitRate: block b's id hashes block b's tokens together with
// block b−1's id, so equal ids at a position mean (up to 64-bit hash
// collisions, ~n²/2^63 for n blocks) equal prefixes. A partial last block
// hashes only the tokens it has, so it matches only an equally cut block.
// Ids lie in [TextIDBase, 2^63).
func ContentHashIDs(tokens []uint32) []int64 {
	const B = MooncakeBlockTokens
	ids := make([]int64, 0, (len(tokens)+B-1)/B)
	h := uint64(0x6a09e667f3bcc908)
	for len(tokens) > 0 {
		n := min(len(tokens), B)
		h = splitmix(h ^ uint64(n))
		for _, t := range tokens[:n] {
			h = splitmix(h ^ uint64(t))
		}
		ids = append(ids, TextIDBase|int64(h>>2))
		tokens = tokens[n:]
	}
	return ids
}

// Flatten turns sessions into one open-loop trace sorted by arrival
// (ties in session order, then turn order). Each session's turn 0 arrives
// at Start, and turn k+1 at turn k's arrival + latency(turn k) + ThinkTime:
// latency estimates how long the serving system takes to answer (nil means
// 0). The estimate ignores queueing, so under load the real closed loop
// sends later turns later than this trace does. Records are copies (their
// token slices shared).
func Flatten(sessions []Session, latency func(Record) time.Duration) []Record {
	var out []Record
	for _, s := range sessions {
		t := s.Start
		for _, r := range s.Turns {
			r.Timestamp = t
			out = append(out, r)
			if latency != nil {
				t += latency(r)
			}
			t += s.ThinkTime
		}
	}
	slices.SortStableFunc(out, func(a, b Record) int {
		return cmp.Compare(a.Timestamp, b.Timestamp)
	})
	return out
}

// LinearLatency returns the latency estimate base + perOutputToken ×
// OutputLength, a time to first token plus a constant time per output token
// (for example 200 ms and 20 ms for a mid-size model under light load).
func LinearLatency(base, perOutputToken time.Duration) func(Record) time.Duration {
	return func(r Record) time.Duration {
		return base + perOutputToken*time.Duration(r.OutputLength)
	}
}
