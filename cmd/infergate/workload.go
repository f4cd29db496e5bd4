package main

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/infergate/infergate/data"
	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/trace"
)

// Workload kinds accepted by --workload (see trace/README.md).
const (
	workloadMooncake     = "mooncake"
	workloadAzure        = "azure"
	workloadSharedPrefix = "shared-prefix"
	workloadChat         = "chat"
	workloadAgentic      = "agentic"
	workloadRAG          = "rag"
	workloadLongTail     = "long-tail"
)

// workloadFlags selects and parameterises the requests bench and plan replay.
type workloadFlags struct {
	kind   string
	path   string
	azure  trace.PrefixModel
	shared trace.SharedPrefixOptions
	chat   trace.ChatOptions
	agent  trace.AgenticOptions
	rag    trace.RAGOptions
	tail   trace.LongTailOptions
	mtb    string
	sonnet string
}

func (w *workloadFlags) register(f *pflag.FlagSet) {
	w.azure = trace.DefaultPrefixModel()
	w.shared = trace.DefaultSharedPrefixOptions()
	w.chat = trace.DefaultChatOptions()
	w.agent = trace.DefaultAgenticOptions()
	w.rag = trace.DefaultRAGOptions()
	w.tail = trace.DefaultLongTailOptions()
	f.StringVar(&w.kind, "workload", workloadMooncake, "requests to replay: mooncake (--trace JSONL), azure (--trace CSV + a synthetic prefix model), shared-prefix (generated), chat (MT-bench sessions), agentic (tool-use sessions), rag (shared documents, distinct questions), long-tail (independent prompts, a tail of 60-130k-token ones); trace/README.md")
	f.StringVar(&w.path, "trace", "", "trace file: Mooncake hash-id JSONL, or the Azure 2023 CSV with --workload azure (default: the copy embedded in the binary, data/"+data.Mooncake+" or data/"+data.Azure+")")
	f.IntVar(&w.azure.SystemPromptTokens, "azure-system-tokens", w.azure.SystemPromptTokens, "azure: shared system-prompt tokens prepended to every request (synthetic)")
	f.Float64Var(&w.azure.SessionProb, "azure-session-prob", w.azure.SessionProb, "azure: probability a request continues an earlier one (synthetic)")
	f.IntVar(&w.shared.Groups, "sp-groups", w.shared.Groups, "shared-prefix: groups (distinct system prompts)")
	f.IntVar(&w.shared.PromptsPerGroup, "sp-prompts-per-group", w.shared.PromptsPerGroup, "shared-prefix: prompts per group")
	f.IntVar(&w.shared.SystemPromptTokens, "sp-system-tokens", w.shared.SystemPromptTokens, "shared-prefix: system-prompt tokens")
	f.IntVar(&w.shared.QuestionTokens, "sp-question-tokens", w.shared.QuestionTokens, "shared-prefix: question tokens")
	f.IntVar(&w.shared.OutputTokens, "sp-output-tokens", w.shared.OutputTokens, "shared-prefix: output tokens")
	f.Float64Var(&w.shared.Rate, "sp-rate", w.shared.Rate, "shared-prefix: Poisson arrival rate in requests/s (0 = all at once)")
	f.IntVar(&w.chat.Sessions, "chat-sessions", w.chat.Sessions, "chat: number of two-turn sessions")
	f.IntVar(&w.agent.Sessions, "agentic-sessions", w.agent.Sessions, "agentic: number of agent sessions")
	f.Float64Var(&w.agent.SessionRate, "agentic-session-rate", w.agent.SessionRate, "agentic: Poisson rate of session starts (sessions/s; 0 = all at once)")
	f.IntVar(&w.rag.Documents, "rag-documents", w.rag.Documents, "rag: shared documents")
	f.IntVar(&w.rag.DocumentTokens, "rag-document-tokens", w.rag.DocumentTokens, "rag: tokens per document")
	f.IntVar(&w.rag.DocsPerRequest, "rag-docs-per-request", w.rag.DocsPerRequest, "rag: documents before each question")
	f.Float64Var(&w.rag.Rate, "rag-rate", w.rag.Rate, "rag: Poisson arrival rate (requests/s; 0 = all at once)")
	f.Float64Var(&w.tail.Rate, "long-tail-rate", w.tail.Rate, "long-tail: Poisson arrival rate (requests/s; 0 = all at once)")
	f.Float64Var(&w.tail.TailProb, "long-tail-prob", w.tail.TailProb, "long-tail: probability that a new prompt is a 60-130k-token one")
	f.StringVar(&w.mtb, "mtbench", "", "chat: MT-bench question.jsonl (default: the embedded data/"+data.MTBench+")")
	f.StringVar(&w.sonnet, "sonnet", "", "chat: text for the shared system prompt (default: the embedded data/"+data.Sonnet+")")
}

