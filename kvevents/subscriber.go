package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Subscriber: a SUB socket per engine (docs/PROTOCOLS.md §1.2-1.3), sequence
// numbers, gap detection, replay over the engine's ROUTER, reconnects.

// ResetReason says why a Handler must forget what it learnt from a stream.
type ResetReason uint8

// Reset reasons.
const (
	// ResetStart: Run started; whatever the handler knew of this engine is
	// of unknown age.
	ResetStart ResetReason = iota
	// ResetGap: batches were lost and replay could not restore them all.
	ResetGap
	// ResetRestart: the publisher restarted (its sequence numbers went
	// back), so the engine's cache is a new one.
	ResetRestart
	// ResetDecode: a batch could not be decoded.
	ResetDecode
	// ResetResync: the owner asked for it (Subscriber.Resync: the
	// endpoint failed a health check or was ejected, and its engine may
	// have restarted).
	ResetResync
	// ResetFailure: a session ended in a recovered panic, part way
	// through whatever it was doing.
	ResetFailure
)

// String returns "start", "gap", "restart", "decode", "resync" or "failure".
func (r ResetReason) String() string {
	switch r {
	case ResetStart:
		return "start"
	case ResetGap:
		return "gap"
	case ResetRestart:
		return "restart"
	case ResetDecode:
		return "decode"
	case ResetResync:
		return "resync"
	case ResetFailure:
		return "failure"
	}
	return fmt.Sprintf("ResetReason(%d)", uint8(r))
}

// Handler receives one engine's KV-event stream from a Subscriber, on Run's
// goroutine (fleet.KVEventApplier keeps it in the gateway's index).
type Handler interface {
	// KVBatch applies one batch. Batches arrive in sequence order without
	// gaps, except after a KVReset. b must not be retained after the call.
	KVBatch(seq uint64, b *Batch)
	// KVReset tells the handler to forget everything it learnt from the
	// stream: it can no longer be sure of it. Forgetting is safe (a missed
	// prefix hit), believing stale blocks is not (a routing decision made on
	// blocks the engine no longer holds).
	KVReset(reason ResetReason)
}

// Defaults of SubscriberConfig.
const (
	DefaultMinBackoff    = 100 * time.Millisecond
	DefaultMaxBackoff    = 5 * time.Second
	DefaultReplayTimeout = 5 * time.Second
)

// SubscriberConfig configures a Subscriber (the gateway's kv_events of an
// endpoint). Zero durations take defaults.
type SubscriberConfig struct {
	// Endpoint is the engine's PUB socket, tcp://host:port (vLLM
	// --kv-events-config endpoint, with the engine's host in place of "*").
	// The subscriber dials it.
	Endpoint string
	// ReplayEndpoint is the engine's replay ROUTER socket (vLLM
	// replay_endpoint), or "" when it has none: lost batches then reset the
	// handler.
	ReplayEndpoint string
	// Topic is the topic prefix subscribed to ("" for every message).
	Topic string
	// MinBackoff and MaxBackoff bound the wait before redialing after a
	// failed dial or a lost connection; it doubles per failure and returns
	// to MinBackoff once messages flow.
	MinBackoff, MaxBackoff time.Duration
	// ReplayTimeout bounds one replay request.
	ReplayTimeout time.Duration
	// MaxMessageBytes bounds one message from the engine, its frames
	// together (default DefaultMaxMessageBytes): a connection whose peer
	// announces more is closed before anything is allocated for it, counted
	// in Oversized, and redialled after the backoff (zmtpguard.go).
	MaxMessageBytes int
	// HandshakeTimeout bounds the ZMTP greeting and handshake of a dial
	// (default DefaultHandshakeTimeout).
	HandshakeTimeout time.Duration
}

