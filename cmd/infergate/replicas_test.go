package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/infergate/infergate/internal/redistest"
)

// l4 is a round-robin TCP proxy, as a plain L4 balancer in front of
// gateway replicas: each connection goes to the next backend that
// accepts it (a backend that refuses is skipped: the balancer's health
// check), bytes copied both ways.
type l4 struct {
	ln       net.Listener
	backends []string
	next     atomic.Uint64
	wg       sync.WaitGroup
}

func startL4(t *testing.T, backends []string) *l4 {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &l4{ln: ln, backends: backends}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Add(1)
			go func() { defer p.wg.Done(); p.serve(c) }()
		}
	}()
	t.Cleanup(func() { ln.Close(); p.wg.Wait() })
	return p
}

func (p *l4) serve(c net.Conn) {
	defer c.Close()
	var up net.Conn
	for range p.backends {
		b := p.backends[p.next.Add(1)%uint64(len(p.backends))]
		var err error
		if up, err = net.DialTimeout("tcp", b, 5*time.Second); err == nil {
			break
		}
	}
	if up == nil {
		return
	}
	defer up.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	<-done
}

// replicaChat posts one chat turn through base with a fresh connection
// (so the L4 front spreads turns) and returns the answer and its cached
// tokens.
func replicaChat(t *testing.T, base string, msgs []map[string]string) (string, float64) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": "m", "messages": msgs, "max_tokens": 4})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", strings.NewReader(string(body)))
	req.Header.Set("Content-Type", "application/json")
	req.Close = true
	resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v map[string]any
	b, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(b, &v); err != nil || resp.StatusCode != 200 {
		t.Fatalf("chat: %d %v %s", resp.StatusCode, err, b)
	}
	reply := v["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
	return reply, cachedTokens(v)
}

// replicaMetric returns the sum of a metric's samples whose line contains sel.
func replicaMetric(t *testing.T, base, name, sel string) float64 {
	t.Helper()
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, name) && strings.Contains(l, sel) {
			f := strings.Fields(l)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			sum += v
		}
	}
	return sum
}

