// Package data holds the public traces and text corpora that infergate's
// workloads, benchmarks and tests use, embedded in the binary so that
// `infergate bench` and `plan` run from any folder and a clone's tests need
// nothing beside the repository. Every file is a whole, unmodified copy of
// a public file; PROVENANCE.md gives each one's source (repository, path,
// commit, blob id), licence and schema, and NOTICE at the repository root
// the attributions. The files are about 3.8 MB in all.
package data

import (
	"embed"
	"fmt"
	"io/fs"
	"os"
	"strings"
)

// The embedded files, by name.
const (
	// Mooncake is Kimi's conversation trace (kvcache-ai/Mooncake, FAST'25):
	// 12,031 requests as timestamp, input/output lengths and chained
	// 512-token block hash ids. Apache-2.0.
	Mooncake = "mooncake_conversation_trace.jsonl"
	// Azure is the Azure LLM inference trace 2023, conversation part
	// (Splitwise, ISCA'24): arrival times and lengths only. CC-BY-4.0.
	Azure = "azure_llm2023_conv.csv"
	// Sonnet is vLLM's benchmarks/sonnet.txt (Shakespeare's sonnets, public
	// domain; the file Apache-2.0).
	Sonnet = "vllm_sonnet.txt"
	// MTBench is FastChat's MT-bench question.jsonl: 80 two-turn
	// questions. Apache-2.0.
	MTBench = "fastchat_mtbench_question.jsonl"
)

//go:embed mooncake_conversation_trace.jsonl azure_llm2023_conv.csv vllm_sonnet.txt fastchat_mtbench_question.jsonl
var files embed.FS

// Names lists the embedded files.
func Names() []string { return []string{Mooncake, Azure, Sonnet, MTBench} }

// Open opens the embedded file name (one of the constants above).
func Open(name string) (fs.File, error) {
	f, err := files.Open(name)
	if err != nil {
		return nil, fmt.Errorf("data: no embedded file %q (have %s)", name, strings.Join(Names(), ", "))
	}
	return f, nil
}

// ReadFile returns the contents of the embedded file name.
func ReadFile(name string) ([]byte, error) {
	b, err := files.ReadFile(name)
	if err != nil {
		return nil, fmt.Errorf("data: no embedded file %q (have %s)", name, strings.Join(Names(), ", "))
	}
	return b, nil
}

// Embedded is the prefix that names an embedded file where a path is
// expected: "embedded:mooncake_conversation_trace.jsonl".
const Embedded = "embedded:"

// ReadPath reads path from disk, or the embedded file it names when it
// starts with Embedded.
func ReadPath(path string) ([]byte, error) {
	if name, ok := strings.CutPrefix(path, Embedded); ok {
		return ReadFile(name)
	}
	return os.ReadFile(path)
}