// reseed offsets every generator's seed by off (plan's --seed): seed 0
// keeps their defaults, so the published figures reproduce, and each other
// seed draws another synthetic workload (the Azure prefix model's
// sessions, the generated workloads' prompts and arrivals). A fixed trace
// (mooncake) has no seed.
func (w *workloadFlags) reseed(off uint64) {
	w.azure.Seed += off
	w.shared.Seed += off
	w.chat.Seed += off
	w.agent.Seed += off
	w.rag.Seed += off
	w.tail.Seed += off
}

// load builds the records of the selected workload, in arrival order.
func (w *workloadFlags) load() ([]trace.Record, error) {
	switch w.kind {
	case workloadMooncake:
		return trace.LoadMooncake(w.tracePath(data.Mooncake))
	case workloadAzure:
		return trace.LoadAzure(w.tracePath(data.Azure), w.azure)
	case workloadSharedPrefix:
		return trace.SharedPrefix(w.shared)
	case workloadChat:
		sessions, err := w.sessions()
		if err != nil {
			return nil, err
		}
		// Open loop: each turn after the previous one's estimated latency
		// (0.5 s + 30 ms per output token) plus the think time.
		return trace.Flatten(sessions, trace.LinearLatency(500*time.Millisecond, 30*time.Millisecond)), nil
	case workloadAgentic:
		sessions, err := trace.Agentic(w.agent)
		if err != nil {
			return nil, err
		}
		// Open loop: each turn after the previous one's estimated latency
		// (1 s, the longer prompts' prefill, + 30 ms per output token) plus
		// the tool's run time.
		return trace.Flatten(sessions, trace.LinearLatency(time.Second, 30*time.Millisecond)), nil
	case workloadRAG:
		return trace.RAG(w.rag)
	case workloadLongTail:
		return trace.LongTail(w.tail)
	}
	return nil, fmt.Errorf("--workload %q: want mooncake, azure, shared-prefix, chat, agentic, rag or long-tail", w.kind)
}

// tracePath is --trace, or the embedded copy of the trace name when it is
// not given.
func (w *workloadFlags) tracePath(name string) string {
	if w.path == "" {
		return data.Embedded + name
	}
	return w.path
}

// sessions builds the chat workload's sessions, keeping their structure for
// a session-aware closed loop (bench --concurrency); other workloads have
// none.
func (w *workloadFlags) sessions() ([]trace.Session, error) {
	if w.kind != workloadChat {
		return nil, fmt.Errorf("--workload %s has no sessions (only chat does)", w.kind)
	}
	mtb, sonnet := w.mtb, w.sonnet
	if mtb == "" {
		mtb = data.Embedded + data.MTBench
	}
	if sonnet == "" {
		sonnet = data.Embedded + data.Sonnet
	}
	qs, err := trace.LoadMTBench(mtb)
	if err != nil {
		return nil, err
	}
	text, err := data.ReadPath(sonnet)
	if err != nil {
		return nil, fmt.Errorf("chat workload: %w", err)
	}
	tok, err := prefix.NewTokenizer()
	if err != nil {
		return nil, err
	}
	return trace.ChatSessions(qs, string(text), tok, w.chat)
}

// warmupFlags are --warmup and --warmup-duration.
type warmupFlags struct{ w measure.Warmup }

func (w *warmupFlags) register(f *pflag.FlagSet) {
	f.IntVar(&w.w.Requests, "warmup", 0, "send the first N requests but leave them out of the summary, HTML report and goodput (records keep them, marked \"warmup\": true)")
	f.DurationVar(&w.w.Duration, "warmup-duration", 0, "like --warmup, for the requests sent in this first span of the run (engine time, e.g. 60s)")
}

// parseRates splits a comma-separated list of request rates (req/s).
func parseRates(list string) ([]float64, error) {
	if list == "" {
		return nil, nil
	}
	var out []float64
	for p := range strings.SplitSeq(list, ",") {
		r, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
		if err != nil || !(r > 0) || math.IsInf(r, 0) {
			return nil, fmt.Errorf("--rate %q: want positive request rates (req/s), comma-separated", p)
		}
		out = append(out, r)
	}
	return out, nil
}

