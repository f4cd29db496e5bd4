package bench

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/trace"
)

// TestReplayStalledTargets: of three targets, one accepts requests and
// never answers, one answers 200 and a first chunk and then falls silent;
// Replay ends (bounded by ReplayOptions.HeaderTimeout and IdleTimeout, not
// the context) with their requests failed as stalled, naming the bound,
// and the healthy target's requests served. Before the bounds, Replay
// waited on the hung targets until its context ended (forever for bench).
func TestReplayStalledTargets(t *testing.T) {
	release := make(chan struct{})
	hung := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		select { // the test's end, not the client's: it hangs up on us
		case <-release:
		case <-r.Context().Done():
		}
	}))
	silent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	good := httptest.NewServer(&fakeEngine{})
	defer good.Close()
	defer silent.Close()
	defer hung.Close()
	defer close(release) // before the servers close: their handlers return

	var recs []trace.Record
	for i := range 6 {
		recs = append(recs, trace.Record{Timestamp: time.Duration(i) * time.Millisecond, InputLength: 16, OutputLength: 2, HashIDs: []int64{int64(i)}})
	}
	targets := []string{hung.URL, silent.URL, good.URL}
	type result struct {
		n   int
		err error
		out []TargetOutcome
		msg [2]string
	}
	done := make(chan result, 1)
	go func() {
		got, err := Replay(context.Background(), ReplayOptions{
			Targets: targets, Model: "m", Records: recs, APIKey: "k", Speedup: 1000,
			HeaderTimeout: 50 * time.Millisecond, IdleTimeout: 50 * time.Millisecond,
		})
		res := result{n: len(got), err: err, out: TargetOutcomes(targets, got)}
		if len(got) == 6 {
			res.msg = [2]string{got[0].Error, got[1].Error}
		}
		done <- res
	}()
	var res result
	select {
	case res = <-done:
	case <-time.After(time.Minute): // a hang bound, not a timing claim
		t.Fatal("Replay still waiting on hung targets after a minute")
	}
	if res.err != nil || res.n != 6 {
		t.Fatalf("%d records, err %v", res.n, res.err)
	}
	if !strings.Contains(res.msg[0], "no response header within 50ms") || !strings.Contains(res.msg[1], "stream silent for 50ms") {
		t.Errorf("errors %q", res.msg)
	}
	want := []TargetOutcome{{Sent: 2, Stalled: 2}, {Sent: 2, Stalled: 2}, {Sent: 2, OK: 2}}
	for k, o := range res.out {
		o.Target, o.FirstError = "", ""
		if o != want[k] {
			t.Errorf("target %d: %+v, want %+v", k, o, want[k])
		}
	}
}
