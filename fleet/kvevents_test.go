package fleet

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sim"
)

// The subscriber and applier end to end: kvevents.Publisher →
// kvevents.Subscriber → KVEventApplier → prefix.PreciseIndex. The decoder's,
// the publisher's and the ZMTP guard's own tests are in ../kvevents.

// ---------------------------------------------------------------------------
// ZeroMQ helpers

// kvPubEndpoint is a loopback address a simulator publisher binds (vLLM's
// heuristic binds addresses with "::" or "*"): IPv6 loopback when there is
// one, else every interface (the tests still dial 127.0.0.1).
func kvPubEndpoint(t *testing.T, port int) string {
	t.Helper()
	if ln, err := net.Listen("tcp", "[::1]:0"); err == nil {
		ln.Close()
		return fmt.Sprintf("tcp://[::1]:%d", port)
	}
	return fmt.Sprintf("tcp://*:%d", port)
}

// kvDialAddr is the address to dial the publisher p's PUB socket at.
func kvDialAddr(p *kvevents.Publisher) string {
	a := p.Addr().(*net.TCPAddr)
	if a.IP.To4() == nil && a.IP.IsLoopback() {
		return fmt.Sprintf("tcp://[::1]:%d", a.Port)
	}
	return fmt.Sprintf("tcp://127.0.0.1:%d", a.Port)
}

func kvPublisher(t *testing.T, cfg kvevents.PublisherConfig) *kvPub {
	t.Helper()
	p, err := kvevents.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return &kvPub{Publisher: p}
}

// kvRunning is a subscriber running in the background.
type kvRunning struct {
	sub    *kvevents.Subscriber
	cancel context.CancelFunc
	done   chan error
}

func kvRun(t *testing.T, cfg kvevents.SubscriberConfig, h kvevents.Handler) *kvRunning {
	t.Helper()
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff = 10 * time.Millisecond
		cfg.MaxBackoff = 100 * time.Millisecond
	}
	sub, err := kvevents.NewSubscriber(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &kvRunning{sub: sub, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- sub.Run(ctx, h) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// stop cancels Run and checks that it returns promptly.
func (r *kvRunning) stop(t *testing.T) {
	t.Helper()
	if r.cancel == nil {
		return
	}
	r.cancel()
	r.cancel = nil
	start := time.Now()
	select {
	case err := <-r.done:
		if err != context.Canceled {
			t.Errorf("Run returned %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("Run took %v to return after cancel", d)
	}
}

// kvPub is a simulator publisher that counts the batches it queued: the
// next batch's sequence number.
type kvPub struct {
	*kvevents.Publisher
	n uint64
}

func (p *kvPub) publish(ts float64, evs []kvevents.Event) {
	if len(evs) == 0 {
		return
	}
	if !p.Publisher.Publish(ts, evs) {
		panic("publisher dropped a batch")
	}
	p.n++
}

// kvSync publishes no-op batches (a BlockRemoved of a block nobody holds)
// on p until one of them reaches rec, so that every batch published before
// has been delivered or skipped.
func kvSync(t *testing.T, p *kvPub, rec *kvRecorder) {
	t.Helper()
	noop := []kvevents.Event{{Type: kvevents.BlockRemoved, BlockHashes: []uint64{0xdeadbeef}}}
	deadline := time.Now().Add(30 * time.Second)
	for {
		seq := p.n
		p.publish(0, noop)
		for wait := time.Now().Add(200 * time.Millisecond); time.Now().Before(wait); time.Sleep(2 * time.Millisecond) {
			if last, ok := rec.last(); ok && last >= seq {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("batch %d not delivered", seq)
		}
	}
}

// kvGoroutines counts goroutines, leaving out those go-zeromq/zmq4 v0.17.0
// leaks by itself: a PUB socket's pubMWriter.run (never stopped by Close)
// and a connection reader blocked on its socket's full queue
// (qreader.listen, which sends without watching the context). It returns
// the stacks of the goroutines of this package's non-test code separately:
// there must be none once Run has returned.
func kvGoroutines() (n int, ours []string, stacks string) {
	buf := make([]byte, 8<<20)
	all := string(buf[:runtime.Stack(buf, true)])
	var kept []string
	for _, g := range strings.Split(all, "\n\n") {
		if strings.Contains(g, "zmq4.(*pubMWriter).run") || strings.Contains(g, "zmq4.(*qreader).listen") {
			continue
		}
		if strings.Contains(g, "fleet.(*kvevents.Subscriber)") {
			ours = append(ours, g)
		}
		n++
		kept = append(kept, g)
	}
	return n, ours, strings.Join(kept, "\n\n")
}

func kvNoLeak(t *testing.T, before int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		n, ours, stacks := kvGoroutines()
		if n <= before && len(ours) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines, want <= %d; %d of the subscriber:\n%s", n, before, len(ours), stacks)
		}
	}
}

// kvProxy forwards TCP connections from a loopback port to target and can
// cut them: while down it closes existing and new connections at once.
type kvProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	down   bool
	conns  map[net.Conn]bool
	wg     sync.WaitGroup
}

func newKVProxy(t *testing.T, target string) *kvProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	px := &kvProxy{ln: ln, target: target, conns: map[net.Conn]bool{}}
	px.wg.Add(1)
	go px.accept()
	t.Cleanup(px.close)
	return px
}

func (px *kvProxy) addr() string { return "tcp://" + px.ln.Addr().String() }

func (px *kvProxy) accept() {
	defer px.wg.Done()
	for {
		c, err := px.ln.Accept()
		if err != nil {
			return
		}
		px.mu.Lock()
		if px.down {
			px.mu.Unlock()
			c.Close()
			continue
		}
		up, err := net.Dial("tcp", px.target)
		if err != nil {
			px.mu.Unlock()
			c.Close()
			continue
		}
		px.conns[c], px.conns[up] = true, true
		px.mu.Unlock()
		for _, pair := range [][2]net.Conn{{c, up}, {up, c}} {
			px.wg.Add(1)
			go func() {
				defer px.wg.Done()
				_, _ = io.Copy(pair[0], pair[1])
				pair[0].Close()
				pair[1].Close()
			}()
		}
	}
}

// setDown cuts every connection and refuses new ones (down), or accepts again.
func (px *kvProxy) setDown(down bool) {
	px.mu.Lock()
	defer px.mu.Unlock()
	px.down = down
	if down {
		for c := range px.conns {
			c.Close()
		}
		clear(px.conns)
	}
}

func (px *kvProxy) close() {
	px.ln.Close()
	px.setDown(true)
	px.wg.Wait()
}

// kvRecorder records what a subscriber delivers, for checks, and forwards to
// an applier.
type kvRecorder struct {
	*KVEventApplier
	mu     sync.Mutex
	seqs   []uint64
	resets []kvevents.ResetReason
}

func (r *kvRecorder) KVBatch(seq uint64, b *kvevents.Batch) {
	r.mu.Lock()
	r.seqs = append(r.seqs, seq)
	r.mu.Unlock()
	r.KVEventApplier.KVBatch(seq, b)
}

func (r *kvRecorder) KVReset(why kvevents.ResetReason) {
	r.mu.Lock()
	r.resets = append(r.resets, why)
	r.mu.Unlock()
	r.KVEventApplier.KVReset(why)
}

// last returns the sequence number of the last batch delivered.
func (r *kvRecorder) last() (uint64, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.seqs) == 0 {
		return 0, false
	}
	return r.seqs[len(r.seqs)-1], true
}

