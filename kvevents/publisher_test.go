package kvevents

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

func TestPublisherConfig(t *testing.T) {
	c := PublisherConfig{}.WithDefaults()
	if c.Endpoint != "tcp://*:5557" || c.BufferSteps != 10000 || c.HWM != 100000 || c.MaxQueueSize != 100000 || c.Encoding != "map" || c.Topic != "" {
		t.Fatalf("defaults %+v", c)
	}
	for _, bad := range []PublisherConfig{
		{Endpoint: "localhost:5557"}, {Endpoint: "udp://*:1"}, {ReplayEndpoint: "x"},
		{Encoding: "json"}, {BufferSteps: -1}, {HWM: -1}, {MaxQueueSize: -2},
	} {
		if bad.Validate() == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
	for ep, binds := range map[string]bool{
		"tcp://*:5557": true, "tcp://[::]:5557": true, "ipc:///tmp/kv": true, "inproc://kv": true,
		"tcp://router:5557": false, "tcp://127.0.0.1:5557": false,
	} {
		if bindsEndpoint(ep) != binds {
			t.Errorf("%s: binds=%v", ep, !binds)
		}
	}
	for in, want := range map[string]string{
		"tcp://*:5557": "tcp://*:5559", "tcp://*:0": "tcp://*:0", "inproc://kv": "inproc://kv_dp2", "": "",
	} {
		if got := OffsetEndpointPort(in, 2); got != want {
			t.Errorf("offset(%q) = %q, want %q", in, got, want)
		}
	}
}

// zmqMsg is one batch received from a replay socket.
type zmqMsg struct {
	seq     uint64
	payload []byte
}

// replayFrom asks a replay ROUTER at addr, with a DEALER socket, for every
// batch from start on; it returns them in order and checks the end marker.
func replayFrom(t *testing.T, addr string, start uint64) []zmqMsg {
	t.Helper()
	d := zmq4.NewDealer(context.Background())
	defer d.Close()
	if err := d.Dial("tcp://" + addr); err != nil {
		t.Fatal(err)
	}
	req := binary.BigEndian.AppendUint64(nil, start)
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, req)); err != nil {
		t.Fatal(err)
	}
	var out []zmqMsg
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			msg, err := d.Recv()
			if err != nil {
				t.Errorf("replay recv: %v", err)
				return
			}
			if len(msg.Frames) != 3 || len(msg.Frames[0]) != 0 || len(msg.Frames[1]) != 8 {
				t.Errorf("replay reply of %d frames", len(msg.Frames))
				return
			}
			seq := binary.BigEndian.Uint64(msg.Frames[1])
			if seq == 0xFFFFFFFFFFFFFFFF {
				if len(msg.Frames[2]) != 0 {
					t.Error("end marker with a payload")
				}
				return
			}
			out = append(out, zmqMsg{seq: seq, payload: msg.Frames[2]})
		}
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("replay timed out")
	}
	return out
}

// waitSent waits until every batch queued on p has been handed to its PUB socket.
func waitSent(t *testing.T, p *Publisher) {
	t.Helper()
	waitFor(t, "the publisher to send its queue", func() bool {
		p.mu.Lock()
		n := p.nextSeq
		p.mu.Unlock()
		st := p.Stats()
		return st.Published+st.Dropped == n
	})
}

