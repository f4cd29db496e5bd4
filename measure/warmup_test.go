package measure

import (
	"testing"
	"time"
)

func TestWarmupSummary(t *testing.T) {
	recs := []Record{
		{ArrivalMs: 0, E2EMs: 5000, TTFTMs: 4000, PromptTokens: 10, OutputTokens: 1},
		{ArrivalMs: 100, E2EMs: 100, TTFTMs: 50, PromptTokens: 10, OutputTokens: 1},
		{ArrivalMs: 1000, E2EMs: 1000, TTFTMs: 10, PromptTokens: 10, OutputTokens: 4},
		{ArrivalMs: 1500, E2EMs: 1500, TTFTMs: 20, PromptTokens: 10, OutputTokens: 6},
	}
	(Warmup{Requests: 1}).Mark(recs)
	if !recs[0].Warmup || recs[1].Warmup {
		t.Fatalf("warmup 1: marks %v %v", recs[0].Warmup, recs[1].Warmup)
	}
	(Warmup{Duration: time.Second}).Mark(recs)
	if !recs[0].Warmup || !recs[1].Warmup || recs[2].Warmup || recs[3].Warmup {
		t.Fatal("warmup 1s: wrong marks")
	}
	s := Summarize("p", recs)
	if s.Requests != 2 || s.WarmupRequests != 2 || s.OutputTokens != 10 || s.TTFT.P50 != 15 {
		t.Errorf("summary %+v", s)
	}
	// The measured window: 1000 ms → 3000 ms, not the warm-up's 5000 ms.
	if s.DurationS != 2 || s.OutputTokPerS != 5 {
		t.Errorf("duration %v s, %v tok/s; want 2 s, 5 tok/s", s.DurationS, s.OutputTokPerS)
	}
	(Warmup{}).Mark(recs)
	if s := Summarize("p", recs); s.Requests != 4 || s.WarmupRequests != 0 || s.DurationS != 5 {
		t.Errorf("no warm-up: %+v", s)
	}
	if (Warmup{Requests: -1}).Validate() == nil {
		t.Error("negative warm-up accepted")
	}
}
