package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/infergate/infergate/bench"
	"github.com/infergate/infergate/internal/redistest"
	"github.com/infergate/infergate/trace"
)

// TestReplicasKillLive is issue 17's kill target on live processes: a
// redis-server, four `infergate sim` engines, three `infergate serve`
// replicas sharing the Redis stream, and bench's replay dealing 200
// shared-prefix requests round robin per request over the replicas (as
// scripts/replicas-live.sh and `bench --target a,b,c --kill-pid` do).
// Replica 1 is killed with SIGKILL just before the middle request is sent.
// Every request must end (none hangs: the replay's context bounds it, and
// a request it cancels fails the test); every failure must be the killed
// replica's and explicit (a reset or refused connection, or a stream cut
// after its 200), never a survivor's. Nothing here is timed: how many
// requests the kill catches in flight depends on the host and is logged.
func TestReplicasKillLive(t *testing.T) {
	t.Parallel() // real processes, mostly waiting (see TestReplicasEndToEnd)
	srv := redistest.Start(t, 0)
	addrRe := regexp.MustCompile(`addr=(http://[0-9.:]+)`)
	const scale = 20 // the engines' time scale and the replay's speedup
	var eps []string
	for range 4 {
		s := start(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", fmt.Sprint(scale), "--model", "m")
		eps = append(eps, s.await(t, addrRe))
		defer s.stop(t)
	}
	dir := t.TempDir()
	var gws []*proc
	var bases []string
	for i := range 3 {
		cfg := "listen: 127.0.0.1:0\nhealth_check_path: \"-\"\nconnect_timeout: 1m\n"
		cfg += "routing: {policy: cache-aware, seed: 1, prefix: {block_size: 16}}\n"
		cfg += fmt.Sprintf("replicas: {redis_url: %q, stream: kill, id: gw-%d, load_interval: 100ms}\nendpoints:\n", srv.URL(), i)
		for _, e := range eps {
			cfg += fmt.Sprintf("  - {url: %q, model: m, kind: sim}\n", e)
		}
		path := filepath.Join(dir, fmt.Sprintf("gw%d.yaml", i))
		if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
		g := start(t, "serve", "-c", path, "--access-log=false")
		gws, bases = append(gws, g), append(bases, g.await(t, addrRe))
	}
	defer gws[0].stop(t)
	defer gws[2].stop(t)

	// 200 requests: 8 groups of 25 sharing a 1,024-token system prompt,
	// 64 output tokens each, 40 requests a second of engine time, so that
	// requests are in flight on every replica when the middle one is sent.
	opts := trace.DefaultSharedPrefixOptions()
	opts.Groups, opts.PromptsPerGroup, opts.SystemPromptTokens = 8, 25, 1024
	opts.QuestionTokens, opts.OutputTokens, opts.Rate = 64, 64, 40
	recs, err := trace.SharedPrefix(opts)
	if err != nil {
		t.Fatal(err)
	}
	const mid = 100
	var killed atomic.Bool
	var killErr error
	ctx, cancel := context.WithTimeout(context.Background(), 2*redistest.Wait)
	defer cancel()
	out, err := bench.Replay(ctx, bench.ReplayOptions{
		Targets: bases, Model: "m", Records: recs, Speedup: scale, TimeScale: scale,
		OnSend: func(i int) {
			if i == mid {
				killErr = gws[1].cmd.Process.Signal(syscall.SIGKILL)
				killed.Store(true)
			}
		},
	})
	if err != nil {
		t.Fatalf("replay: %v (a request hung past the replay's bound?)", err)
	}
	if !killed.Load() || killErr != nil {
		t.Fatalf("replica 1 not killed at request %d: %v", mid, killErr)
	}
	_ = gws[1].cmd.Wait()
	if len(out) != len(recs) {
		t.Fatalf("%d of %d requests recorded", len(out), len(recs))
	}
	var held, after, ok int
	for _, o := range bench.TargetOutcomes(bases, out) {
		if o.Target != bases[1] && o.Failed() > 0 {
			t.Errorf("survivor %s: %d of %d requests failed (first: %s); want none", o.Target, o.Failed(), o.Sent, o.FirstError)
		}
		if o.Cancelled > 0 {
			t.Errorf("%s: %d requests still unanswered when the replay ended", o.Target, o.Cancelled)
		}
	}
	for _, r := range out {
		switch {
		case r.Error == "":
			ok++
		case r.Target != bases[1]:
			// reported above
		case r.Status != 0 && r.Status != 200:
			t.Errorf("request %d on the killed replica: status %d %s; want a cut connection", r.Index, r.Status, r.Error)
		case r.Index < mid:
			held++
		default:
			after++ // sent on a kept-alive connection to the dead replica
		}
		if r.Error != "" && r.Target == bases[1] && strings.Contains(r.Error, context.Canceled.Error()) {
			t.Errorf("request %d on the killed replica hung: %s", r.Index, r.Error)
		}
	}
	t.Logf("%d served; on the killed replica %d in flight at the kill and %d sent after it on a dead connection failed explicitly", ok, held, after)
	// The survivors served the rest, refused connections to the dead
	// replica included (the front retries them on the next replica).
	if ok+held+after != len(out) {
		t.Errorf("%d served + %d + %d failed on the killed replica != %d requests", ok, held, after, len(out))
	}
}

// TestBenchKillFlags: --kill-pid needs several --target URLs and a
// --kill-target among them; --fleet goes with --target.
func TestBenchKillFlags(t *testing.T) {
	for _, c := range []struct {
		fl   benchFlags
		want string // "" accepted, else a part of the error
	}{
		{benchFlags{target: "http://a,http://b", killPID: 7, killTarget: 1, fleet: []string{"http://e"}}, ""},
		{benchFlags{target: "http://a", killPID: 7, killTarget: 1}, "several --target"},
		{benchFlags{target: "http://a,http://b", killPID: 7, killTarget: 2}, "--kill-target 2"},
		{benchFlags{target: "http://a,http://b", killPID: -1}, "--kill-pid -1"},
		{benchFlags{target: "http://a,http://b", killPID: 7, killTarget: 0, concurrency: 2}, "open loop"},
		{benchFlags{compare: "prefix", fleet: []string{"http://e"}}, "--fleet goes with --target"},
		{benchFlags{target: "http://a,http://b", killPID: os.Getpid(), killTarget: 1}, "bench itself"},
		{benchFlags{target: "http://a,http://b", killPID: os.Getppid(), killTarget: 1}, "bench itself"},
		{benchFlags{target: "http://a,http://b", killPID: 1, killTarget: 1}, "init"},
		{benchFlags{target: "http://a,,http://b"}, "URL 1 of 3 is empty"},
		{benchFlags{target: "http://a, "}, "URL 1 of 2 is empty"},
		{benchFlags{target: ","}, "URL 0 of 2 is empty"},
	} {
		_, err := c.fl.validate()
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%+v: %v", c.fl, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%+v: %v, want an error with %q", c.fl, err, c.want)
		}
	}
	if got := (&benchFlags{target: "http://a, http://b"}).targets(); len(got) != 2 || got[1] != "http://b" {
		t.Errorf("targets %q", got)
	}
}