// SubscriberStats are a subscriber's cumulative counters.
type SubscriberStats struct {
	// Connects counts successful dials of the PUB socket.
	Connects uint64
	// Batches counts batches delivered to the handler (live and replayed);
	// Events the known events in them, UnknownEvents the others.
	Batches, Events, UnknownEvents uint64
	// Replayed counts batches delivered from the replay socket.
	Replayed uint64
	// Gaps counts sequence gaps in the live stream; ReplayFailures replay
	// requests that failed or came back incomplete.
	Gaps, ReplayFailures uint64
	// Restarts counts publisher restarts detected.
	Restarts uint64
	// Resets counts KVReset calls.
	Resets uint64
	// DecodeErrors counts payloads that failed to decode; Malformed messages
	// that were not [topic, 8-byte seq, payload].
	DecodeErrors, Malformed uint64
	// Oversized counts connections (PUB or replay) closed because the peer
	// announced a frame or message over MaxMessageBytes, or more than 16
	// frames in one message.
	Oversized uint64
	// Panics counts sessions ended by a recovered panic (the handler is then
	// reset and the engine redialled after the backoff).
	Panics uint64
	// Resyncs counts Resync calls.
	Resyncs uint64
}

// Subscriber follows one engine's KV-event stream (docs/PROTOCOLS.md
// §1.2-1.3): a SUB socket dials the engine's PUB socket and every message
// [topic, seq (8-byte big-endian), payload] is decoded and handed to a
// Handler in sequence order.
//
// Sequence numbers start at 0 per publisher process and grow by one per
// batch. A gap (a batch dropped at the publisher's high-water mark, or sent
// while the connection was down) is filled from the engine's replay socket
// when there is one: a DEALER asks for the batches from the first missing
// one, and they are delivered, in order, before the batch that revealed the
// gap. When there is no replay socket, or it cannot fill the whole gap, the
// handler is reset instead. A sequence number that goes back means the
// publisher restarted: reset as well. At the start of a stream (Run, or a
// restart) the batches before the first one received are replayed when
// available, so that the handler sees the engine's cache from its start as
// far as the engine's buffer reaches.
//
// Limits: an engine that restarts and has published more batches than the
// old one by the time the subscriber hears from it again looks like a gap,
// not a restart (the sequence numbers alone cannot tell): the old life's
// blocks then stay in the handler until its next reset, which the owner may
// trigger from another restart signal (a changed process start time in the
// engine's metrics, a failed health check: Resync). A connection that stays
// open but silently dead (no FIN, no RST) is noticed only by TCP keepalive.
//
// Hostile peers: every connection is dialled through the ZMTP guard
// (zmtpguard.go), which bounds messages (MaxMessageBytes, 16 frames) and the
// handshake (HandshakeTimeout) before go-zeromq allocates anything; a
// session that panics is recovered. Either failure costs this subscription
// only: the handler is reset, the failure counted (Oversized, Panics) and
// the engine redialled after a backoff that keeps growing. go-zeromq
// v0.17.0 may leave one of its own goroutines blocked forever when a socket
// closes with its receive queue full; Run drains the queue when it closes a
// socket to make that unlikely.
type Subscriber struct {
	cfg SubscriberConfig

	connects, batches, events, unknown       atomic.Uint64
	replayed, gaps, replayFailures, restarts atomic.Uint64
	resets, decodeErrors, malformed          atomic.Uint64
	oversized, panics, resyncs               atomic.Uint64

	// mu guards resync and cancel: Resync sets resync and ends the running
	// session (cancel), Run forgets the stream before its next session.
	mu     sync.Mutex
	resync bool
	cancel context.CancelFunc

	// waited, when set (tests), is told every backoff Run waits.
	waited func(time.Duration)
}

// NewSubscriber validates cfg and returns a subscriber; Run starts it.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	check := func(name, ep string) error {
		scheme, addr, ok := strings.Cut(ep, "://")
		if !ok || addr == "" || (scheme != "tcp" && scheme != "ipc" && scheme != "inproc") {
			return fmt.Errorf("kv events %s %q: want tcp://host:port", name, ep)
		}
		return nil
	}
	if err := check("endpoint", cfg.Endpoint); err != nil {
		return nil, err
	}
	if cfg.ReplayEndpoint != "" {
		if err := check("replay endpoint", cfg.ReplayEndpoint); err != nil {
			return nil, err
		}
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = DefaultMinBackoff
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = DefaultMaxBackoff
	}
	cfg.MaxBackoff = max(cfg.MaxBackoff, cfg.MinBackoff)
	if cfg.ReplayTimeout <= 0 {
		cfg.ReplayTimeout = DefaultReplayTimeout
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if err := registerGuard(); err != nil {
		return nil, err
	}
	return &Subscriber{cfg: cfg}, nil
}