func (r *kvRecorder) snapshot() ([]uint64, []kvevents.ResetReason) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]uint64(nil), r.seqs...), append([]kvevents.ResetReason(nil), r.resets...)
}

// ---------------------------------------------------------------------------
// End to end against the simulator's publisher

const kvModel = "test-model"

func kvTokens(base, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(base + i)
	}
	return t
}

// kvMatch returns how many leading blocks of tokens (under adapter lora)
// endpoint e of ix holds on the GPU.
func kvMatch(ix *prefix.PreciseIndex, e int, tokens []uint32, lora string) int {
	m := make([]int, ix.Endpoints())
	ix.Match(prefix.Hashes(nil, tokens, 16, KVSeeds(kvModel)(lora)), prefix.MediumGPU, m)
	return m[e]
}

// TestKVEventsFromEngine runs a simulated engine with a small cache (so it
// evicts) and a LoRA adapter, publishes every step's events over ZeroMQ, and
// subscribes after part of them were sent (the subscriber replays those).
// Once everything is delivered, the index must hold exactly the engine's
// cached blocks: every prompt matches as far as the engine would hit it.
func TestKVEventsFromEngine(t *testing.T) {
	for _, enc := range []string{kvevents.EncodingArray, kvevents.EncodingMap} {
		t.Run(enc, func(t *testing.T) {
			before, _, _ := kvGoroutines()
			p := kvPublisher(t, kvevents.PublisherConfig{Endpoint: kvPubEndpoint(t, 0), ReplayEndpoint: "tcp://127.0.0.1:0",
				Encoding: enc, Topic: "kv@e1@" + kvModel})
			ix, _ := prefix.NewPreciseIndex(2, 16)
			rec := &kvRecorder{KVEventApplier: NewKVEventApplier(ix, 1, KVSeeds(kvModel))}

			eng := sim.NewEngine(sim.Config{NumBlocks: 60, MaxNumBatchedTokens: 128, KVEvents: true,
				LoRA: sim.LoRAConfig{Adapters: []string{"ad1"}, MaxLoras: 2}})
			cached := map[uint64]int{} // the engine's cached hashes, from its own events
			apply := func(evs []kvevents.Event) {
				for _, ev := range evs {
					switch ev.Type {
					case kvevents.BlockStored:
						for _, h := range ev.BlockHashes {
							cached[h]++
						}
					case kvevents.BlockRemoved:
						for _, h := range ev.BlockHashes {
							if cached[h]--; cached[h] == 0 {
								delete(cached, h)
							}
						}
					case kvevents.AllBlocksCleared:
						clear(cached)
					}
				}
			}
			rng := rand.New(rand.NewPCG(3, 4))
			type prompt struct {
				toks []uint32
				lora string
			}
			systems := [][]uint32{kvTokens(1000, 80), kvTokens(2000, 50), kvTokens(3000, 120)}
			var prompts []prompt
			var now time.Duration
			var r *kvRunning
			for id := 0; id < 300 || eng.HasWork(); {
				if id < 300 && rng.IntN(2) == 0 {
					lora := ""
					if rng.IntN(3) == 0 {
						lora = "ad1"
					}
					pr := prompt{append(append([]uint32{}, systems[rng.IntN(3)]...), kvTokens(10000+id*100, 1+rng.IntN(60))...), lora}
					if err := eng.Add(&sim.Request{ID: fmt.Sprint(id), Tokens: pr.toks, MaxTokens: 1 + rng.IntN(30), LoRA: lora}, now); err != nil {
						t.Fatal(err)
					}
					prompts = append(prompts, pr)
					id++
				}
				if id == 100 && r == nil { // subscribe a third of the way in
					r = kvRun(t, kvevents.SubscriberConfig{Endpoint: kvDialAddr(p.Publisher), ReplayEndpoint: "tcp://" + p.ReplayAddr().String(), Topic: "kv@"}, rec)
				}
				if !eng.HasWork() {
					continue
				}
				res := eng.Step(now)
				now += res.Duration
				apply(res.Events)
				p.publish(now.Seconds(), res.Events)
			}
			kvSync(t, p, rec)

			st := r.sub.Stats()
			seqs, resets := rec.snapshot()
			for i, s := range seqs {
				if s != uint64(i) {
					t.Fatalf("delivery %d has seq %d", i, s)
				}
			}
			if len(resets) != 1 || resets[0] != kvevents.ResetStart {
				t.Fatalf("resets %v", resets)
			}
			as := rec.Stats()
			t.Logf("subscriber %+v; applier %+v; index %+v", st, as, ix.Stats())
			if st.Replayed == 0 || st.Gaps != 0 || st.DecodeErrors != 0 || as.Removed == 0 || as.UnknownParents != 0 || as.Invalid != 0 {
				t.Fatalf("subscriber %+v, applier %+v", st, as)
			}
			if ix.Len(1, prefix.MediumGPU) != len(cached) || ix.Len(0, prefix.MediumGPU) != 0 {
				t.Fatalf("index holds %d blocks, the engine %d", ix.Len(1, prefix.MediumGPU), len(cached))
			}
			hits := 0
			for _, pr := range prompts {
				engine := prefix.Hashes(nil, pr.toks, 16, sim.RootHash(pr.lora, 0))
				want := 0
				for want < len(engine) && cached[engine[want]] > 0 {
					want++
				}
				if got := kvMatch(ix, 1, pr.toks, pr.lora); got != want {
					t.Fatalf("prompt (lora %q, %d tokens): index matches %d blocks, engine caches %d", pr.lora, len(pr.toks), got, want)
				}
				hits += want
			}
			if hits == 0 {
				t.Fatal("nothing cached at the end")
			}
			// The adapter's blocks are not the base model's.
			sys := systems[0]
			if kvMatch(ix, 1, sys, "") > 0 && kvMatch(ix, 1, sys, "ad1") > 0 &&
				fmt.Sprint(prefix.Hashes(nil, sys, 16, KVSeeds(kvModel)(""))) == fmt.Sprint(prefix.Hashes(nil, sys, 16, KVSeeds(kvModel)("ad1"))) {
				t.Fatal("adapter and base model share request keys")
			}
			r.stop(t)
			p.Close()
			kvNoLeak(t, before)
		})
	}
}

