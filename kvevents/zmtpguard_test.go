package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/internal/polltest"
)

// ---------------------------------------------------------------------------
// A hostile publisher, by hand on a raw TCP socket: ZMTP 3.1 greeting and
// NULL handshake (rfc.zeromq.org/spec/23), then whatever attack says.

// zmtpGreeting is a ZMTP 3.1 greeting of the NULL mechanism, as server or not.
func zmtpGreeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 1
	copy(g[12:], "NULL")
	return g
}

// zmtpFrame encodes one frame: flags (MORE, COMMAND; LONG is set by size).
func zmtpFrame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		b := append([]byte{flags | zmtpLong}, binary.BigEndian.AppendUint64(nil, uint64(len(body)))...)
		return append(b, body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// zmtpReady is a NULL READY command announcing socket type typ, with extra
// raw bytes after the property (a malformed one, for the attacks).
func zmtpReady(typ string, extra []byte) []byte {
	body := []byte("\x05READY\x0bSocket-Type")
	body = binary.BigEndian.AppendUint32(body, uint32(len(typ)))
	body = append(body, typ...)
	return zmtpFrame(zmtpCommand, append(body, extra...))
}

// hostilePub accepts connections on loopback and runs attack on each after
// the handshake (ready is the READY frame it sends; nil: zmtpReady("PUB")).
type hostilePub struct {
	ln       net.Listener
	accepted atomic.Int64
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
}

func newHostilePub(t *testing.T, ready []byte, attack func(c net.Conn)) *hostilePub {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if ready == nil {
		ready = zmtpReady("PUB", nil)
	}
	hp := &hostilePub{ln: ln}
	hp.wg.Add(1)
	go func() {
		defer hp.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			hp.accepted.Add(1)
			hp.mu.Lock()
			hp.conns = append(hp.conns, c)
			hp.mu.Unlock()
			hp.wg.Add(1)
			go func() {
				defer hp.wg.Done()
				defer c.Close()
				if attack == nil { // silent: accept and say nothing
					_, _ = io.Copy(io.Discard, c)
					return
				}
				if _, err := c.Write(zmtpGreeting()); err != nil {
					return
				}
				var peer [64]byte
				if _, err := io.ReadFull(c, peer[:]); err != nil {
					return
				}
				if _, err := c.Write(ready); err != nil {
					return
				}
				if err := zmtpSkipFrame(c); err != nil { // the subscriber's READY
					return
				}
				attack(c)
				_, _ = io.Copy(io.Discard, c) // its SUBSCRIBE, until either side closes
			}()
		}
	}()
	t.Cleanup(hp.close)
	return hp
}

func (hp *hostilePub) addr() string { return "tcp://" + hp.ln.Addr().String() }

func (hp *hostilePub) close() {
	hp.ln.Close()
	hp.mu.Lock()
	for _, c := range hp.conns {
		c.Close()
	}
	hp.mu.Unlock()
	hp.wg.Wait()
}

func zmtpSkipFrame(r io.Reader) error {
	var h [9]byte
	if _, err := io.ReadFull(r, h[:2]); err != nil {
		return err
	}
	size := uint64(h[1])
	if h[0]&zmtpLong != 0 {
		if _, err := io.ReadFull(r, h[2:9]); err != nil {
			return err
		}
		size = binary.BigEndian.Uint64(h[1:9])
	}
	_, err := io.CopyN(io.Discard, r, int64(size))
	return err
}

// waitFor waits until cond holds (polltest.Until: a minute at most).
var waitFor = polltest.Until

// kvBackoffs records the backoffs a subscriber waits.
type kvBackoffs struct {
	mu sync.Mutex
	d  []time.Duration
}

func (b *kvBackoffs) add(d time.Duration) {
	b.mu.Lock()
	b.d = append(b.d, d)
	b.mu.Unlock()
}

func (b *kvBackoffs) get() []time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]time.Duration(nil), b.d...)
}

