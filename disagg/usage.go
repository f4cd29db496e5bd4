package disagg

import (
	"bytes"
	"strconv"
)

var (
	usageKey   = []byte(`"usage"`)
	detailsKey = "prompt_tokens_details"
)

// RewriteCached appends to dst the response or stream chunk data with its
// usage.prompt_tokens_details.cached_tokens set to cached, P's count, as
// llm-d's routing sidecar rewrites D's usage (D counts the prompt it
// received from P as cached). It reports false, appending nothing, when
// data has no usage object (a chunk with usage null) or cannot be edited;
// D's prompt_tokens_details null (vLLM's when 0) stays null when cached is
// 0 and becomes {"cached_tokens": cached} otherwise.
func RewriteCached(dst, data []byte, cached int) ([]byte, bool) {
	if !bytes.Contains(data, usageKey) || checkObject(data) != nil {
		return dst, false
	}
	usage, ok := lookup(data, "usage")
	if !ok || len(usage) == 0 || usage[0] != '{' {
		return dst, false
	}
	n := strconv.AppendInt(nil, int64(max(cached, 0)), 10)
	details, ok := lookup(usage, detailsKey)
	var nd []byte
	switch {
	case ok && len(details) > 0 && details[0] == '{':
		var err error
		if nd, err = edit(nil, details, []field{{"cached_tokens", n}}); err != nil {
			return dst, false
		}
	case cached <= 0:
		return dst, false // null (or absent) already says 0
	default:
		nd = append(append([]byte(`{"cached_tokens":`), n...), '}')
	}
	nu, err := edit(nil, usage, []field{{detailsKey, nd}})
	if err != nil {
		return dst, false
	}
	out, err := edit(dst, data, []field{{"usage", nu}})
	if err != nil {
		return dst, false
	}
	return out, true
}

// AnswerCached is PromptCached of an answer whole or streamed (SGLang's P
// gets the client's body, stream included): a stream's last event with
// usage counts.
func AnswerCached(resp []byte) (int, bool) {
	if c, ok := PromptCached(resp); ok {
		return c, true
	}
	c, ok := 0, false
	for line := range bytes.Lines(resp) {
		d, found := bytes.CutPrefix(bytes.TrimSpace(line), []byte("data:"))
		if !found {
			continue
		}
		if n, has := PromptCached(bytes.TrimSpace(d)); has {
			c, ok = n, true
		}
	}
	return c, ok
}
