package trace

import (
	"fmt"
	"time"
)

// AgenticOptions parameterizes Agentic: tool-using agent sessions whose
// every turn resends the whole history with the model's last tool call and
// the tool's output appended, the shape of Mooncake's tool&agent trace
// (kvcache-ai/Mooncake FAST25-release/traces/toolagent_trace.jsonl: 23,608
// requests; the FAST'25 paper's Table 2 gives a mean input of 8,596 and
// output of 182 tokens and a 59% cache ratio) and of coding agents' traces
// (vLLM × Mooncake blog, 2026-05: a few hundred to a few thousand new tokens
// per turn on a context that grows to ~80k tokens by turn 30). Sessions are
// independent prefixes but for their agent's system prompt (tool schemas and
// instructions), shared by the sessions of one agent.
type AgenticOptions struct {
	// Sessions is the number of agent sessions (default 600).
	Sessions int
	// Agents is the number of distinct agents; session i runs agent
	// i mod Agents's system prompt (default 64).
	Agents int
	// SystemPromptTokens is each agent's system prompt (default 2,048).
	SystemPromptTokens int
	// TaskTokens is the median of the session's task (the user's request
	// and the context it attaches; log-normal, sigma TaskSigma; defaults
	// 3,072 and 0.8).
	TaskTokens int
	TaskSigma  float64
	// ToolOutputTokens is the median of one tool output appended after each
	// turn (log-normal, sigma ToolOutputSigma, at most 32,768; defaults
	// 1,536 and 1.0).
	ToolOutputTokens int
	ToolOutputSigma  float64
	// OutputTokens is the median of the model's output per turn, its tool
	// call (log-normal sigma 0.6, at most 2,000; default 160).
	OutputTokens int
	// MeanTurns is the mean number of turns of a session (geometric, at
	// least 1; default 3.5), at most MaxTurns (default 48).
	MeanTurns float64
	MaxTurns  int
	// MaxContextTokens ends a session whose next prompt would exceed it
	// (default 131,072, a 128k context window).
	MaxContextTokens int
	// SessionRate is the Poisson rate of session starts (sessions/s;
	// default 2; 0: all at t=0).
	SessionRate float64
	// ToolTime is the pause between an answer and the next turn, the tool's
	// run time (default 2 s).
	ToolTime time.Duration
	// Seed fixes every draw and the id offset (default 1).
	Seed uint64
}

// DefaultAgenticOptions returns the defaults noted on AgenticOptions.
func DefaultAgenticOptions() AgenticOptions {
	return AgenticOptions{
		Sessions: 600, Agents: 64, SystemPromptTokens: 2048,
		TaskTokens: 3072, TaskSigma: 0.8, ToolOutputTokens: 1536, ToolOutputSigma: 1.0,
		OutputTokens: 160, MeanTurns: 3.5, MaxTurns: 48, MaxContextTokens: 131072,
		SessionRate: 2, ToolTime: 2 * time.Second, Seed: 1,
	}
}

func (o AgenticOptions) validate() error {
	switch {
	case o.Sessions < 1 || o.Sessions > maxSynthRequests:
		return fmt.Errorf("sessions %d: must be in [1, %d]", o.Sessions, maxSynthRequests)
	case o.Agents < 1:
		return fmt.Errorf("agents %d: must be at least 1", o.Agents)
	case !(o.MeanTurns >= 1 && o.MeanTurns <= 1e6):
		return fmt.Errorf("mean turns %v: must be in [1, 1e6]", o.MeanTurns)
	case o.MaxTurns < 1 || o.MaxTurns > maxSynthRequests/o.Sessions:
		return fmt.Errorf("max turns %d: must be in [1, %d] (at most %d requests)", o.MaxTurns, maxSynthRequests/o.Sessions, maxSynthRequests)
	case o.ToolTime < 0:
		return fmt.Errorf("tool time %v: must not be negative", o.ToolTime)
	}
	for _, c := range []struct {
		name  string
		v, lo int
	}{
		{"system prompt tokens", o.SystemPromptTokens, 0}, {"task tokens", o.TaskTokens, 1},
		{"tool output tokens", o.ToolOutputTokens, 1}, {"output tokens", o.OutputTokens, 1},
		{"max context tokens", o.MaxContextTokens, 1},
	} {
		if err := checkLen(c.name, c.v, c.lo); err != nil {
			return err
		}
	}
	for _, c := range []struct {
		name string
		v    float64
	}{{"task sigma", o.TaskSigma}, {"tool output sigma", o.ToolOutputSigma}} {
		if err := checkSigma(c.name, c.v); err != nil {
			return err
		}
	}
	return checkRate(o.SessionRate)
}