// runHostile subscribes to hp with small bounds and backoffs.
func runHostile(t *testing.T, hp *hostilePub, maxMsg int) (*kvRunning, *kvRecorder, *kvBackoffs) {
	t.Helper()
	rec := &kvRecorder{}
	sub, err := NewSubscriber(SubscriberConfig{Endpoint: hp.addr(), MaxMessageBytes: maxMsg,
		MinBackoff: 5 * time.Millisecond, MaxBackoff: 40 * time.Millisecond, HandshakeTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	bo := &kvBackoffs{}
	sub.waited = bo.add
	ctx, cancel := context.WithCancel(context.Background())
	r := &kvRunning{sub: sub, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- sub.Run(ctx, rec) }()
	t.Cleanup(func() { r.stop(t) })
	return r, rec, bo
}

// checkBackoff asserts the first n backoffs grow from MinBackoff by
// doubling to MaxBackoff: every connection of the attack failed.
func checkBackoff(t *testing.T, got []time.Duration, n int) {
	t.Helper()
	want := 5 * time.Millisecond
	for i := range n {
		if got[i] != want {
			t.Fatalf("backoffs %v: #%d is %v, want %v (doubling from 5ms to 40ms)", got, i, got[i], want)
		}
		want = min(2*want, 40*time.Millisecond)
	}
}

// TestKVEventsHostileFrames: a publisher that completes the NULL handshake
// and then sends what no engine would. Without the guard, the first attack
// kills the test process in go-zeromq's reader goroutine (panic:
// runtime error: makeslice: len out of range); the second grows the heap
// without bound. With it, each connection is cut before anything is
// allocated for the frame, counted, and redialled with a growing backoff.
func TestKVEventsHostileFrames(t *testing.T) {
	const maxMsg = 1 << 16
	attacks := []struct {
		name   string
		attack func(c net.Conn)
	}{
		{"frame-2^62", func(c net.Conn) {
			_, _ = c.Write(append([]byte{zmtpLong}, binary.BigEndian.AppendUint64(nil, 1<<62)...))
		}},
		{"frame-2^63-1", func(c net.Conn) {
			_, _ = c.Write(append([]byte{zmtpLong | zmtpMore}, binary.BigEndian.AppendUint64(nil, 1<<63-1)...))
		}},
		{"endless-more", func(c net.Conn) {
			f := zmtpFrame(zmtpMore, []byte("x"))
			for {
				if _, err := c.Write(f); err != nil {
					return
				}
			}
		}},
		{"endless-empty-more", func(c net.Conn) {
			f := bytes.Repeat(zmtpFrame(zmtpMore, nil), 512)
			for {
				if _, err := c.Write(f); err != nil {
					return
				}
			}
		}},
		{"just-over", func(c net.Conn) {
			_, _ = c.Write(zmtpFrame(zmtpMore, []byte("t")))
			_, _ = c.Write(zmtpFrame(zmtpMore, make([]byte, 8)))
			_, _ = c.Write(zmtpFrame(0, make([]byte, maxMsg-9+1))) // the message is 1 byte over
		}},
		{"command-over", func(c net.Conn) {
			_, _ = c.Write(append([]byte{zmtpCommand | zmtpLong}, binary.BigEndian.AppendUint64(nil, maxMsg+1)...))
		}},
	}
	for _, a := range attacks {
		t.Run(a.name, func(t *testing.T) {
			hp := newHostilePub(t, nil, a.attack)
			r, rec, bo := runHostile(t, hp, maxMsg)
			// Four sessions ended (a backoff follows each).
			waitFor(t, "4 connections cut", func() bool { return len(bo.get()) >= 4 })
			st := r.sub.Stats()
			if st.Oversized < 4 || st.Connects < 4 || st.Batches != 0 || hp.accepted.Load() < 4 {
				t.Fatalf("stats %+v, %d accepted", st, hp.accepted.Load())
			}
			checkBackoff(t, bo.get(), 4)
			if _, resets := rec.snapshot(); !containsReset(resets, ResetFailure) {
				t.Fatalf("resets %v: the failed session did not reset the handler", resets)
			}
		})
	}
}

func containsReset(rs []ResetReason, want ResetReason) bool {
	for _, r := range rs {
		if r == want {
			return true
		}
	}
	return false
}

// TestKVEventsMessageAtBound: a message of exactly MaxMessageBytes (its
// three frames together) is received and delivered; the guard counts
// nothing.
func TestKVEventsMessageAtBound(t *testing.T) {
	toks := kvTokens(100, 32)
	payload := AppendBatch(nil, 1, []Event{kvStore(toks, 0)}, 0, "")
	maxMsg := 1 + 8 + len(payload)
	hp := newHostilePub(t, nil, func(c net.Conn) {
		msg := append(zmtpFrame(zmtpMore, []byte("t")), zmtpFrame(zmtpMore, binary.BigEndian.AppendUint64(nil, 0))...)
		msg = append(msg, zmtpFrame(0, payload)...)
		for { // the subscription may take a moment to reach us: resend
			if _, err := c.Write(msg); err != nil {
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	})
	r, rec, _ := runHostile(t, hp, maxMsg)
	waitFor(t, "the batch", func() bool { return r.sub.Stats().Batches > 0 })
	if st := r.sub.Stats(); st.Oversized != 0 || st.Panics != 0 || st.DecodeErrors != 0 {
		t.Fatalf("stats %+v", st)
	}
	if n := rec.storedEvents(); n == 0 {
		t.Fatal("batch not delivered")
	}
}

// TestKVEventsHostileHandshake: a READY whose property is cut short panics
// in the library's metadata parser (protocol.go Property.Write slices past
// the body); that runs on the subscriber's goroutine, inside Dial, where the
// session recovers it: counted, the handler reset, redialled with backoff.
// A peer that accepts and never greets is given up after the handshake
// timeout and redialled too.
func TestKVEventsHostileHandshake(t *testing.T) {
	t.Run("truncated-property", func(t *testing.T) {
		// A property name of length 1 and nothing after it.
		ready := zmtpReady("PUB", []byte{1})
		hp := newHostilePub(t, ready, func(net.Conn) {})
		r, rec, bo := runHostile(t, hp, 1<<16)
		waitFor(t, "3 failed sessions", func() bool { return len(bo.get()) >= 3 })
		if n := r.sub.Stats().Panics; n < 3 {
			t.Fatalf("%d panics recovered in 3 sessions", n)
		}
		checkBackoff(t, bo.get(), 3)
		if _, resets := rec.snapshot(); !containsReset(resets, ResetFailure) {
			t.Fatalf("resets %v", resets)
		}
	})
	t.Run("silent", func(t *testing.T) {
		hp := newHostilePub(t, nil, nil)
		r, _, bo := runHostile(t, hp, 1<<16)
		waitFor(t, "3 dials", func() bool { return hp.accepted.Load() >= 3 })
		if st := r.sub.Stats(); st.Connects != 0 {
			t.Fatalf("stats %+v: a silent peer counted as connected", st)
		}
		if got := bo.get(); len(got) < 2 || got[1] != 2*got[0] {
			t.Fatalf("backoffs %v", got)
		}
		r.stop(t) // and Run returns promptly
	})
}

// TestZMTPGuardFraming drives the guard under a reader that asks for the
// sizes the library asks for (greeting, 2-byte header, rest of a long size,
// body) and for odd sizes, over a valid stream: it passes every byte as is.
func TestZMTPGuardFraming(t *testing.T) {
	stream := append(zmtpGreeting(), zmtpReady("PUB", nil)...)
	stream = append(stream, zmtpFrame(zmtpMore, []byte("topic"))...)
	stream = append(stream, zmtpFrame(zmtpMore, nil)...)
	stream = append(stream, zmtpFrame(0, bytes.Repeat([]byte("p"), 300))...)
	stream = append(stream, zmtpFrame(zmtpCommand, []byte("\x04PING"))...)
	for _, chunk := range []int{1, 2, 7, 64, 4096} {
		out, err := zmtpGuardRead(stream, 1<<10, chunk)
		if err != nil || !bytes.Equal(out, stream) {
			t.Fatalf("chunk %d: %v, %d of %d bytes", chunk, err, len(out), len(stream))
		}
	}
	// 301 bytes over a 300-byte bound: cut at the header, before its body.
	out, err := zmtpGuardRead(stream, 300, 4096)
	var lerr *ZMTPLimitError
	if !errors.As(err, &lerr) || lerr.What != "message size" || lerr.Got != 5+300 {
		t.Fatalf("err %v", err)
	}
	if want := len(stream) - len(zmtpFrame(zmtpCommand, []byte("\x04PING"))) - 300 - 9; len(out) != want {
		t.Fatalf("passed %d bytes, want %d (up to the oversized frame's header)", len(out), want)
	}
	if !strings.Contains(err.Error(), "over the limit 300") {
		t.Fatalf("error %q", err)
	}
}

// zmtpGuardRead reads stream through a guard in reads of chunk bytes.
func zmtpGuardRead(stream []byte, maxMsg uint64, chunk int) ([]byte, error) {
	a, b := net.Pipe()
	go func() {
		_, _ = a.Write(stream)
		a.Close()
	}()
	g := newZMTPGuard(context.Background(), b, zmtpLimits{maxMessage: maxMsg, maxFrames: maxFrames})
	defer g.Close()
	var out []byte
	buf := make([]byte, chunk)
	for {
		n, err := g.Read(buf)
		out = append(out, buf[:n]...)
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return out, err
		}
	}
}

// FuzzZMTPGuard feeds arbitrary streams to the guard: it never passes a
// frame header announcing more than the bound, nor more frames per message,
// and never panics. The seeds are the attack shapes above.
func FuzzZMTPGuard(f *testing.F) {
	hs := append(zmtpGreeting(), zmtpReady("PUB", nil)...)
	f.Add(append(append([]byte{}, hs...), append([]byte{zmtpLong}, binary.BigEndian.AppendUint64(nil, 1<<62)...)...))
	f.Add(append(append([]byte{}, hs...), bytes.Repeat(zmtpFrame(zmtpMore, []byte("x")), 40)...))
	f.Add(append(append([]byte{}, hs...), bytes.Repeat(zmtpFrame(zmtpMore, nil), 40)...))
	f.Add(append(append([]byte{}, hs...), zmtpFrame(0, make([]byte, 257))...))
	f.Add(append(zmtpGreeting(), zmtpReady("PUB", []byte{1})...))
	f.Fuzz(func(t *testing.T, stream []byte) {
		out, _ := zmtpGuardRead(stream, 256, 7)
		if !bytes.HasPrefix(stream, out) {
			t.Fatal("the guard changed the stream")
		}
		// Re-parse what passed: every complete header is within bounds.
		if len(out) <= 64 {
			return
		}
		rest, frames, msg := out[64:], 0, uint64(0)
		for len(rest) >= 2 {
			flags, size, hl := rest[0], uint64(rest[1]), 2
			if flags&zmtpLong != 0 {
				if len(rest) < 9 {
					return
				}
				size, hl = binary.BigEndian.Uint64(rest[1:9]), 9
			}
			frames++
			msg += size
			if size > 256 || msg > 256 || frames > maxFrames {
				t.Fatalf("passed a header of %d bytes, message %d, frame %d", size, msg, frames)
			}
			if uint64(len(rest)-hl) < size {
				return
			}
			rest = rest[uint64(hl)+size:]
			if flags&zmtpMore == 0 || flags&zmtpCommand != 0 {
				frames, msg = 0, 0
			}
		}
	})
}