// kvChain returns n blocks of tokens from base, their engine hashes (as the
// simulator computes them for the base model) and a BlockStored of blocks
// [from, n).
func kvStore(toks []uint32, from int) kvevents.Event {
	h := prefix.Hashes(nil, toks, 16, 0)
	ev := kvevents.Event{Type: kvevents.BlockStored, BlockHashes: h[from:], TokenIDs: toks[16*from:], BlockSize: 16}
	if from > 0 {
		ev.ParentBlockHash, ev.HasParent = h[from-1], true
	}
	return ev
}

func kvRemove(toks []uint32, blocks ...int) kvevents.Event {
	h := prefix.Hashes(nil, toks, 16, 0)
	ev := kvevents.Event{Type: kvevents.BlockRemoved}
	for _, b := range blocks {
		ev.BlockHashes = append(ev.BlockHashes, h[b])
	}
	return ev
}

// TestKVEventsGap cuts the connection between subscriber and publisher while
// batches are published: with a replay socket the subscriber fills the gap
// after reconnecting; without one it resets the endpoint and goes on.
func TestKVEventsGap(t *testing.T) {
	for _, withReplay := range []bool{true, false} {
		t.Run(fmt.Sprintf("replay=%v", withReplay), func(t *testing.T) {
			before, _, _ := kvGoroutines()
			cfg := kvevents.PublisherConfig{Endpoint: kvPubEndpoint(t, 0)}
			if withReplay {
				cfg.ReplayEndpoint = "tcp://127.0.0.1:0"
			}
			p := kvPublisher(t, cfg)
			px := newKVProxy(t, strings.TrimPrefix(kvDialAddr(p.Publisher), "tcp://"))
			ix, _ := prefix.NewPreciseIndex(1, 16)
			rec := &kvRecorder{KVEventApplier: NewKVEventApplier(ix, 0, KVSeeds(kvModel))}
			scfg := kvevents.SubscriberConfig{Endpoint: px.addr()}
			if withReplay {
				scfg.ReplayEndpoint = "tcp://" + p.ReplayAddr().String()
			}
			r := kvRun(t, scfg, rec)

			x, y, z := kvTokens(100, 16*8), kvTokens(5000, 16*6), kvTokens(9000, 16*4)
			kvSync(t, p, rec) // connected
			p.publish(1, []kvevents.Event{kvStore(x[:16*4], 0)})
			p.publish(2, []kvevents.Event{kvStore(x, 4)})
			kvSync(t, p, rec)
			if kvMatch(ix, 0, x, "") != 8 {
				t.Fatalf("x matches %d blocks before the gap", kvMatch(ix, 0, x, ""))
			}

			// Cut: these are lost on the wire.
			px.setDown(true)
			time.Sleep(50 * time.Millisecond)
			p.publish(3, []kvevents.Event{kvRemove(x, 7, 6, 5)})
			p.publish(4, []kvevents.Event{kvStore(y, 0)})
			time.Sleep(50 * time.Millisecond)
			px.setDown(false)
			kvSync(t, p, rec) // reconnected: the gap is handled
			p.publish(5, []kvevents.Event{kvStore(z, 0)})
			kvSync(t, p, rec)

			st := r.sub.Stats()
			seqs, resets := rec.snapshot()
			t.Logf("subscriber %+v, resets %v", st, resets)
			if st.Gaps == 0 || st.Connects < 2 {
				t.Fatalf("no gap or reconnect seen: %+v", st)
			}
			if withReplay {
				for i, s := range seqs {
					if s != uint64(i) {
						t.Fatalf("delivery %d has seq %d (%v)", i, s, seqs)
					}
				}
				if fmt.Sprint(resets) != "[start]" || st.Replayed < 2 {
					t.Fatalf("resets %v, stats %+v", resets, st)
				}
				if kvMatch(ix, 0, x, "") != 5 || kvMatch(ix, 0, y, "") != 6 || kvMatch(ix, 0, z, "") != 4 {
					t.Fatalf("after replay: x %d, y %d, z %d", kvMatch(ix, 0, x, ""), kvMatch(ix, 0, y, ""), kvMatch(ix, 0, z, ""))
				}
			} else {
				if fmt.Sprint(resets) != "[start gap]" || st.Replayed != 0 {
					t.Fatalf("resets %v, stats %+v", resets, st)
				}
				// x was forgotten (its eviction was lost), y lost, z seen.
				if kvMatch(ix, 0, x, "") != 0 || kvMatch(ix, 0, y, "") != 0 || kvMatch(ix, 0, z, "") != 4 {
					t.Fatalf("after reset: x %d, y %d, z %d", kvMatch(ix, 0, x, ""), kvMatch(ix, 0, y, ""), kvMatch(ix, 0, z, ""))
				}
			}
			r.stop(t)
			p.Close()
			px.close()
			kvNoLeak(t, before)
		})
	}
}