func TestPublisherDropsAndCloses(t *testing.T) {
	before, _ := liveGoroutines()
	// Nobody listens on the endpoint: the publisher keeps dialing, its queue
	// fills, and further batches are dropped and counted without blocking.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ep := "tcp://" + ln.Addr().String()
	ln.Close()
	p, err := NewPublisher(PublisherConfig{Endpoint: ep, MaxQueueSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	ev := []Event{{Type: AllBlocksCleared}}
	results := []bool{p.Publish(1, ev), p.Publish(2, ev), p.Publish(3, ev), p.Publish(4, nil)}
	if fmt.Sprint(results) != "[true true false true]" {
		t.Fatalf("Publish results %v", results)
	}
	if st := p.Stats(); st.Dropped != 1 || st.Published != 0 {
		t.Fatalf("stats %+v", st)
	}
	closed := make(chan struct{})
	go func() {
		p.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("Close hung while dialing")
	}
	if p.Publish(5, ev) || p.Stats().Dropped != 4 { // 2 queued, never connected; 1 full; 1 closed
		t.Fatalf("after Close: %+v", p.Stats())
	}
	p.Close() // idempotent

	// A bound publisher with replay, served once, closes without leaks.
	p, err = NewPublisher(PublisherConfig{Endpoint: "tcp://*:0", ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 2})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		p.Publish(float64(i), ev)
	}
	waitSent(t, p)
	got := replayFrom(t, p.ReplayAddr().String(), 0)
	if len(got) != 2 || got[0].seq != 1 || got[1].seq != 2 {
		t.Fatalf("replay of a 2-batch buffer: %v", got)
	}
	p.Close()

	// The replay buffer is bounded in bytes too: batches of ~81 KiB with a
	// 200 KiB bound keep the last two (and a batch over the bound alone,
	// the newest is always kept).
	p, err = NewPublisher(PublisherConfig{Endpoint: "tcp://*:0", ReplayEndpoint: "tcp://127.0.0.1:0", MaxBufferBytes: 200 << 10})
	if err != nil {
		t.Fatal(err)
	}
	big := []Event{{Type: BlockStored, BlockHashes: make([]uint64, 1024), TokenIDs: make([]uint32, 16<<10), BlockSize: 16}}
	for i := range big[0].TokenIDs {
		big[0].TokenIDs[i] = 70000 // 5 bytes each on the wire: ~81 KiB a batch
	}
	for i := range 5 {
		p.Publish(float64(i), big)
	}
	waitSent(t, p)
	if got := replayFrom(t, p.ReplayAddr().String(), 0); len(got) != 2 || got[0].seq != 3 || got[1].seq != 4 {
		t.Fatalf("replay of a byte-bounded buffer: %d batches", len(got))
	}
	p.Close()

	// A connecting publisher (reconnecting automatically) closes without leaks.
	sub := zmq4.NewSub(context.Background())
	if err := sub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	p, err = NewPublisher(PublisherConfig{Endpoint: "tcp://" + sub.Addr().String(), Topic: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	got1 := make(chan zmq4.Msg, 1)
	go func() {
		m, _ := sub.Recv()
		got1 <- m
	}()
	var msg zmq4.Msg
	for deadline := time.Now().Add(30 * time.Second); msg.Frames == nil; {
		p.Publish(1, ev) // slow joiner: until the subscription has reached the publisher
		select {
		case msg = <-got1:
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("connecting publisher: nothing received")
		}
	}
	if len(msg.Frames) != 3 || string(msg.Frames[0]) != "kv" {
		t.Fatalf("received %q", msg.Frames)
	}
	p.Close()
	sub.Close()
	waitNoLeak(t, before)
}

// liveGoroutines counts goroutines, leaving out the one go-zeromq/zmq4
// v0.17.0 leaks per PUB socket: socket.Close never closes the socket's
// pubMWriter, whose run goroutine waits on a condition variable forever.
func liveGoroutines() (int, string) {
	buf := make([]byte, 4<<20)
	all := string(buf[:runtime.Stack(buf, true)])
	n := 0
	var kept []string
	for _, g := range strings.Split(all, "\n\n") {
		if strings.Contains(g, "zmq4.(*pubMWriter).run") {
			continue
		}
		n++
		kept = append(kept, g)
	}
	return n, strings.Join(kept, "\n\n")
}

func waitNoLeak(t *testing.T, before int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		n, stacks := liveGoroutines()
		if n <= before {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines, want <= %d:\n%s", n, before, stacks)
		}
	}
}