// TestReplicasEndToEnd runs redis-server, four `infergate sim` engines,
// three `infergate serve` replicas exchanging over the Redis stream, and a
// round-robin L4 proxy in front of the replicas. Multi-turn sessions whose
// turns land on different replicas still reach the engine holding their
// history (cached_tokens); the replicas' metrics show the exchange; a
// replica killed with a request in flight fails that request's connection,
// and the survivors go on routing with affinity.
func TestReplicasEndToEnd(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	srv := redistest.Start(t, 0)
	addrRe := regexp.MustCompile(`addr=(http://[0-9.:]+)`)
	var eps []string
	for range 4 {
		s := start(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "m")
		eps = append(eps, s.await(t, addrRe))
		defer s.stop(t)
	}
	dir := t.TempDir()
	var gws []*proc
	var bases, hosts []string
	for i := range 3 {
		// Seeds differ, as replicas' do with the exchange on (their ids
		// mixed in): with one seed, unshared replicas would break their
		// first ties alike and pile every session on one engine, which
		// keeps affinity by accident.
		cfg := fmt.Sprintf("listen: 127.0.0.1:0\nrouting: {policy: cache-aware, seed: %d}\n", i+1)
		cfg += fmt.Sprintf("replicas: {redis_url: %q, stream: e2e, id: gw-%d, load_interval: 100ms}\nendpoints:\n", srv.URL(), i)
		for _, e := range eps {
			cfg += fmt.Sprintf("  - {url: %q, model: m, kind: sim}\n", e)
		}
		path := filepath.Join(dir, fmt.Sprintf("gw%d.yaml", i))
		if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
		g := start(t, "serve", "-c", path, "--access-log=false")
		base := g.await(t, addrRe)
		gws, bases, hosts = append(gws, g), append(bases, base), append(hosts, strings.TrimPrefix(base, "http://"))
	}
	front := startL4(t, hosts)
	base := "http://" + front.ln.Addr().String()

	// Every replica hears the two others before the sessions start.
	for _, b := range bases {
		deadline := time.Now().Add(redistest.Wait)
		for replicaMetric(t, b, "infergate_replica_peers", "") != 2 {
			if time.Now().After(deadline) {
				t.Fatalf("%s: peers %v, want 2", b, replicaMetric(t, b, "infergate_replica_peers", ""))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}

	// Sessions of 4 turns each, interleaved: 3 replicas and 8 sessions, so
	// a session's consecutive turns arrive at different replicas.
	type session struct {
		msgs    []map[string]string
		history int // tokens of history before the turn, roughly
	}
	const nSessions, turns = 8, 4
	sessions := make([]session, nSessions)
	for s := range sessions {
		sys := strings.Repeat(fmt.Sprintf("Session %d: you are a careful assistant who answers in full sentences. ", s), 30)
		sessions[s].msgs = []map[string]string{{"role": "system", "content": sys}}
	}
	// learns is the number of peers' learns the live replicas applied
	// (infergate_replica_messages_total{outcome="learn"}).
	learns := func(live []int) float64 {
		n := 0.0
		for _, i := range live {
			n += replicaMetric(t, bases[i], "infergate_replica_messages_total", `outcome="learn"`)
		}
		return n
	}
	// awaitLearns waits until the live replicas applied want learns: a
	// request's turn is sent once every replica has applied the learns
	// of the turns before it, so that the test measures what the exchange
	// carries, not whether it carried it in time on a loaded host.
	awaitLearns := func(live []int, want float64) {
		deadline := time.Now().Add(redistest.Wait)
		for n := learns(live); n < want; n = learns(live) {
			if time.Now().After(deadline) {
				t.Fatalf("replicas %v applied %v peer learns, want %v", live, n, want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	var hits, follow int
	// runTurns sends turns [from, to) of every session through the front
	// to the live replicas, each request's learn applied by the others
	// (peers of them) before the next request: applied is the learns they
	// had applied before.
	runTurns := func(from, to int, live []int, applied float64) {
		sent := 0
		for turn := from; turn < to; turn++ {
			for s := range sessions {
				awaitLearns(live, applied+float64(sent*(len(live)-1)))
				sent++
				ss := &sessions[s]
				ss.msgs = append(ss.msgs, map[string]string{"role": "user", "content": fmt.Sprintf("Question %d, please.", turn)})
				reply, cached := replicaChat(t, base, ss.msgs)
				if turn > 0 {
					follow++
					if cached >= 0.8*float64(ss.history) {
						hits++
					} else {
						t.Logf("session %d turn %d: cached %v of ~%d history tokens", s, turn, cached, ss.history)
					}
				}
				ss.msgs = append(ss.msgs, map[string]string{"role": "assistant", "content": reply})
				ss.history += 16 // the turn's messages, at least a block's worth more next time
				if turn == 0 {
					ss.history = 300 // the system prompt: ~450 tokens, 300 safely below
				}
			}
		}
	}
	runTurns(0, 2, []int{0, 1, 2}, 0)
	t.Logf("%d of %d follow-up turns hit their history across replicas", hits, follow)
	if hits < follow*9/10 {
		t.Fatalf("%d of %d follow-up turns hit their history across replicas, want 90%%", hits, follow)
	}
	for i, b := range bases {
		if n := replicaMetric(t, b, "infergate_replica_messages_total", `outcome="learn"`); n == 0 {
			t.Errorf("replica %d applied no peer learns", i)
		}
		if n := replicaMetric(t, b, "infergate_replica_messages_total", `outcome="published"`); n == 0 {
			t.Errorf("replica %d published nothing", i)
		}
		if n := replicaMetric(t, b, "infergate_replica_messages_total", `outcome="malformed"`); n != 0 {
			t.Errorf("replica %d: %v malformed messages", i, n)
		}
	}

	// A request in flight on replica 1 when it is killed: its connection
	// fails, an explicit error for the client to retry.
	survivors := []int{0, 2}
	before := learns(survivors)
	inflight := make(chan error, 1)
	go func() {
		body := `{"model":"m","messages":[{"role":"user","content":"A long answer, please."}],"max_tokens":20000,"stream":true}`
		req, _ := http.NewRequest(http.MethodPost, bases[1]+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		resp, err := (&http.Client{Timeout: 2 * time.Minute}).Do(req)
		if err != nil {
			inflight <- err
			return
		}
		defer resp.Body.Close()
		_, err = io.Copy(io.Discard, resp.Body)
		inflight <- fmt.Errorf("stream ended: %v (want a broken connection)", err)
	}()
	// Routed (its learn applied by both others) before the kill.
	awaitLearns(survivors, before+2)
	if err := gws[1].cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = gws[1].cmd.Wait()
	select {
	case err := <-inflight:
		if strings.Contains(err.Error(), "want a broken connection") && !strings.Contains(err.Error(), "unexpected EOF") {
			t.Errorf("in-flight request on the killed replica: %v", err)
		}
	case <-time.After(redistest.Wait):
		t.Fatal("the in-flight request on the killed replica did not end")
	}

	// The survivors go on: every request served, affinity kept.
	hits, follow = 0, 0
	runTurns(2, turns, survivors, learns(survivors))
	t.Logf("after the kill: %d of %d follow-up turns hit their history", hits, follow)
	if hits < follow*9/10 {
		t.Fatalf("after the kill %d of %d follow-up turns hit their history, want 90%%", hits, follow)
	}
	for _, i := range []int{0, 2} {
		deadline := time.Now().Add(redistest.Wait)
		for replicaMetric(t, bases[i], "infergate_replica_peers", "") != 1 {
			if time.Now().After(deadline) {
				t.Fatalf("replica %d still counts %v peers after the kill", i, replicaMetric(t, bases[i], "infergate_replica_peers", ""))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	gws[0].stop(t)
	gws[2].stop(t)
}