// TestKVEventsRestart replaces the publisher by a new one at the same
// addresses (an engine restart): its sequence numbers start over, the
// subscriber resets the endpoint and follows the new stream.
func TestKVEventsRestart(t *testing.T) {
	before, _, _ := kvGoroutines()
	p1 := kvPublisher(t, kvevents.PublisherConfig{Endpoint: kvPubEndpoint(t, 0), ReplayEndpoint: "tcp://127.0.0.1:0", Encoding: kvevents.EncodingArray})
	port, replay := p1.Addr().(*net.TCPAddr).Port, p1.ReplayAddr().String()
	ix, _ := prefix.NewPreciseIndex(1, 16)
	rec := &kvRecorder{KVEventApplier: NewKVEventApplier(ix, 0, KVSeeds(kvModel))}
	r := kvRun(t, kvevents.SubscriberConfig{Endpoint: kvDialAddr(p1.Publisher), ReplayEndpoint: "tcp://" + replay}, rec)

	x, y := kvTokens(100, 16*5), kvTokens(7000, 16*3)
	p1.publish(1, []kvevents.Event{kvStore(x, 0)})
	for range 100 { // move the old stream's sequence number well ahead
		p1.publish(1, []kvevents.Event{kvRemove(y, 0)})
	}
	kvSync(t, p1, rec)
	if kvMatch(ix, 0, x, "") != 5 {
		t.Fatal("x not indexed")
	}
	p1.Close()

	p2 := kvPublisher(t, kvevents.PublisherConfig{Endpoint: kvPubEndpoint(t, port), ReplayEndpoint: "tcp://" + replay})
	p2.publish(2, []kvevents.Event{kvStore(y, 0)})
	// Until the subscriber has reconnected and followed the new stream (the
	// no-op batches keep the stream moving; the first one replays y).
	for deadline := time.Now().Add(30 * time.Second); r.sub.Stats().Restarts == 0 || kvMatch(ix, 0, y, "") != 3; {
		if time.Now().After(deadline) {
			t.Fatalf("restart not followed: %+v", r.sub.Stats())
		}
		p2.publish(3, []kvevents.Event{kvRemove(x, 4)}) // no-op once x is forgotten
		time.Sleep(10 * time.Millisecond)
	}
	_, resets := rec.snapshot()
	st := r.sub.Stats()
	t.Logf("subscriber %+v, resets %v", st, resets)
	if fmt.Sprint(resets) != "[start restart]" || st.Restarts != 1 || st.Connects < 2 {
		t.Fatalf("resets %v, stats %+v", resets, st)
	}
	if kvMatch(ix, 0, x, "") != 0 || kvMatch(ix, 0, y, "") != 3 {
		t.Fatalf("after restart: x %d, y %d", kvMatch(ix, 0, x, ""), kvMatch(ix, 0, y, ""))
	}
	r.stop(t)
	p2.Close()
	kvNoLeak(t, before)
}