// Config returns the configuration with defaults applied.
func (s *Subscriber) Config() SubscriberConfig { return s.cfg }

// Stats returns the subscriber's counters.
func (s *Subscriber) Stats() SubscriberStats {
	return SubscriberStats{
		Connects: s.connects.Load(), Batches: s.batches.Load(), Events: s.events.Load(),
		UnknownEvents: s.unknown.Load(), Replayed: s.replayed.Load(), Gaps: s.gaps.Load(),
		ReplayFailures: s.replayFailures.Load(), Restarts: s.restarts.Load(), Resets: s.resets.Load(),
		DecodeErrors: s.decodeErrors.Load(), Malformed: s.malformed.Load(),
		Oversized: s.oversized.Load(), Panics: s.panics.Load(), Resyncs: s.resyncs.Load(),
	}
}

// quiet discards zmq4's log lines (it logs every failed handshake).
var quiet = log.New(io.Discard, "", 0)

// Run resets h (ResetStart), then follows the stream and feeds h until ctx
// is done, redialing with backoff whenever the dial fails or the connection
// drops; it returns ctx's error. h is called on Run's goroutine only. Run may
// be called again after it returned; not concurrently with itself.
//
// A session that ends in a panic (recovered: its own, the handler's, or the
// ZMTP library's on this goroutine) or on a peer over the message bounds
// counts as a failure: the backoff keeps growing even if messages had
// arrived, so a hostile peer is redialled at most every MaxBackoff.
func (s *Subscriber) Run(ctx context.Context, h Handler) error {
	s.reset(h, ResetStart)
	st := kvStream{}
	backoff := s.cfg.MinBackoff
	for {
		if s.takeResync() {
			s.reset(h, ResetResync)
			st = kvStream{}
		}
		sctx, cancel := context.WithCancel(ctx)
		s.mu.Lock()
		s.cancel = cancel
		s.mu.Unlock()
		received, failed := s.safeSession(sctx, h, &st)
		s.mu.Lock()
		s.cancel = nil
		resync := s.resync
		s.mu.Unlock()
		cancel()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if failed {
			s.reset(h, ResetFailure)
			st = kvStream{}
		} else if received || resync {
			backoff = s.cfg.MinBackoff
		}
		if s.waited != nil {
			s.waited(backoff)
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		backoff = min(2*backoff, s.cfg.MaxBackoff)
	}
}

// Resync makes Run forget the stream: the running session ends (its
// connection closes, with whatever it had queued), the handler is reset
// (ResetResync) and the engine is dialled again as a new stream, whose
// batches from the first one are replayed when the engine has a replay
// socket. The owner calls it when the endpoint leaves rotation (a failed
// health check, an ejection): an engine that restarted in place publishes
// nothing until it serves, so its stream alone would reveal the restart
// only after requests were routed on the old cache. Safe for concurrent use;
// it does not wait.
func (s *Subscriber) Resync() {
	s.resyncs.Add(1)
	s.mu.Lock()
	s.resync = true
	if s.cancel != nil {
		s.cancel()
	}
	s.mu.Unlock()
}

func (s *Subscriber) takeResync() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.resync
	s.resync = false
	return r
}