// parsePolicies splits a comma-separated policy list and checks every name
// against the built-in policies and routing's profiles.
func parsePolicies(list string, routing sched.Config) ([]string, error) {
	var out []string
	for p := range strings.SplitSeq(list, ",") {
		p = strings.TrimSpace(p)
		routing.Policy = p
		if err := sched.Validate(routing); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// loadRouting returns the routing section of a gateway config file ("" = defaults).
func loadRouting(path string) (sched.Config, error) {
	if path == "" {
		return sched.Config{}, nil
	}
	gc, err := gateway.LoadConfig(path)
	if err != nil {
		return sched.Config{}, err
	}
	return gc.Routing, nil
}

// describe records the selected workload for a report's provenance: its
// kind, the files it was read from with their digests, the kind's
// parameters, and how many of its records (total) were replayed.
func (w *workloadFlags) describe(replayed, total int) (*measure.Workload, error) {
	d := &measure.Workload{Kind: w.kind, Records: total, Replayed: replayed}
	var files []string
	g := strconv.FormatFloat
	switch w.kind {
	case workloadMooncake:
		files = []string{w.tracePath(data.Mooncake)}
	case workloadAzure:
		files = []string{w.tracePath(data.Azure)}
		d.Params = map[string]string{"azure-system-tokens": strconv.Itoa(w.azure.SystemPromptTokens),
			"azure-session-prob": g(w.azure.SessionProb, 'g', -1, 64), "session-window": strconv.Itoa(w.azure.SessionWindow),
			"seed": strconv.FormatUint(w.azure.Seed, 10)}
	case workloadSharedPrefix:
		o := w.shared
		d.Params = map[string]string{"sp-groups": strconv.Itoa(o.Groups), "sp-prompts-per-group": strconv.Itoa(o.PromptsPerGroup),
			"sp-system-tokens": strconv.Itoa(o.SystemPromptTokens), "sp-question-tokens": strconv.Itoa(o.QuestionTokens),
			"sp-output-tokens": strconv.Itoa(o.OutputTokens), "sp-rate": g(o.Rate, 'g', -1, 64), "seed": strconv.FormatUint(o.Seed, 10)}
	case workloadChat:
		mtb, sonnet := w.mtb, w.sonnet
		if mtb == "" {
			mtb = data.Embedded + data.MTBench
		}
		if sonnet == "" {
			sonnet = data.Embedded + data.Sonnet
		}
		files = []string{mtb, sonnet}
		o := w.chat
		d.Params = map[string]string{"chat-sessions": strconv.Itoa(o.Sessions), "system-tokens": strconv.Itoa(o.SystemPromptTokens),
			"answer-tokens": strconv.Itoa(o.AnswerTokens), "session-rate": g(o.Rate, 'g', -1, 64), "think-time": o.ThinkTime.String(),
			"seed": strconv.FormatUint(o.Seed, 10)}
	case workloadAgentic:
		o := w.agent
		d.Params = map[string]string{"agentic-sessions": strconv.Itoa(o.Sessions), "agents": strconv.Itoa(o.Agents),
			"system-tokens": strconv.Itoa(o.SystemPromptTokens), "task-tokens-median": strconv.Itoa(o.TaskTokens),
			"tool-output-tokens-median": strconv.Itoa(o.ToolOutputTokens), "output-tokens-median": strconv.Itoa(o.OutputTokens),
			"mean-turns": g(o.MeanTurns, 'g', -1, 64), "max-turns": strconv.Itoa(o.MaxTurns), "max-context-tokens": strconv.Itoa(o.MaxContextTokens),
			"agentic-session-rate": g(o.SessionRate, 'g', -1, 64), "tool-time": o.ToolTime.String(), "seed": strconv.FormatUint(o.Seed, 10)}
	case workloadRAG:
		o := w.rag
		d.Params = map[string]string{"rag-documents": strconv.Itoa(o.Documents), "rag-document-tokens": strconv.Itoa(o.DocumentTokens),
			"rag-docs-per-request": strconv.Itoa(o.DocsPerRequest), "zipf-s": g(o.ZipfS, 'g', -1, 64),
			"system-tokens": strconv.Itoa(o.SystemPromptTokens), "question-tokens-median": strconv.Itoa(o.QuestionTokens),
			"output-tokens-median": strconv.Itoa(o.OutputTokens), "rag-rate": g(o.Rate, 'g', -1, 64),
			"requests": strconv.Itoa(o.Requests), "seed": strconv.FormatUint(o.Seed, 10)}
	case workloadLongTail:
		o := w.tail
		d.Params = map[string]string{"prompt-tokens-median": strconv.Itoa(o.PromptTokens), "prompt-sigma": g(o.PromptSigma, 'g', -1, 64),
			"long-tail-prob": g(o.TailProb, 'g', -1, 64), "tail-tokens": strconv.Itoa(o.TailMinTokens) + "-" + strconv.Itoa(o.TailMaxTokens),
			"continue-prob": g(o.ContinueProb, 'g', -1, 64), "window": strconv.Itoa(o.Window), "append-tokens-median": strconv.Itoa(o.AppendTokens),
			"output-tokens-median": strconv.Itoa(o.OutputTokens), "long-tail-rate": g(o.Rate, 'g', -1, 64),
			"requests": strconv.Itoa(o.Requests), "seed": strconv.FormatUint(o.Seed, 10)}
	}
	for _, f := range files {
		sf, err := measure.DescribeFile(f)
		if err != nil {
			return nil, err
		}
		d.Files = append(d.Files, sf)
	}
	return d, nil
}
