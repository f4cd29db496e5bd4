package virtual

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/infergate/infergate/trace"
)

// replicaRecords is a small multi-turn workload: sessions whose turns
// extend the previous prompt, arriving 100 ms apart, so that the round-
// robin front sends consecutive turns of a session to different replicas.
func replicaRecords() []trace.Record { return sessionRecords(25, 5) }

// sessionRecords is replicaRecords' workload with the given numbers of
// sessions and turns: a session's turns come sessions × 100 ms apart.
func sessionRecords(sessions, turns int) []trace.Record {
	var recs []trace.Record
	for turn := range turns {
		for s := range sessions {
			var ids []int64
			for b := 0; b <= 8*(turn+1); b++ {
				ids = append(ids, int64(s*1000+b))
			}
			recs = append(recs, trace.Record{
				Timestamp:    time.Duration(len(recs)) * 100 * time.Millisecond,
				InputLength:  len(ids) * 512,
				OutputLength: 8,
				HashIDs:      ids,
			})
		}
	}
	return recs
}

func replay(t *testing.T, o ReplayOptions) ReplayResult {
	t.Helper()
	o.Records, o.Engines = replicaRecords(), 4
	run, err := Replay(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	return run
}

// TestReplicasShareAffinity: three replicas behind a round-robin front
// keep a single gateway's hit rate when they exchange what they learn,
// and lose it when they do not.
func TestReplicasShareAffinity(t *testing.T) {
	one := replay(t, ReplayOptions{})
	shared := replay(t, ReplayOptions{Replicas: 3, ReplicaSync: true, ReplicaDelay: 5 * time.Millisecond})
	unshared := replay(t, ReplayOptions{Replicas: 3})
	checkSharedHitRate(t, one, shared, unshared)
	seen := map[int]bool{}
	for _, r := range shared.Replica {
		seen[r] = true
	}
	if len(seen) != 3 {
		t.Errorf("replicas used: %v", seen)
	}
}

// TestReplicasSharePreciseAffinity: precise-prefix replicas whose
// engines' KV events come late (10 s after their steps) keep a single
// gateway's hit rate when they exchange their picks: a peer's pick counts
// as held in the precise match until the TTL (sched.Profile.LearnPeer into
// the speculative entries; the profile has no approximate index since
// 2026-12-06), as their own picks do; without the exchange each replica
// sees only its own.
func TestReplicasSharePreciseAffinity(t *testing.T) {
	// Sessions whose turns come 500 ms apart (inside the 2 s TTL), dealt
	// round robin over the replicas.
	recs := sessionRecords(5, 6)
	run := func(o ReplayOptions) ReplayResult {
		o.Records, o.Engines, o.Policy, o.TrackPrecise, o.KVEventDelay = recs, 4, "precise-prefix", true, 10*time.Second
		r, err := Replay(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	one := run(ReplayOptions{})
	shared := run(ReplayOptions{Replicas: 3, ReplicaSync: true, ReplicaDelay: 5 * time.Millisecond})
	unshared := run(ReplayOptions{Replicas: 3})
	if one.Summary.HitRate < 0.5 {
		t.Fatalf("one replica's hit rate %.3f: the speculative entries do not bridge the events' delay", one.Summary.HitRate)
	}
	checkSharedHitRate(t, one, shared, unshared)
}

// checkSharedHitRate: replicas that exchange their picks keep 95% of one
// gateway's hit rate, and those that do not lose at least 5 points more.
func checkSharedHitRate(t *testing.T, one, shared, unshared ReplayResult) {
	t.Helper()
	t.Logf("hit rate: one %.3f, shared %.3f, unshared %.3f", one.Summary.HitRate, shared.Summary.HitRate, unshared.Summary.HitRate)
	if shared.Summary.HitRate < 0.95*one.Summary.HitRate {
		t.Errorf("shared hit rate %.3f < 95%% of one replica's %.3f", shared.Summary.HitRate, one.Summary.HitRate)
	}
	if unshared.Summary.HitRate > shared.Summary.HitRate-0.05 {
		t.Errorf("unshared hit rate %.3f not clearly below shared %.3f", unshared.Summary.HitRate, shared.Summary.HitRate)
	}
}

// TestReplicasPDShareAffinity: three replicas of a P/D fleet (2 prefill,
// 2 decode engines) keep one gateway's hit rate when they exchange their
// P/D picks (D's and P's learns: replica.KindLearnPD) and lose it when
// they do not; a replica killed mid-replay fails only its own requests,
// split ones included (their prefill legs are aborted with them).
func TestReplicasPDShareAffinity(t *testing.T) {
	pd := ReplayOptions{Prefill: 2}
	pd.Routing.PD.Threshold = 1024
	run := func(o ReplayOptions) ReplayResult {
		o.Prefill, o.Routing = pd.Prefill, pd.Routing
		return replay(t, o)
	}
	one := run(ReplayOptions{})
	shared := run(ReplayOptions{Replicas: 3, ReplicaSync: true, ReplicaDelay: 5 * time.Millisecond})
	unshared := run(ReplayOptions{Replicas: 3})
	t.Logf("P/D hit rate: one %.3f, shared %.3f, unshared %.3f", one.Summary.HitRate, shared.Summary.HitRate, unshared.Summary.HitRate)
	if one.Summary.HitRate < 0.3 {
		t.Fatalf("one gateway's hit rate %.3f: the sessions' turns do not reuse their prefixes", one.Summary.HitRate)
	}
	if shared.Summary.HitRate < 0.95*one.Summary.HitRate {
		t.Errorf("shared hit rate %.3f < 95%% of one replica's %.3f", shared.Summary.HitRate, one.Summary.HitRate)
	}
	if unshared.Summary.HitRate > shared.Summary.HitRate-0.05 {
		t.Errorf("unshared hit rate %.3f not clearly below shared %.3f", unshared.Summary.HitRate, shared.Summary.HitRate)
	}
	mid := len(replicaRecords()) / 2
	killed := run(ReplayOptions{Replicas: 3, ReplicaSync: true, ReplicaDelay: 5 * time.Millisecond, KillAtRequest: mid, KillReplica: 1})
	failed := 0
	for i, rec := range killed.Records {
		switch {
		case rec.Status == 502:
			failed++
			if killed.Replica[i] != 1 || i >= mid {
				t.Errorf("request %d of replica %d failed with the kill", i, killed.Replica[i])
			}
		case rec.Status != 200:
			t.Errorf("request %d: status %d %s", i, rec.Status, rec.Error)
		}
	}
	if failed == 0 {
		t.Error("no request was in flight on the killed replica")
	}
}

// TestReplicaKill: a replica killed mid-replay fails exactly the requests
// it held; the others are served and the survivors keep affinity.
func TestReplicaKill(t *testing.T) {
	recs := replicaRecords()
	mid := len(recs) / 2
	shared := replay(t, ReplayOptions{Replicas: 3, ReplicaSync: true, ReplicaDelay: 5 * time.Millisecond})
	killed := replay(t, ReplayOptions{Replicas: 3, ReplicaSync: true, ReplicaDelay: 5 * time.Millisecond, KillAtRequest: mid, KillReplica: 1})
	failed := 0
	for i, rec := range killed.Records {
		switch {
		case rec.Status == 502:
			failed++
			if killed.Replica[i] != 1 || i >= mid {
				t.Errorf("request %d of replica %d failed with the kill", i, killed.Replica[i])
			}
		case rec.Status != 200:
			t.Errorf("request %d: status %d %s", i, rec.Status, rec.Error)
		case i >= mid && killed.Replica[i] == 1:
			t.Errorf("request %d went to the killed replica", i)
		}
	}
	if failed == 0 {
		t.Error("no request was in flight on the killed replica")
	}
	// The sessions of a failed turn lose that turn's KV (the engine never
	// computed it): left out, the survivors' hit rate measures affinity.
	lost := map[int]bool{}
	for i, rec := range killed.Records {
		if rec.Status == 502 {
			lost[i%25] = true
		}
	}
	after := func(run ReplayResult) float64 {
		var p, c int
		for i, rec := range run.Records[mid:] {
			if rec.Status == 200 && !lost[(mid+i)%25] {
				p, c = p+rec.PromptTokens, c+rec.CachedTokens
			}
		}
		return float64(c) / float64(p)
	}
	t.Logf("%d failed; hit rate after the kill %.3f, without it %.3f", failed, after(killed), after(shared))
	if after(killed) < after(shared)-0.01 {
		t.Errorf("survivors' hit rate %.3f more than a point below %.3f", after(killed), after(shared))
	}
}

func TestReplicasConfig(t *testing.T) {
	for name, c := range map[string]Config{
		"kill one":     {Engines: 2, Replicas: 1, KillAt: time.Second},
		"kill beyond":  {Engines: 2, Replicas: 2, KillAt: time.Second, KillReplica: 2},
		"given policy": {Engines: 2, Replicas: 2, Policy: mustPolicy(t)},
	} {
		if _, err := NewFleet(c); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestReplicasBurst: requests that reach three replicas at one instant —
// six cold prompts of one size every 3 s, for six engines — are spread as
// one gateway spreads them, one per engine, not sent by every replica to
// the endpoints that look least loaded to it (replica.Node.Expect: the
// unseen load water-filled, each replica's share preferred among ties).
func TestReplicasBurst(t *testing.T) {
	var recs []trace.Record
	for burst := range 10 {
		for k := range 6 {
			var ids []int64
			for b := range 8 {
				ids = append(ids, int64(burst*10_000+k*100+b))
			}
			recs = append(recs, trace.Record{Timestamp: time.Duration(burst) * 3 * time.Second,
				InputLength: len(ids) * 512, OutputLength: 4, HashIDs: ids})
		}
	}
	worst := func(o ReplayOptions) int {
		o.Records, o.Engines = recs, 6
		run, err := Replay(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		doubled := 0 // requests beyond the first on an engine, over the bursts
		for burst := range 10 {
			per := map[int]int{}
			for _, e := range run.Engine[burst*6 : burst*6+6] {
				if per[e]++; per[e] > 1 {
					doubled++
				}
			}
		}
		return doubled
	}
	one := worst(ReplayOptions{})
	shared := worst(ReplayOptions{Replicas: 3, ReplicaSync: true, ReplicaDelay: time.Millisecond})
	unshared := worst(ReplayOptions{Replicas: 3})
	t.Logf("requests of a burst sent to an engine that already had one of it, over 10 bursts of 6: one gateway %d, 3 shared replicas %d, 3 unshared %d", one, shared, unshared)
	if one != 0 || shared > 3 {
		t.Errorf("doubled up: one gateway %d, three shared replicas %d; want 0 and at most 3 of 60", one, shared)
	}
	if unshared < 20 {
		t.Errorf("unshared replicas did not herd (%d): the test no longer shows what sharing prevents", unshared)
	}
}

// TestReplicasStagger: replicas whose decisions come in bursts take turns
// (replica.Node.Stagger). In bursts of 6 cold requests on 6 idle-again
// engines, three staggered replicas, once they have measured the exchange
// and seen their bursts, send each burst where one gateway does: one per
// engine; each decision of the replica ranked r waits for the learns of
// the replica ranked r−1, r deliveries of 1 ms (replica.Node.Due), never
// its deadline; one replica and arrivals spread in time are unchanged
// (but for the first decisions of each replica, which start as if
// bursty).
func TestReplicasStagger(t *testing.T) {
	const nb, per = 30, 6
	var recs []trace.Record
	for burst := range nb {
		for k := range per {
			var ids []int64
			for b := range 8 {
				ids = append(ids, int64(burst*10_000+k*100+b))
			}
			recs = append(recs, trace.Record{Timestamp: time.Duration(burst) * 3 * time.Second,
				InputLength: len(ids) * 512, OutputLength: 4, HashIDs: ids})
		}
	}
	run := func(o ReplayOptions) ReplayResult {
		o.Records, o.Engines = recs, per
		r, err := Replay(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	doubled := func(r ReplayResult, from int) int {
		n := 0
		for burst := from; burst < nb; burst++ {
			seen := map[int]bool{}
			for _, e := range r.Engine[burst*per : burst*per+per] {
				if seen[e] {
					n++
				}
				seen[e] = true
			}
		}
		return n
	}
	sync := ReplayOptions{Replicas: 3, ReplicaSync: true, ReplicaDelay: time.Millisecond}
	staggered := run(sync)
	sync.ReplicaNoStagger = true
	unstaggered := run(sync)
	one := run(ReplayOptions{})
	// The last 20 bursts: each replica has seen 10 of its bursts by then.
	s, u, o := doubled(staggered, 10), doubled(unstaggered, 10), doubled(one, 10)
	t.Logf("requests of a burst sent to an engine that already had one of it, last 20 bursts of 6: one gateway %d, staggered %d, unstaggered %d", o, s, u)
	if o != 0 || s != 0 {
		t.Errorf("doubled up: one gateway %d, three staggered replicas %d; want 0 and 0", o, s)
	}
	// The waits: TTFT over one gateway's by the replica's rank × 1 ms
	// (replica-0 < replica-1 < replica-2 by id), the deliveries.
	for k := 10 * per; k < nb*per; k++ {
		want := time.Duration(staggered.Replica[k]) * time.Millisecond
		got := time.Duration((staggered.Records[k].TTFTMs - one.Records[k].TTFTMs) * float64(time.Millisecond))
		if d := got - want; d < -time.Microsecond || d > time.Microsecond {
			t.Errorf("request %d (replica %d): TTFT %.4f ms, one gateway's %.4f ms: waited %v, want %v",
				k, staggered.Replica[k], staggered.Records[k].TTFTMs, one.Records[k].TTFTMs, got, want)
			break
		}
	}
	if st := staggered.Stagger; len(st) != 3 || st[0] != (StaggerStats{}) || st[1].Deadline != 0 || st[2].Deadline != 0 ||
		st[1].Learns != nb*2 || st[2].Learns != nb*2 || st[1].Wait != nb*2*time.Millisecond || st[2].Wait != nb*2*2*time.Millisecond {
		t.Errorf("turns per replica %+v: want replica 1's and 2's %d decisions released by learns after 1 and 2 ms each", st, nb*2)
	}
	// Arrivals spread 1 s apart stop waiting within each replica's first
	// 30 decisions (a replica starts as if bursty: replica.Unseen.Seed),
	// and the first ones wait no more than their rank's turn.
	for i := range recs {
		recs[i].Timestamp = time.Duration(i) * time.Second
	}
	sync.ReplicaNoStagger = false
	spread, unst := run(sync), func() ReplayResult { o := sync; o.ReplicaNoStagger = true; return run(o) }()
	for k := range spread.Records {
		waited := spread.Records[k].TTFTMs - unst.Records[k].TTFTMs
		if k < 90 && spread.Engine[k] == unst.Engine[k] && waited >= 0 && waited <= float64(spread.Replica[k])*3+1e-6 { // at most the deadline (rank × 3 delays)
			continue
		}
		if spread.Records[k].TTFTMs != unst.Records[k].TTFTMs || spread.Engine[k] != unst.Engine[k] {
			t.Fatalf("spread arrivals: request %d staggered TTFT %.3f ms on %d, unstaggered %.3f ms on %d",
				k, spread.Records[k].TTFTMs, spread.Engine[k], unst.Records[k].TTFTMs, unst.Engine[k])
		}
	}
}

// TestReplicasStaggerLoaded: bursts of 9 cold prompts of 1k to 8k tokens
// a second on 8 busy engines, as on the Mooncake trace's whole-second
// timestamps: three staggered replicas' TTFT p90 is nearer one gateway's
// than unstaggered replicas', which herd within each burst.
func TestReplicasStaggerLoaded(t *testing.T) {
	const nb, per = 60, 9
	var recs []trace.Record
	x := uint64(1)
	for burst := range nb {
		for k := range per {
			x = x*6364136223846793005 + 1442695040888963407
			n := 2 + int(x>>33)%15 // 2..16 blocks of 512 tokens
			ids := make([]int64, n)
			for b := range ids {
				ids[b] = int64(burst*100_000 + k*1000 + b)
			}
			recs = append(recs, trace.Record{Timestamp: time.Duration(burst) * time.Second,
				InputLength: n * 512, OutputLength: 16, HashIDs: ids})
		}
	}
	p90 := func(o ReplayOptions) float64 {
		o.Records, o.Engines = recs, 8
		r, err := Replay(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		return r.Summary.TTFT.P90
	}
	sync := ReplayOptions{Replicas: 3, ReplicaSync: true, ReplicaDelay: time.Millisecond}
	staggered := p90(sync)
	sync.ReplicaNoStagger = true
	unstaggered := p90(sync)
	one := p90(ReplayOptions{})
	t.Logf("TTFT p90: one gateway %.0f ms, 3 replicas staggered %.0f ms, unstaggered %.0f ms", one, staggered, unstaggered)
	if staggered >= unstaggered {
		t.Errorf("staggered replicas' TTFT p90 %.0f ms not below unstaggered %.0f ms", staggered, unstaggered)
	}
}

// TestReplicasFirstBurst: the replay's very first instant is a burst —
// twelve cold prompts for six engines at once — and three staggered
// replicas take turns in it from their first decision (the exchange's
// delay seeded, peers known before traffic: replica.Unseen.Seed): the
// replica ranked r waits r deliveries of the learns, and no engine gets a third
// request while another has fewer than two, as with one gateway.
func TestReplicasFirstBurst(t *testing.T) {
	var recs []trace.Record
	for k := range 12 {
		var ids []int64
		for b := range 8 {
			ids = append(ids, int64(k*100+b))
		}
		recs = append(recs, trace.Record{InputLength: len(ids) * 512, OutputLength: 4, HashIDs: ids})
	}
	run := func(o ReplayOptions) ReplayResult {
		o.Records, o.Engines = recs, 6
		r, err := Replay(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	one := run(ReplayOptions{})
	staggered := run(ReplayOptions{Replicas: 3, ReplicaSync: true, ReplicaDelay: time.Millisecond})
	per := func(r ReplayResult) []int {
		n := make([]int, 6)
		for _, e := range r.Engine {
			n[e]++
		}
		return n
	}
	t.Logf("requests per engine: one gateway %v, three staggered replicas %v", per(one), per(staggered))
	for _, c := range per(staggered) {
		if c != 2 {
			t.Fatalf("staggered replicas: %v requests per engine, want 2 each", per(staggered))
		}
	}
	// Requests 1 and 2 are replicas 1's and 2's first decisions: each
	// waited its rank's turn before it was decided.
	for k := 1; k <= 2; k++ {
		want := float64(staggered.Replica[k]) * 1.0
		if got := staggered.Records[k].TTFTMs - one.Records[k].TTFTMs; staggered.Replica[k] != k || got < want-1e-6 {
			t.Errorf("request %d (replica %d): TTFT %.4f ms over one gateway's, want at least %.2f ms (its turn)", k, staggered.Replica[k], got, want)
		}
	}
}

// TestReplicasShareFinish: with learn_on_finish (the default) every
// request's end reaches the other replicas (replica.KindFinish), each
// peer's learn is pinned until its finish comes, and none is left pinned
// when the replay ends; a killed replica's requests in flight never
// finish, and the survivors release their pins once it is silent for
// LoadTTL.
func TestReplicasShareFinish(t *testing.T) {
	recs := replicaRecords()
	reqs := make([]Request, len(recs))
	for i := range recs {
		reqs[i] = Request{Arrival: recs[i].Timestamp, Prompt: recs[i].Tokens, MaxTokens: 8}
	}
	for _, kill := range []bool{false, true} {
		cfg := Config{Engines: 4, Replicas: 3, ReplicaSync: true, ReplicaDelay: 5 * time.Millisecond}
		if kill {
			cfg.KillAt, cfg.KillReplica = recs[len(recs)/2].Timestamp, 1
		}
		f, err := NewFleet(cfg)
		if err != nil {
			t.Fatal(err)
		}
		res, err := f.Run(reqs)
		if err != nil {
			t.Fatal(err)
		}
		// Run returns with the last requests' end: their finishes are
		// still in transit, delivered here as the live exchange would.
		if n := len(f.rx.msgs); n > 0 {
			f.exchange(f.rx.msgs[n-1].at)
		}
		ended := make([]uint64, len(f.reps)) // requests each replica saw end
		for _, r := range res {
			if r.Err == nil {
				ended[r.Replica]++
			}
		}
		for i, rp := range f.reps {
			if !rp.alive {
				continue
			}
			var want uint64
			for j := range f.reps {
				if j != i {
					want += ended[j]
				}
			}
			c := &rp.node.Counts
			pins, hashes := rp.node.Pinned()
			t.Logf("kill %v, replica %d: %d finishes applied (peers ended %d), %d pins of %d hashes left, %d expired",
				kill, i, c.Finishes.Load(), want, pins, hashes, c.PinsExpired.Load())
			if c.Finishes.Load() != want {
				t.Errorf("kill %v, replica %d: %d peers' finishes applied, want %d", kill, i, c.Finishes.Load(), want)
			}
			if pins != 0 {
				t.Errorf("kill %v, replica %d: %d peers' pins left at the end", kill, i, pins)
			}
			if kill && c.PinsExpired.Load() == 0 {
				t.Errorf("replica %d: the killed replica's pins were not released", i)
			}
			if !kill && c.PinsExpired.Load() != 0 {
				t.Errorf("replica %d: %d pins released without their finish", i, c.PinsExpired.Load())
			}
		}
	}
}

// TestReplicasStaggerDeadline: a replica ranked before this one that has
// nothing in a burst costs the turn's deadline (rank × 3 of the delay),
// as before turns ended at learns. Bursts of 6 and 2 cold requests
// alternate, dealt round robin: each 2-burst leaves one replica out, and
// the decisions that wait for it are released by the deadline; the
// others by the learns. Each burst is still sent where one gateway sends
// it.
func TestReplicasStaggerDeadline(t *testing.T) {
	var recs []trace.Record
	for burst := range 40 {
		n := 6
		if burst%2 == 1 {
			n = 2
		}
		for k := range n {
			var ids []int64
			for b := range 8 {
				ids = append(ids, int64(burst*10_000+k*100+b))
			}
			recs = append(recs, trace.Record{Timestamp: time.Duration(burst) * 3 * time.Second,
				InputLength: len(ids) * 512, OutputLength: 4, HashIDs: ids})
		}
	}
	r, err := Replay(context.Background(), ReplayOptions{Records: recs, Engines: 6, Replicas: 3, ReplicaSync: true, ReplicaDelay: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	st := r.Stagger
	t.Logf("turns per replica: %+v", st)
	if len(st) != 3 || st[0] != (StaggerStats{}) {
		t.Fatalf("turns %+v: replica 0 waits", st)
	}
	if st[1].Deadline == 0 || st[2].Deadline == 0 || st[1].Learns <= st[1].Deadline || st[2].Learns <= st[2].Deadline {
		t.Errorf("turns %+v: want some decisions of replicas 1 and 2 released by the deadline, most by learns", st)
	}
	// In a 2-burst without replica 0 (dealt to 1 and 2) both decisions
	// wait for replica 0 until their deadlines, 3 and 6 ms (replica
	// 1's learn reaches replica 2 at 4 ms, but replica 0's never
	// comes): TTFTs over one gateway's, which sends each request of a
	// burst to an idle engine as they do.
	one, err := Replay(context.Background(), ReplayOptions{Records: recs, Engines: 6})
	if err != nil {
		t.Fatal(err)
	}
	start, seen := 0, 0
	for burst := range 40 {
		n := 6 - 4*(burst%2)
		k := start
		start += n
		if n != 2 || burst < 10 || r.Replica[k] != 1 {
			continue
		}
		seen++
		for i, want := range []float64{3, 6} {
			if got := r.Records[k+i].TTFTMs - one.Records[k+i].TTFTMs; math.Abs(got-want) > 1e-6 {
				t.Errorf("burst %d, request %d (replica %d): waited %.4f ms, want %.2f", burst, k+i, r.Replica[k+i], got, want)
			}
		}
	}
	if seen == 0 {
		t.Fatal("no 2-burst left replica 0 out: the test no longer shows the deadline")
	}
}
