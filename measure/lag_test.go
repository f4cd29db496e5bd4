package measure

import (
	"testing"
)

func ptr[T any](v T) *T { return &v }

// TestSendLagSummary: send lags are summarised over the records that have
// one; a closed loop (none) has no SendLag.
func TestSendLagSummary(t *testing.T) {
	recs := syntheticRecords()
	if s := Summarize("closed", recs); s.SendLag != nil {
		t.Errorf("no schedule: SendLag %+v", s.SendLag)
	}
	for i := range recs {
		recs[i].SendLagMs = ptr(float64(10 * i))
	}
	s := Summarize("open", recs)
	if l := s.SendLag; l == nil || l.Samples != int64(len(recs)) || l.Max != float64(10*(len(recs)-1)) || l.P50 != 15 {
		t.Errorf("SendLag %+v over %d records", l, len(recs))
	}
}