// safeSession runs session, recovering a panic: it is counted and logged,
// and reported as a failure. Panics in the library's own goroutines cannot
// be recovered here; the ZMTP guard (zmtpguard.go) keeps the one known
// there from happening.
func (s *Subscriber) safeSession(ctx context.Context, h Handler, st *kvStream) (received, failed bool) {
	before := s.oversized.Load()
	defer func() {
		if p := recover(); p != nil {
			// The stack is logged once per subscriber: a hostile peer may
			// repeat the panic at every dial.
			if s.panics.Add(1) == 1 {
				slog.Error("kv events: subscriber session panicked; redialling after the backoff",
					"endpoint", s.cfg.Endpoint, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
			} else {
				slog.Error("kv events: subscriber session panicked again; redialling after the backoff",
					"endpoint", s.cfg.Endpoint, "panic", fmt.Sprint(p), "panics", s.panics.Load())
			}
			received, failed = false, true
		}
	}()
	received = s.session(ctx, h, st)
	return received, s.oversized.Load() != before
}

// kvStream is Run's position in the stream.
type kvStream struct {
	started bool   // a batch was delivered since the last reset
	next    uint64 // the sequence number expected next
	// dupFrom: after the catch-up on joining, live messages with seq in
	// [dupFrom, next) are the replayed batches again (queued while the
	// replay ran), not a restart; valid while dup is set, which the first
	// live message at or past next clears.
	dupFrom uint64
	dup     bool
}

// kvJoinDelay is how long after dialling the subscriber waits before it
// asks the replay socket for what it missed: long enough for the
// subscription to reach the publisher (ZeroMQ's "slow joiner"), so that
// nothing published around the join falls between replay and live stream.
const kvJoinDelay = 100 * time.Millisecond

// session dials the PUB socket and handles messages until the connection
// drops or ctx is done. It reports whether any message arrived.
func (s *Subscriber) session(ctx context.Context, h Handler, st *kvStream) (received bool) {
	ep, err := guardedEndpoint(s.cfg.Endpoint)
	if err != nil {
		return false
	}
	sub := zmq4.NewSub(s.guarded(ctx), zmq4.WithLogger(quiet), zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(s.cfg.HandshakeTimeout))
	defer kvClose(sub)
	if err := sub.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		return false
	}
	if err := sub.Dial(ep); err != nil {
		return false
	}
	s.connects.Add(1)
	st.dup = false // a new connection: a lower seq now means a restart
	if s.cfg.ReplayEndpoint != "" {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(kvJoinDelay):
		}
		s.joinCatchUp(ctx, h, st)
	}
	for {
		msg, err := sub.Recv()
		if err != nil {
			return received // connection lost, or ctx done
		}
		received = true
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
			s.malformed.Add(1)
			continue
		}
		s.receive(ctx, h, st, binary.BigEndian.Uint64(msg.Frames[1]), msg.Frames[2])
	}
}

// guarded returns ctx carrying the bounds of the connections dialled under
// it (zmtpguard.go).
func (s *Subscriber) guarded(ctx context.Context) context.Context {
	return withZMTPLimits(ctx, zmtpLimits{maxMessage: uint64(s.cfg.MaxMessageBytes), maxFrames: maxFrames,
		handshake: s.cfg.HandshakeTimeout, exceeded: &s.oversized})
}

// kvClose closes a socket, then drains what its connection readers queued,
// so that none stays blocked on the queue (go-zeromq v0.17.0's qreader.listen
// sends to its 10-message queue without watching the context). Receiving on
// a closed socket returns at once.
func kvClose(sock zmq4.Socket) {
	_ = sock.Close()
	for range 64 {
		_, _ = sock.Recv()
	}
}

// receive handles one live message.
func (s *Subscriber) receive(ctx context.Context, h Handler, st *kvStream, seq uint64, payload []byte) {
	if st.dup {
		if seq >= st.dupFrom && seq < st.next {
			return // delivered by the catch-up on joining
		}
		st.dup = false
	}
	b, err := DecodeBatch(payload)
	switch {
	case !st.started:
		if seq > 0 {
			s.catchUp(ctx, h, 0, seq, false)
		}
	case seq == st.next:
	case seq > st.next:
		s.gaps.Add(1)
		s.catchUp(ctx, h, st.next, seq, true)
	default: // seq < next
		s.restarts.Add(1)
		s.reset(h, ResetRestart)
		if seq > 0 {
			s.catchUp(ctx, h, 0, seq, false)
		}
	}
	st.started, st.next = true, seq+1
	if err != nil {
		s.decodeErrors.Add(1)
		s.reset(h, ResetDecode)
		return
	}
	s.deliver(h, seq, &b)
}

func (s *Subscriber) reset(h Handler, why ResetReason) {
	s.resets.Add(1)
	h.KVReset(why)
}

func (s *Subscriber) deliver(h Handler, seq uint64, b *Batch) {
	s.batches.Add(1)
	s.events.Add(uint64(len(b.Events)))
	s.unknown.Add(uint64(b.Unknown))
	h.KVBatch(seq, b)
}

