package bench

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/trace"
)

// TestReplayTargets deals requests round robin over several targets, one
// of which refuses connections: its requests are taken by the next target
// (as an L4 front's connect retry), each record names the target that
// answered, and OnSend sees every request once.
func TestReplayTargets(t *testing.T) {
	a := &fakeEngine{}
	b := &fakeEngine{}
	sa, sb := httptest.NewServer(a), httptest.NewServer(b)
	defer sa.Close()
	defer sb.Close()
	// A closed port: connections to it are refused.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	ln.Close()

	var recs []trace.Record
	for i := range 6 {
		recs = append(recs, trace.Record{Timestamp: time.Duration(i) * time.Millisecond, InputLength: 16, OutputLength: 2, HashIDs: []int64{int64(i)}})
	}
	var mu sync.Mutex
	sent := map[int]int{}
	targets := []string{sa.URL, dead, sb.URL}
	got, err := Replay(context.Background(), ReplayOptions{
		Targets: targets, Model: "m", Records: recs, APIKey: "k", Speedup: 1000,
		OnSend: func(i int) { mu.Lock(); sent[i]++; mu.Unlock() },
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 6 {
		t.Fatalf("%d records, want 6", len(got))
	}
	// Request i goes to targets[i mod 3]; the dead one's (1 and 4) to the next.
	want := []string{sa.URL, sb.URL, sb.URL, sa.URL, sb.URL, sb.URL}
	for i, r := range got {
		if r.Error != "" || r.Target != want[i] {
			t.Errorf("request %d: target %q error %q, want %q and no error", i, r.Target, r.Error, want[i])
		}
		if sent[i] != 1 {
			t.Errorf("request %d: OnSend called %d times, want 1", i, sent[i])
		}
	}
	if len(a.reqs) != 2 || len(b.reqs) != 4 {
		t.Errorf("a served %d, b %d; want 2 and 4", len(a.reqs), len(b.reqs))
	}
	out := TargetOutcomes(targets, got)
	if out[0].Sent != 2 || out[0].OK != 2 || out[1].Sent != 0 || out[2].Sent != 4 || out[2].OK != 4 {
		t.Errorf("outcomes %+v", out)
	}
}

// TestTargetOutcomes classifies failures: no response, a broken stream
// after 200, an error status, and a request cancelled unanswered.
func TestTargetOutcomes(t *testing.T) {
	recs := []measure.Record{
		{Target: "a", Status: 200},
		{Target: "a", Status: 0, Error: "Post \"http://a\": read: connection reset by peer"},
		{Target: "b", Status: 200, Error: "read stream: unexpected EOF"},
		{Target: "b", Status: 503, Error: "status 503: overloaded"},
		{Target: "b", Status: 0, Error: "Post \"http://b\": context deadline exceeded"},
		{Target: "c", Status: 200},
	}
	out := TargetOutcomes([]string{"a", "b"}, recs)
	if len(out) != 3 {
		t.Fatalf("%d outcomes, want 3 (a, b and the unlisted c)", len(out))
	}
	a, b, c := out[0], out[1], out[2]
	if a.Sent != 2 || a.OK != 1 || a.NoResponse != 1 || a.Failed() != 1 || !strings.Contains(a.FirstError, "reset") {
		t.Errorf("a: %+v", a)
	}
	if b.Sent != 3 || b.OK != 0 || b.Broken != 1 || b.Status != 1 || b.Cancelled != 1 || b.NoResponse != 0 {
		t.Errorf("b: %+v", b)
	}
	if c.Target != "c" || c.Sent != 1 || c.OK != 1 {
		t.Errorf("c: %+v", c)
	}
	var sb strings.Builder
	if err := WriteTargetOutcomes(&sb, out); err != nil || strings.Count(sb.String(), "\n") != 4 {
		t.Errorf("table %q, %v", sb.String(), err)
	}
}

// TestScrapeStepLag merges two engines' step-lag histograms and reads the
// quantiles as bucket upper bounds (ms).
func TestScrapeStepLag(t *testing.T) {
	page := func(b1, b2, b3, inf int) string {
		return fmt.Sprintf(`# HELP infergate_sim_step_lag_seconds lag
# TYPE infergate_sim_step_lag_seconds histogram
infergate_sim_step_lag_seconds_bucket{le="0.001"} %d
infergate_sim_step_lag_seconds_bucket{le="0.1"} %d
infergate_sim_step_lag_seconds_bucket{le="1"} %d
infergate_sim_step_lag_seconds_bucket{le="+Inf"} %d
infergate_sim_step_lag_seconds_sum 1
infergate_sim_step_lag_seconds_count %d
`, b1, b2, b3, inf, inf)
	}
	pages := []string{page(60, 99, 100, 100), page(40, 99, 99, 100)}
	var srvs []string
	for _, p := range pages {
		s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, p) }))
		defer s.Close()
		srvs = append(srvs, s.URL)
	}
	lag, err := ScrapeStepLag(context.Background(), http.DefaultClient, srvs)
	if err != nil {
		t.Fatal(err)
	}
	// 200 steps: 100 within 1 ms, 198 within 100 ms, 199 within 1 s, one past.
	if lag.Samples != 200 || lag.P50 != 1 || lag.P99 != 100 || lag.Max != 1000 {
		t.Errorf("lag %+v, want 200 steps, p50 1, p99 100, max 1000 (the last finite bound)", lag)
	}
	empty := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, page(0, 0, 0, 0)) }))
	defer empty.Close()
	if lag, err := ScrapeStepLag(context.Background(), http.DefaultClient, []string{empty.URL}); err != nil || lag != nil {
		t.Errorf("no steps: %+v, %v; want nil, nil", lag, err)
	}
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "up 1\n") }))
	defer other.Close()
	if _, err := ScrapeStepLag(context.Background(), http.DefaultClient, []string{other.URL}); err == nil {
		t.Error("a page without the histogram: no error")
	}
}

// TestReplayDuplicateTargets: a URL given twice, in any of the forms
// CompletionsURL accepts, is refused before any request is sent (it was
// dealt twice the requests, and TargetOutcomes showed one of its
// positions with all of them, the other with none).
func TestReplayDuplicateTargets(t *testing.T) {
	e := &fakeEngine{}
	s := httptest.NewServer(e)
	defer s.Close()
	other := httptest.NewServer(&fakeEngine{})
	defer other.Close()
	recs := []trace.Record{{InputLength: 16, OutputLength: 2, HashIDs: []int64{1}}}
	for _, targets := range [][]string{
		{s.URL, s.URL},
		{s.URL, other.URL, s.URL + "/v1/"},
		{s.URL + "/", other.URL, s.URL + "/v1"},
	} {
		_, err := Replay(context.Background(), ReplayOptions{Targets: targets, Model: "m", Records: recs, APIKey: "k"})
		if err == nil || !strings.Contains(err.Error(), "same endpoint") {
			t.Errorf("%q: err %v, want the duplicate refused", targets, err)
		}
	}
	if len(e.reqs) != 0 {
		t.Fatalf("%d requests sent", len(e.reqs))
	}
}