// TestKVEventsMalformed feeds a subscriber from a bare PUB socket: a message
// of the wrong shape is skipped, an undecodable payload resets the endpoint.
func TestKVEventsMalformed(t *testing.T) {
	before, _, _ := kvGoroutines()
	pub := zmq4.NewPub(context.Background())
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	ix, _ := prefix.NewPreciseIndex(1, 16)
	rec := &kvRecorder{KVEventApplier: NewKVEventApplier(ix, 0, KVSeeds(kvModel))}
	r := kvRun(t, kvevents.SubscriberConfig{Endpoint: "tcp://" + pub.Addr().String()}, rec)
	x := kvTokens(100, 32)
	seq := func(n uint64) []byte { return binary.BigEndian.AppendUint64(nil, n) }
	good := func(n uint64) zmq4.Msg {
		return zmq4.NewMsgFrom([]byte("t"), seq(n), kvevents.AppendBatch(nil, 1, []kvevents.Event{kvStore(x, 0)}, 0, ""))
	}
	// Slow joiner: send seq 0 until it arrives.
	for deadline := time.Now().Add(30 * time.Second); r.sub.Stats().Batches == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("nothing received")
		}
		if err := pub.SendMulti(good(0)); err != nil {
			t.Fatal(err)
		}
	}
	// The repeats of seq 0 read as restarts; count from here.
	restarts := r.sub.Stats().Restarts
	msgs := []zmq4.Msg{
		zmq4.NewMsgFrom([]byte("t"), []byte{1, 2}, []byte{0x90}), // short seq frame
		zmq4.NewMsgFrom([]byte("t"), seq(1)),                     // two frames
		zmq4.NewMsgFrom([]byte("t"), seq(1), []byte{0xc1}),       // not msgpack
		good(2),
	}
	for _, m := range msgs {
		if err := pub.SendMulti(m); err != nil {
			t.Fatal(err)
		}
	}
	for deadline := time.Now().Add(30 * time.Second); r.sub.Stats().DecodeErrors == 0 || kvMatch(ix, 0, x, "") != 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("stats %+v", r.sub.Stats())
		}
	}
	st := r.sub.Stats()
	_, resets := rec.snapshot()
	if st.Malformed != 2 || st.DecodeErrors != 1 || st.Restarts != restarts || resets[len(resets)-1] != kvevents.ResetDecode {
		t.Fatalf("stats %+v, resets %v", st, resets)
	}
	r.stop(t)
	pub.Close()
	kvNoLeak(t, before)
}

