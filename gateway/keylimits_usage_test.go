package gateway

import (
	"math"
	"testing"

	"github.com/infergate/infergate/openai"
)

// TestUsedTokensSaturates: the tokens a key is charged for a request are
// its usage's total, else prompt plus completion; an engine reporting
// negative or huge counts is read as 0 and saturated, never wrapped into
// a negative sum (which Settle would turn into a refund of the whole
// admission charge).
func TestUsedTokensSaturates(t *testing.T) {
	for _, tc := range []struct {
		u    openai.Usage
		want int
	}{
		{openai.Usage{PromptTokens: 10, CompletionTokens: 5, TotalTokens: 15}, 15},
		{openai.Usage{PromptTokens: 10, CompletionTokens: 5}, 15},
		{openai.Usage{PromptTokens: -10, CompletionTokens: 5}, 5},
		{openai.Usage{PromptTokens: 10, CompletionTokens: 5, TotalTokens: -1}, 15},
		{openai.Usage{PromptTokens: math.MaxInt, CompletionTokens: math.MaxInt}, math.MaxInt},
		{openai.Usage{PromptTokens: math.MaxInt - 1, CompletionTokens: 2}, math.MaxInt},
		{openai.Usage{PromptTokens: math.MinInt, CompletionTokens: math.MinInt}, 0},
	} {
		if got := usedTokens(&tc.u); got != tc.want {
			t.Errorf("usedTokens(%+v) = %d, want %d", tc.u, got, tc.want)
		}
	}
}