// Agentic generates the sessions of o: session i starts at the i-th
// arrival of a Poisson process of SessionRate, runs agent i mod Agents,
// and its turn k's prompt is
//
//	system(agent) ++ task ++ Σ_{j<k} (call_j ++ tool_j)
//
// with call_j turn j's output (OutputLength tokens) and tool_j a tool
// output; so turn k's prompt is a prefix of turn k+1's, shared at the
// trace's 512-token block granularity (the block straddling the end of turn
// k's prompt is not: it continues differently). A session has a geometric
// number of turns (mean MeanTurns, at most MaxTurns) and ends early when
// the next prompt would exceed MaxContextTokens. Turns' Timestamp is 0 and
// the session's ThinkTime is ToolTime: Flatten makes the open-loop trace.
// Ids come from AgenticIDBase; the output depends on o alone.
func Agentic(o AgenticOptions) ([]Session, error) {
	if err := o.validate(); err != nil {
		return nil, fmt.Errorf("agentic workload: %w", err)
	}
	r := newRNG(o.Seed, 0x4147) // "AG"
	ids := newComposer(AgenticIDBase, o.Seed)
	agents := make([]uint64, o.Agents)
	for i := range agents {
		agents[i] = r.next()
	}
	starts := arrivals(r, o.Sessions, o.SessionRate)
	out := make([]Session, o.Sessions)
	pStop := 1 / o.MeanTurns
	for i := range out {
		segs := []segment{{agents[i%o.Agents], o.SystemPromptTokens},
			{r.next(), r.logNormal(float64(o.TaskTokens), o.TaskSigma, 1, maxSynthTokens)}}
		s := Session{Start: starts[i], ThinkTime: o.ToolTime}
		in := segs[0].tokens + segs[1].tokens
		for k := 0; k < o.MaxTurns && in <= o.MaxContextTokens; k++ {
			hids, err := ids.hashIDs(segs)
			if err != nil {
				return nil, fmt.Errorf("agentic workload: %w", err)
			}
			outTok := r.logNormal(float64(o.OutputTokens), 0.6, 1, 2000)
			s.Turns = append(s.Turns, Record{InputLength: in, OutputLength: outTok, HashIDs: hids})
			if r.float64() < pStop {
				break
			}
			tool := r.logNormal(float64(o.ToolOutputTokens), o.ToolOutputSigma, 1, 32768)
			segs = append(segs, segment{r.next(), outTok}, segment{r.next(), tool})
			in += outTok + tool
		}
		if len(s.Turns) == 0 { // a first prompt over the context: cut to it
			segs[1].tokens = max(1, o.MaxContextTokens-segs[0].tokens)
			segs[0].tokens = min(segs[0].tokens, o.MaxContextTokens-segs[1].tokens)
			hids, err := ids.hashIDs(segs[:2])
			if err != nil {
				return nil, fmt.Errorf("agentic workload: %w", err)
			}
			s.Turns = append(s.Turns, Record{InputLength: segs[0].tokens + segs[1].tokens, OutputLength: o.OutputTokens, HashIDs: hids})
		}
		out[i] = s
	}
	return out, nil
}