// TestKVEventSubscriberNoEngine: nothing listens; Run keeps redialing with
// backoff and returns promptly when cancelled.
func TestKVEventSubscriberNoEngine(t *testing.T) {
	before, _, _ := kvGoroutines()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ep := "tcp://" + ln.Addr().String()
	ln.Close()
	ix, _ := prefix.NewPreciseIndex(1, 16)
	r := kvRun(t, kvevents.SubscriberConfig{Endpoint: ep, ReplayEndpoint: ep}, NewKVEventApplier(ix, 0, KVSeeds(kvModel)))
	time.Sleep(300 * time.Millisecond)
	if st := r.sub.Stats(); st.Connects != 0 || st.Resets != 1 {
		t.Fatalf("stats %+v", st)
	}
	r.stop(t)
	kvNoLeak(t, before)

	for _, bad := range []kvevents.SubscriberConfig{{}, {Endpoint: "127.0.0.1:5557"}, {Endpoint: "udp://x:1"}, {Endpoint: "tcp://x:1", ReplayEndpoint: "x"}} {
		if _, err := kvevents.NewSubscriber(bad); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
	s, _ := kvevents.NewSubscriber(kvevents.SubscriberConfig{Endpoint: "tcp://x:1"})
	if c := s.Config(); c.MinBackoff != kvevents.DefaultMinBackoff || c.MaxBackoff != kvevents.DefaultMaxBackoff || c.ReplayTimeout != kvevents.DefaultReplayTimeout {
		t.Fatalf("defaults %+v", c)
	}
}

func TestKVEventApplierSkips(t *testing.T) {
	ix, _ := prefix.NewPreciseIndex(1, 16)
	a := NewKVEventApplier(ix, 0, KVSeeds(kvModel))
	x := kvTokens(1, 32)
	h := prefix.Hashes(nil, x, 16, 0)
	a.KVBatch(0, &kvevents.Batch{Events: []kvevents.Event{
		{Type: kvevents.BlockStored, BlockHashes: h[1:], ParentBlockHash: h[0], HasParent: true, TokenIDs: x[16:], BlockSize: 16}, // unknown parent
		{Type: kvevents.BlockStored, BlockHashes: h, TokenIDs: x, BlockSize: 32},                                                  // other block size
		{Type: kvevents.BlockStored, BlockHashes: h, TokenIDs: x[:20], BlockSize: 16},                                             // bad token count
		{Type: kvevents.BlockStored, BlockHashes: h, TokenIDs: x, Medium: "nvme"},                                                 // block size absent
		{Type: kvevents.BlockRemoved, BlockHashes: h[:1], Medium: "NVMe"},
	}})
	st := a.Stats()
	if st.UnknownParents != 1 || st.BlockSizeMismatch != 1 || st.Invalid != 1 || st.Stored != 2 || st.Removed != 1 || st.OtherMedia != 2 {
		t.Fatalf("stats %+v", st)
	}
	// The first event's block, kept as an orphan on the GPU, is held there
	// once the fourth gives its request key.
	if ix.Len(0, prefix.MediumOther) != 1 || ix.Len(0, prefix.MediumGPU) != 1 {
		t.Fatalf("lens: other %d, GPU %d", ix.Len(0, prefix.MediumOther), ix.Len(0, prefix.MediumGPU))
	}
	// A GPU tier clear keeps the other tier; the full clear takes both.
	a.KVBatch(1, &kvevents.Batch{Events: []kvevents.Event{{Type: kvevents.TierBlocksCleared, Medium: "GPU"}}})
	if ix.Len(0, prefix.MediumOther) != 1 || ix.Len(0, prefix.MediumGPU) != 0 || a.Stats().Cleared != 1 {
		t.Fatalf("after a GPU tier clear: other %d, GPU %d", ix.Len(0, prefix.MediumOther), ix.Len(0, prefix.MediumGPU))
	}
	a.KVBatch(2, &kvevents.Batch{Events: []kvevents.Event{{Type: kvevents.AllBlocksCleared}}})
	if ix.Len(0, prefix.MediumOther) != 0 || a.Stats().Cleared != 2 {
		t.Fatal("not cleared")
	}
}

// TestKVEventsResync: Resync ends the session, resets the handler
// (kvevents.ResetResync) and rejoins as a new stream, whose batches the replay
// socket delivers again from the first: the index ends up holding what the
// engine holds.
func TestKVEventsResync(t *testing.T) {
	before, _, _ := kvGoroutines()
	p := kvPublisher(t, kvevents.PublisherConfig{Endpoint: kvPubEndpoint(t, 0), ReplayEndpoint: "tcp://127.0.0.1:0"})
	ix, _ := prefix.NewPreciseIndex(1, 16)
	rec := &kvRecorder{KVEventApplier: NewKVEventApplier(ix, 0, KVSeeds(kvModel))}
	r := kvRun(t, kvevents.SubscriberConfig{Endpoint: kvDialAddr(p.Publisher), ReplayEndpoint: "tcp://" + p.ReplayAddr().String()}, rec)
	x := kvTokens(100, 16*6)
	kvSync(t, p, rec)
	p.publish(1, []kvevents.Event{kvStore(x, 0)})
	kvSync(t, p, rec)
	if kvMatch(ix, 0, x, "") != 6 {
		t.Fatal("not applied")
	}
	connects := r.sub.Stats().Connects
	rec.Forget() // what the gateway does when the endpoint leaves rotation
	r.sub.Resync()
	for deadline := time.Now().Add(30 * time.Second); kvMatch(ix, 0, x, "") != 6; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("blocks not replayed after the resync: %+v", r.sub.Stats())
		}
	}
	st := r.sub.Stats()
	if _, resets := rec.snapshot(); !slices.Contains(resets, kvevents.ResetResync) || st.Resyncs != 1 || st.Connects != connects+1 {
		t.Fatalf("resets %v, stats %+v", resets, st)
	}
	r.stop(t)
	p.Close()
	kvNoLeak(t, before)
}