// joinCatchUp asks the replay socket, right after joining, for every batch
// from the one expected next (0 on a fresh stream) to the newest: without
// it, batches published before the subscription took effect stay missing
// until the engine publishes again (and an idle engine may not for a long
// time). A hole before the first batch returned resets the handler.
func (s *Subscriber) joinCatchUp(ctx context.Context, h Handler, st *kvStream) {
	from := uint64(0)
	if st.started {
		from = st.next
	}
	got, err := s.replay(ctx, from, ReplayEndSeq)
	if ctx.Err() != nil || err != nil || len(got) == 0 {
		return
	}
	if st.started {
		// Batches missed while disconnected: recovered, or (when the
		// buffer no longer reaches back to them) a reset.
		s.gaps.Add(1)
		if got[0].seq != from {
			s.reset(h, ResetGap)
		}
	}
	for i := range got {
		s.replayed.Add(1)
		s.deliver(h, got[i].seq, &got[i].b)
	}
	st.started, st.next = true, got[len(got)-1].seq+1
	st.dupFrom, st.dup = got[0].seq, true
}

// catchUp delivers the batches [from, to) from the replay socket. When the
// handler has seen the batches before from (mustCover), anything short of
// all of them resets it first; what arrived contiguously up to to-1 is
// delivered either way (after a reset it can only add blocks, never leave
// stale ones).
func (s *Subscriber) catchUp(ctx context.Context, h Handler, from, to uint64, mustCover bool) {
	var got []kvSeqBatch
	if s.cfg.ReplayEndpoint != "" {
		var err error
		got, err = s.replay(ctx, from, to)
		if ctx.Err() != nil {
			return
		}
		if err != nil || len(got) == 0 || got[0].seq != from {
			s.replayFailures.Add(1)
		}
	}
	if mustCover && (len(got) == 0 || got[0].seq != from) {
		s.reset(h, ResetGap)
	}
	for i := range got {
		s.replayed.Add(1)
		s.deliver(h, got[i].seq, &got[i].b)
	}
}

type kvSeqBatch struct {
	seq uint64
	b   Batch
}

// replay asks the replay socket for the batches from seq from on and returns
// the contiguous run of them that ends at to-1 (nil with an error when there
// is none), or with to = ReplayEndSeq the contiguous run that ends at the
// newest buffered batch. It reads the reply to its end marker, ignoring
// batches from to on, so that the DEALER is drained when it closes.
func (s *Subscriber) replay(ctx context.Context, from, to uint64) ([]kvSeqBatch, error) {
	ep, err := guardedEndpoint(s.cfg.ReplayEndpoint)
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, s.cfg.ReplayTimeout)
	defer cancel()
	d := zmq4.NewDealer(s.guarded(rctx), zmq4.WithLogger(quiet), zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(s.cfg.ReplayTimeout))
	defer kvClose(d)
	if err := d.Dial(ep); err != nil {
		return nil, fmt.Errorf("kv events replay: %w", err)
	}
	req := binary.BigEndian.AppendUint64(nil, from)
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, req)); err != nil {
		return nil, fmt.Errorf("kv events replay: %w", err)
	}
	var got []kvSeqBatch
	for {
		msg, err := d.Recv()
		if err != nil {
			return nil, fmt.Errorf("kv events replay: %w", err)
		}
		if len(msg.Frames) != 3 || len(msg.Frames[0]) != 0 || len(msg.Frames[1]) != 8 {
			s.malformed.Add(1)
			return nil, fmt.Errorf("kv events replay: reply of %d frames", len(msg.Frames))
		}
		seq := binary.BigEndian.Uint64(msg.Frames[1])
		if seq == ReplayEndSeq {
			break
		}
		if seq < from || seq >= to {
			continue
		}
		b, err := DecodeBatch(msg.Frames[2])
		if err != nil {
			s.decodeErrors.Add(1)
			got = got[:0] // a hole: keep what follows it only
			continue
		}
		if n := len(got); n > 0 && got[n-1].seq+1 != seq {
			got = got[:0]
		}
		got = append(got, kvSeqBatch{seq, b})
	}
	if to == ReplayEndSeq {
		return got, nil
	}
	if len(got) == 0 || got[len(got)-1].seq != to-1 {
		return nil, errors.New("kv events replay: the engine's buffer does not reach the gap")
	}
	return got, nil
}
