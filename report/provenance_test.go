package report

import (
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/measure"
)

func TestShellQuote(t *testing.T) {
	got := ShellQuote([]string{"infergate", "plan", "--slo", "ttft_p90=2s,goodput>=0.9", "it's", ""})
	if want := `infergate plan --slo 'ttft_p90=2s,goodput>=0.9' 'it'\''s' ''`; got != want {
		t.Errorf("ShellQuote: %s, want %s", got, want)
	}
}

// TestProvenanceFacts: the facts say a build from a modified tree is
// modified and show the command redacted.
func TestProvenanceFacts(t *testing.T) {
	p := measure.NewProvenance("v1.2.3 (abc, go1.x)", []string{"infergate", "bench", "--api-key", "secret-value"}, time.Now())
	p.Revision, p.RevisionTime, p.Modified = "0123456789abcdef0123456789abcdef01234567", "2026-01-01T00:00:00Z", true
	facts := map[string]string{}
	for _, f := range ProvenanceFacts(p) {
		facts[f.Field] = f.Value
	}
	if !strings.Contains(facts["revision"], "modified") || facts["command"] != "infergate bench --api-key "+measure.Redacted {
		t.Errorf("facts %v", facts)
	}
}
