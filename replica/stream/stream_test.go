package stream

import (
	"context"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/infergate/infergate/internal/redistest"
	"github.com/infergate/infergate/replica"
	"github.com/infergate/infergate/sched"
)

// node is a replica.Node whose Target knows one endpoint and records what
// it learns, applied from an Exchange's reader.
type node struct {
	replica.Node
	mu     sync.Mutex
	learnt [][]uint64
}

func (n *node) Resolve(model, endpoint string, _ sched.Role) (sched.PeerLearner, int, bool) {
	return n, 0, model == "m" && endpoint == "http://e"
}

func (n *node) Intern(url []byte) (string, bool) { return "http://e", string(url) == "http://e" }

func (n *node) LearnPeer(_ int, h []uint64) {
	n.mu.Lock()
	n.learnt = append(n.learnt, append([]uint64(nil), h...))
	n.mu.Unlock()
}

func newNode(id string) *node {
	n := &node{}
	n.Node = replica.Node{ID: id, Peers: replica.NewPeers(time.Hour), Target: n}
	return n
}

func (n *node) handler() Handler {
	var mu sync.Mutex
	return func(b []byte, _ bool) {
		mu.Lock()
		defer mu.Unlock()
		_, _ = n.Apply(b, 0)
	}
}

func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(redistest.Wait)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestExchange: two replicas on one real Redis see each other's learns
// and loads, skip their own, and count a hostile stream's entries as
// malformed without harm.
func TestExchange(t *testing.T) {
	srv := redistest.Start(t, 0)
	a, b := newNode("a"), newNode("b")
	xa, err := Start(Config{URL: srv.URL(), Stream: "t"}, a.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer xa.Close()
	xb, err := Start(Config{URL: srv.URL(), Stream: "t"}, b.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer xb.Close()
	eventually(t, "both readers up", func() bool { return xa.Up() && xb.Up() })
	xa.Publish(replica.AppendLearn(nil, "a", 1, "m", "http://e", 100, 60, []uint64{1, 2, 3}))
	xb.Publish(replica.AppendLoad(nil, "b", 1, []replica.LoadEntry{{Endpoint: "http://e", Load: replica.Load{InFlight: 4, InFlightTokens: 5, PendingPrefill: 6}}}))
	eventually(t, "b learns a's decision", func() bool { return b.Counts.Learns.Load() == 1 })
	eventually(t, "a gets b's load", func() bool { return a.Counts.Loads.Load() == 1 })
	if got := a.Peers.Sum("http://e", 0); got != (replica.Load{InFlight: 4, InFlightTokens: 5, PendingPrefill: 6}) {
		t.Fatalf("a sees %+v", got)
	}
	if got := b.Peers.Sum("http://e", 0); got != (replica.Load{InFlight: 1, InFlightTokens: 100, PendingPrefill: 60}) {
		t.Fatalf("b credits a with %+v", got)
	}
	eventually(t, "own messages skipped", func() bool { return a.Counts.Own.Load() == 1 && b.Counts.Own.Load() == 1 })

	// A hostile writer: garbage bytes, a huge count, a foreign field.
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	ctx := context.Background()
	for _, v := range []any{[]any{field, "garbage"}, []any{field, string([]byte{1, 1, 1, 'x', 0, 0xff, 0xff, 0xff, 0xff, 0x7f})}, []any{"other", "x"}} {
		if err := c.XAdd(ctx, &redis.XAddArgs{Stream: "t", Values: v}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "hostile entries counted", func() bool {
		return b.Counts.Malformed.Load() == 2 && xb.Counts.NotBytes.Load() == 1
	})
	if xa.Counts.Published.Load() != 1 || xa.Counts.Dropped.Load() != 0 {
		t.Errorf("a published %d, dropped %d", xa.Counts.Published.Load(), xa.Counts.Dropped.Load())
	}
}

// TestExchangeRedisDown: with Redis gone publishing never waits (the
// queue drops when full) and the exchange reports down; when Redis is
// back on the same address the exchange resumes.
func TestExchangeRedisDown(t *testing.T) {
	srv := redistest.Start(t, 0)
	a, b := newNode("a"), newNode("b")
	xa, err := Start(Config{URL: srv.URL(), Stream: "t", Queue: 4, Timeout: 500 * time.Millisecond}, a.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer xa.Close()
	eventually(t, "up", xa.Up)
	srv.Stop()
	eventually(t, "down", func() bool { return !xa.Up() })
	start := time.Now()
	for range 100 {
		xa.Publish(replica.AppendLearn(nil, "a", 1, "m", "http://e", 1, 1, []uint64{1}))
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("publishing with Redis down took %v", d) // generous: it must not wait on Redis
	}
	eventually(t, "drops counted", func() bool { return xa.Counts.Dropped.Load() >= 96 })

	_, port, _ := net.SplitHostPort(srv.Addr)
	p, _ := strconv.Atoi(port)
	srv2 := redistest.Start(t, p)
	xb, err := Start(Config{URL: srv2.URL(), Stream: "t"}, b.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer xb.Close()
	eventually(t, "both up again", func() bool { return xa.Up() && xb.Up() })
	eventually(t, "b learns from a after the restart", func() bool {
		xa.Publish(replica.AppendLearn(nil, "a", 1, "m", "http://e", 1, 1, []uint64{9}))
		time.Sleep(50 * time.Millisecond)
		return b.Counts.Learns.Load() > 0
	})
}

// TestReplay: a replica started with Replay reads the stream's history:
// learns warm its index; loads there are stale and skipped.
func TestReplay(t *testing.T) {
	srv := redistest.Start(t, 0)
	a := newNode("a")
	xa, err := Start(Config{URL: srv.URL(), Stream: "t"}, a.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer xa.Close()
	for i := range 300 {
		xa.Publish(replica.AppendLearn(nil, "a", 1, "m", "http://e", 1, 1, []uint64{uint64(i)}))
	}
	xa.Publish(replica.AppendLoad(nil, "a", 1, nil))
	eventually(t, "published", func() bool { return xa.Counts.Published.Load() == 301 })
	b := newNode("b")
	var replayed, loads int
	var mu sync.Mutex
	xb, err := Start(Config{URL: srv.URL(), Stream: "t", Replay: true}, func(m []byte, r bool) {
		mu.Lock()
		defer mu.Unlock()
		if r {
			replayed++
		}
		var msg replica.Msg
		if replica.Decode(m, &msg) == nil && msg.Kind == replica.KindLoad {
			if !r {
				loads++
			}
			return
		}
		_, _ = b.Apply(m, 0)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer xb.Close()
	eventually(t, "history read", func() bool { return b.Counts.Learns.Load() == 300 })
	mu.Lock()
	defer mu.Unlock()
	if replayed < 256 {
		t.Errorf("%d entries marked replayed, want at least the first batch", replayed)
	}
}

// TestConnected: the reader measures a PING's round trip once, before its
// first read, retrying while Redis is down, and reports it (Connected).
func TestConnected(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there until the server starts
	rtts := make(chan time.Duration, 4)
	a := newNode("a")
	x, err := Start(Config{URL: "redis://" + addr, Stream: "t", Timeout: 500 * time.Millisecond,
		Connected: func(d time.Duration) { rtts <- d }}, a.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	eventually(t, "a failed ping", func() bool { return x.Counts.Errors.Load() > 0 })
	select {
	case d := <-rtts:
		t.Fatalf("Connected(%v) with Redis down", d)
	default:
	}
	_, port, _ := net.SplitHostPort(addr)
	p, _ := strconv.Atoi(port)
	redistest.Start(t, p)
	select {
	case d := <-rtts:
		if d <= 0 {
			t.Fatalf("round trip %v", d)
		}
	case <-time.After(redistest.Wait):
		t.Fatal("Connected not called once Redis was up")
	}
	eventually(t, "up", x.Up)
	eventually(t, "a reads after Connected", func() bool {
		x.Publish(replica.AppendLearn(nil, "a", 1, "m", "http://e", 1, 1, []uint64{1}))
		time.Sleep(50 * time.Millisecond)
		return a.Counts.Own.Load() > 0
	})
	if len(rtts) != 0 {
		t.Fatalf("Connected called %d more times", len(rtts))
	}
}

// TestConnectedPingRefused: a Redis whose ACL grants the exchange's user
// the stream commands but not PING (a least-privilege user, +@stream)
// answers the PING with an error; that answer is a round trip all the
// same, so Connected gets it and the reader starts. Before, the reader
// retried the PING for ever and never read: the replica published its
// learns but learnt none of its peers'.
func TestConnectedPingRefused(t *testing.T) {
	srv := redistest.Start(t, 0)
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer admin.Close()
	ctx := context.Background()
	if err := admin.Do(ctx, "ACL", "SETUSER", "gw", "on", ">pw", "~*", "+@stream").Err(); err != nil {
		t.Fatal(err)
	}
	url := "redis://gw:pw@" + srv.Addr
	rtts := make(chan time.Duration, 4)
	a, b := newNode("a"), newNode("b")
	xa, err := Start(Config{URL: url, Stream: "t", Connected: func(d time.Duration) { rtts <- d }}, a.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer xa.Close()
	xb, err := Start(Config{URL: url, Stream: "t"}, b.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer xb.Close()
	select {
	case d := <-rtts:
		if d <= 0 {
			t.Fatalf("round trip %v", d)
		}
	case <-time.After(redistest.Wait):
		t.Fatalf("Connected not called: a PING refused by the ACL held the reader (%d errors)", xa.Counts.Errors.Load())
	}
	eventually(t, "a learns b's decisions", func() bool {
		xb.Publish(replica.AppendLearn(nil, "b", 1, "m", "http://e", 1, 1, []uint64{1}))
		time.Sleep(50 * time.Millisecond)
		return a.Counts.Learns.Load() > 0
	})
	if len(rtts) != 0 {
		t.Fatalf("Connected called %d more times", len(rtts))
	}
}

// TestStreamRecreated: a reader that read an entry of a far-future id
// (99999999999999-0, written by hand or a hostile client) and then saw the
// stream deleted and written anew with the server's ids reads the new
// stream; it waited for an id above the old one for good before, the
// replicas routing alone while Redis was up.
func TestStreamRecreated(t *testing.T) {
	srv := redistest.Start(t, 0)
	a, b := newNode("a"), newNode("b")
	xa, err := Start(Config{URL: srv.URL(), Stream: "t", Block: 50 * time.Millisecond}, a.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer xa.Close()
	xb, err := Start(Config{URL: srv.URL(), Stream: "t", Block: 50 * time.Millisecond}, b.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer xb.Close()
	eventually(t, "both readers up", func() bool { return xa.Up() && xb.Up() })
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	ctx := context.Background()
	if err := c.XAdd(ctx, &redis.XAddArgs{Stream: "t", ID: "99999999999999-0", Values: []any{field, "x"}}).Err(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the far-future entry read", func() bool { return b.Counts.Malformed.Load() == 1 })
	if err := c.Del(ctx, "t").Err(); err != nil {
		t.Fatal(err)
	}
	xa.Publish(replica.AppendLearn(nil, "a", 1, "m", "http://e", 100, 60, []uint64{1, 2, 3}))
	eventually(t, "b learns a's decision on the new stream", func() bool { return b.Counts.Learns.Load() == 1 })
	if !idLess("1-2", "2-0") || !idLess("5-1", "5-2") || idLess("5-2", "5-2") || idLess("0-0", "x") || idLess("9", "10-0") {
		t.Error("idLess")
	}
}