// TestKVEventsTierScopedClear: a publisher with vLLM's
// tier_scoped_clear_events sends a prefix-cache reset as
// TierBlocksCleared(medium="GPU") in a batch of its own, between the
// batches of the events around it (three sequence numbers for one step),
// and the subscriber's index drops the GPU blocks stored before it and keeps
// those stored after.
func TestKVEventsTierScopedClear(t *testing.T) {
	p := kvPublisher(t, kvevents.PublisherConfig{Endpoint: kvPubEndpoint(t, 0), ReplayEndpoint: "tcp://127.0.0.1:0",
		Encoding: kvevents.EncodingMap, TierScopedClearEvents: true})
	ix, _ := prefix.NewPreciseIndex(1, 16)
	var mu sync.Mutex
	var types [][]kvevents.Type
	rec := &kvRecorder{KVEventApplier: NewKVEventApplier(ix, 0, KVSeeds(kvModel))}
	h := kvHandlerFunc(func(seq uint64, b *kvevents.Batch) {
		mu.Lock()
		var ts []kvevents.Type
		for _, ev := range b.Events {
			ts = append(ts, ev.Type)
		}
		types = append(types, ts)
		mu.Unlock()
		rec.KVBatch(seq, b)
	}, rec)
	a, b := kvTokens(1, 32), kvTokens(500, 32)
	ha := prefix.Hashes(nil, a, 16, 7)
	hb := prefix.Hashes(nil, b, 16, 7)
	stored := func(hs []uint64, toks []uint32) kvevents.Event {
		return kvevents.Event{Type: kvevents.BlockStored, BlockHashes: hs, TokenIDs: toks, BlockSize: 16}
	}
	p.publish(1, []kvevents.Event{stored(ha, a), {Type: kvevents.AllBlocksCleared}, stored(hb, b)})
	kvRun(t, kvevents.SubscriberConfig{Endpoint: kvDialAddr(p.Publisher), ReplayEndpoint: "tcp://" + p.ReplayAddr().String()}, h)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if last, ok := rec.last(); ok && last >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the three batches were not delivered")
		}
	}
	mu.Lock()
	got := fmt.Sprint(types)
	mu.Unlock()
	if want := fmt.Sprint([][]kvevents.Type{{kvevents.BlockStored}, {kvevents.TierBlocksCleared}, {kvevents.BlockStored}}); got != want {
		t.Fatalf("batches %s, want %s", got, want)
	}
	if kvMatch(ix, 0, a, "") != 0 || kvMatch(ix, 0, b, "") != 2 {
		t.Fatalf("after the tier clear: a %d blocks, b %d blocks; want 0 and 2", kvMatch(ix, 0, a, ""), kvMatch(ix, 0, b, ""))
	}
}

// kvHandlerFunc is a kvevents.Handler whose batches go to f and resets to r.
func kvHandlerFunc(f func(uint64, *kvevents.Batch), r kvevents.Handler) kvevents.Handler {
	return kvFuncHandler{f: f, r: r}
}

type kvFuncHandler struct {
	f func(uint64, *kvevents.Batch)
	r kvevents.Handler
}

func (h kvFuncHandler) KVBatch(seq uint64, b *kvevents.Batch) { h.f(seq, b) }
func (h kvFuncHandler) KVReset(why kvevents.ResetReason)      { h.r.KVReset(why) }

// kvMatchIn returns how many leading blocks of tokens (base model) endpoint
// e of ix holds in medium m.
func kvMatchIn(ix *prefix.PreciseIndex, e int, tokens []uint32, m prefix.Medium) int {
	out := make([]int, ix.Endpoints())
	ix.Match(prefix.Hashes(nil, tokens, 16, KVSeeds(kvModel)("")), m, out)
	return out[e]
}

// TestKVEventsTiers feeds a tiered engine's events, encoded as vLLM does
// (both encodings) and decoded, through the applier: GPU blocks with
// tokens, their CPU and DISK copies without tokens (an offloading
// connector's BlockStored: empty token_ids, null parent), a REMOTE store
// with tokens, an offload of a block never stored with tokens, then GPU
// evictions and tier removals. Each lands in its own medium; the tokenless
// events are stored, not invalid.
func TestKVEventsTiers(t *testing.T) {
	for _, enc := range []string{kvevents.EncodingArray, kvevents.EncodingMap} {
		t.Run(enc, func(t *testing.T) {
			ix, _ := prefix.NewPreciseIndex(2, 16)
			a := NewKVEventApplier(ix, 1, KVSeeds(kvModel))
			x := kvTokens(1, 16*6)
			h := prefix.Hashes(nil, x, 16, 0)
			offload := func(medium string, hashes ...uint64) kvevents.Event {
				return kvevents.Event{Type: kvevents.BlockStored, BlockHashes: hashes, BlockSize: 16, Medium: medium}
			}
			remote := kvStore(x, 0)
			remote.Medium = kvevents.MediumRemote
			removeIn := func(medium string, blocks ...int) kvevents.Event {
				ev := kvRemove(x, blocks...)
				ev.Medium = medium
				return ev
			}
			apply := func(seq uint64, evs ...kvevents.Event) {
				t.Helper()
				b, err := kvevents.DecodeBatch(kvevents.AppendBatch(nil, 1, evs, 0, enc))
				if err != nil {
					t.Fatal(err)
				}
				a.KVBatch(seq, &b)
			}
			check := func(what string, gpu, cpu, disk, rem int) {
				t.Helper()
				got := [4]int{kvMatchIn(ix, 1, x, prefix.MediumGPU), kvMatchIn(ix, 1, x, prefix.MediumCPU), kvMatchIn(ix, 1, x, prefix.MediumDisk), kvMatchIn(ix, 1, x, prefix.MediumRemote)}
				if want := [4]int{gpu, cpu, disk, rem}; got != want {
					t.Fatalf("%s: GPU, CPU, DISK, REMOTE match %v, want %v", what, got, want)
				}
				if n := kvMatchIn(ix, 0, x, prefix.MediumCPU) + kvMatchIn(ix, 0, x, prefix.MediumGPU); n != 0 {
					t.Fatalf("%s: endpoint 0 matches %d", what, n)
				}
			}
			apply(0, kvStore(x, 0), offload(kvevents.MediumCPU, h...), offload(kvevents.MediumDisk, h[:3]...), remote,
				offload(kvevents.MediumCPU, 0xdeadbeef))
			// An engine's stream cannot claim the shared store's medium.
			check("stored", 6, 6, 3, 0)
			st := a.Stats()
			if st.Stored != 4 || st.Refused != 1 || st.Invalid != 0 || st.UnresolvedStores != 1 || st.OtherMedia != 0 || st.UnknownParents != 0 {
				t.Fatalf("stats %+v", st)
			}
			// The store's stream (endpoint 1's slot here) may name REMOTE only.
			sa := NewStoreEventApplier(ix, 1, KVSeeds(kvModel))
			storeApply := func(seq uint64, evs ...kvevents.Event) {
				t.Helper()
				b, err := kvevents.DecodeBatch(kvevents.AppendBatch(nil, 1, evs, 0, enc))
				if err != nil {
					t.Fatal(err)
				}
				sa.KVBatch(seq, &b)
			}
			storeApply(0, remote, kvStore(x, 0))
			if st := sa.Stats(); st.Stored != 1 || st.Refused != 1 {
				t.Fatalf("store stats %+v", st)
			}
			check("store applied", 6, 6, 3, 6)
			// The engine evicts the GPU copies: the lower tiers keep them.
			apply(1, removeIn(kvevents.MediumGPU, 0, 1, 2, 3, 4, 5))
			check("GPU evicted", 0, 6, 3, 6)
			apply(2, removeIn(kvevents.MediumCPU, 4), kvevents.Event{Type: kvevents.TierBlocksCleared, Medium: kvevents.MediumDisk})
			check("CPU block 4 evicted, disk cleared", 0, 4, 0, 6)
			// Loaded back onto the GPU: the engine stores it with tokens again.
			apply(3, kvStore(x[:16*2], 0))
			check("reloaded", 2, 4, 0, 6)
			storeApply(1, removeIn(kvevents.MediumRemote, 0, 1, 2, 3, 4, 5))
			apply(4, removeIn(kvevents.MediumCPU, 0, 1, 2, 3, 5), removeIn(kvevents.MediumGPU, 0, 1))
			check("all evicted", 0, 0, 0, 0)
			if st := ix.EndpointStats(1); st.EngineKeys != 0 || st.Orphans != 0 {
				t.Fatalf("index keeps %+v", st)
			}
			if st := a.Stats(); st.Stored != 5 || st.Removed != 4 || st.Cleared != 1 || st.Invalid != 0 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

// TestKVEventsLoRAIDOnly: an engine that names an adapter by lora_id alone
// (vLLM before lora_name) has its adapter's blocks indexed apart from the
// base model's: a base-model prompt with the same tokens matches nothing.
func TestKVEventsLoRAIDOnly(t *testing.T) {
	ix, _ := prefix.NewPreciseIndex(1, 16)
	a := NewKVEventApplier(ix, 0, KVSeeds(kvModel))
	toks := kvTokens(100, 64)
	a.KVBatch(0, &kvevents.Batch{Events: []kvevents.Event{{Type: kvevents.BlockStored, BlockHashes: []uint64{11, 12, 13, 14},
		TokenIDs: toks, BlockSize: 16, LoRAID: 3}}})
	if st := a.Stats(); st.Stored != 1 {
		t.Fatalf("stats %+v", st)
	}
	if n := kvMatch(ix, 0, toks, ""); n != 0 {
		t.Fatalf("a base-model prompt matches %d blocks an adapter computed", n)
	}
	a.KVBatch(1, &kvevents.Batch{Events: []kvevents.Event{{Type: kvevents.BlockStored, BlockHashes: []uint64{21, 22, 23, 24},
		TokenIDs: toks, BlockSize: 16}}})
	if n := kvMatch(ix, 0, toks, ""); n != 4 {
		t.Fatalf("the base model's own blocks match %d, want 4", n)
	}
}
