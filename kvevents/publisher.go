package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/go-zeromq/zmq4"
)

// Publisher (vllm/distributed/kv_events.py ZmqEventPublisher).

// Defaults of PublisherConfig, those of vLLM's KVEventsConfig
// (vllm/config/kv_events.py).
const (
	DefaultEndpoint    = "tcp://*:5557"
	DefaultBufferSteps = 10000
	// DefaultMaxBufferBytes is PublisherConfig.MaxBufferBytes's default.
	DefaultMaxBufferBytes = 64 << 20
	DefaultHWM            = 100000
	DefaultMaxQueueSize   = 100000
)

// PublisherConfig configures a Publisher (the simulator's
// simserver.ServerConfig.KVEvents, `infergate sim --kv-events-config`). It mirrors
// vLLM's --kv-events-config JSON, every field of KVEventsConfig in
// vllm/config/kv_events.py (newest read: with tier_scoped_clear_events),
// plus Encoding and Bind. Zero fields take defaults.
type PublisherConfig struct {
	// Enable turns KV-cache events on (vLLM enable_kv_cache_events).
	Enable bool `yaml:"enable_kv_cache_events" json:"enable_kv_cache_events"`
	// Publisher is vLLM's publisher kind: "zmq", or "null" (events are
	// recorded but published nowhere). "" is vLLM's default: "zmq" when
	// Enable is set, else "null". Events are published when Publishes().
	Publisher string `yaml:"publisher" json:"publisher"`
	// Endpoint is the PUB socket address (default "tcp://*:5557"). Like vLLM,
	// the socket binds when the address contains "*" or "::" or starts with
	// ipc:// or inproc://, and connects otherwise (a router that binds a SUB
	// socket; reconnects automatically).
	Endpoint string `yaml:"endpoint" json:"endpoint"`
	// ReplayEndpoint, when set, is the address a ROUTER socket binds to
	// answer replay requests (docs/PROTOCOLS.md §1.3).
	ReplayEndpoint string `yaml:"replay_endpoint" json:"replay_endpoint"`
	// BufferSteps is the number of past batches kept for replay (default 10000).
	BufferSteps int `yaml:"buffer_steps" json:"buffer_steps"`
	// MaxBufferBytes bounds the payload bytes of the batches kept for replay
	// (default 64 MiB; the newest batch is always kept): BufferSteps alone
	// lets large batches hold unbounded memory. Not a vLLM option.
	MaxBufferBytes int `yaml:"max_buffer_bytes" json:"max_buffer_bytes"`
	// HWM is the send high-water mark of the PUB socket, in messages
	// (default 100000): messages beyond it are dropped by the socket.
	HWM int `yaml:"hwm" json:"hwm"`
	// MaxQueueSize bounds the in-process queue of batches waiting for the
	// publishing goroutine (default 100000). When it is full the batch is
	// dropped and counted, and its sequence number is skipped so that
	// subscribers see the gap: the engine never waits for the publisher.
	// (vLLM blocks its engine instead.)
	MaxQueueSize int `yaml:"max_queue_size" json:"max_queue_size"`
	// Topic is the first frame of every message (default ""); llm-d uses
	// "kv@<pod>@<model>".
	Topic string `yaml:"topic" json:"topic"`
	// TierScopedClearEvents publishes a prefix-cache reset as
	// TierBlocksCleared(medium="GPU"), in a batch of its own, instead of
	// AllBlocksCleared (vLLM tier_scoped_clear_events: the reset cleared
	// only the GPU block pool; the simulator has no other tier, and vLLM
	// with no KV connector attached publishes the same). Subscribers must
	// decode the tag (fleet does).
	TierScopedClearEvents bool `yaml:"tier_scoped_clear_events" json:"tier_scoped_clear_events"`
	// Encoding is the event encoding: "map" (default; vLLM after PR #42892)
	// or "array" (before). Not a vLLM option.
	Encoding string `yaml:"encoding" json:"encoding"`
	// Bind makes the PUB socket bind Endpoint whatever vLLM's heuristic says
	// (so that "tcp://127.0.0.1:0" listens on loopback only, as the embedded
	// fleet of `infergate up` needs). Not a vLLM option.
	Bind bool `yaml:"bind" json:"bind"`
}

// Publishes reports whether events are published: Enable, and Publisher
// "zmq" or unset (vLLM's EventPublisherFactory: a "null" publisher, or
// events off, publishes nothing).
func (c PublisherConfig) Publishes() bool { return c.Enable && c.Publisher != PublisherNull }

// Publisher kinds of PublisherConfig.Publisher (vLLM's Literal["null", "zmq"]).
const (
	PublisherZMQ  = "zmq"
	PublisherNull = "null"
)

// WithDefaults returns c with zero fields replaced by their defaults.
func (c PublisherConfig) WithDefaults() PublisherConfig {
	if c.Publisher == "" {
		c.Publisher = PublisherNull
		if c.Enable {
			c.Publisher = PublisherZMQ
		}
	}
	if c.Endpoint == "" {
		c.Endpoint = DefaultEndpoint
	}
	if c.MaxBufferBytes == 0 {
		c.MaxBufferBytes = DefaultMaxBufferBytes
	}
	if c.BufferSteps == 0 {
		c.BufferSteps = DefaultBufferSteps
	}
	if c.HWM == 0 {
		c.HWM = DefaultHWM
	}
	if c.MaxQueueSize == 0 {
		c.MaxQueueSize = DefaultMaxQueueSize
	}
	if c.Encoding == "" {
		c.Encoding = EncodingMap
	}
	return c
}

// Validate reports whether c (after defaults) is usable.
func (c PublisherConfig) Validate() error {
	c = c.WithDefaults()
	var errs []error
	checkEP := func(name, ep string) {
		scheme, addr, ok := strings.Cut(ep, "://")
		switch {
		case !ok || addr == "":
			errs = append(errs, fmt.Errorf("kv events %s %q: want tcp://host:port, ipc://path or inproc://name", name, ep))
		case scheme != "tcp" && scheme != "ipc" && scheme != "inproc":
			errs = append(errs, fmt.Errorf("kv events %s %q: unsupported transport %q", name, ep, scheme))
		}
	}
	if c.Publisher != PublisherZMQ && c.Publisher != PublisherNull {
		errs = append(errs, fmt.Errorf("kv events publisher must be %q or %q, got %q", PublisherZMQ, PublisherNull, c.Publisher))
	}
	checkEP("endpoint", c.Endpoint)
	if c.ReplayEndpoint != "" {
		checkEP("replay_endpoint", c.ReplayEndpoint)
	}
	if c.MaxBufferBytes < 0 {
		errs = append(errs, fmt.Errorf("kv events max_buffer_bytes must be >= 0, got %d", c.MaxBufferBytes))
	}
	if c.BufferSteps < 1 {
		errs = append(errs, fmt.Errorf("kv events buffer_steps must be >= 1, got %d", c.BufferSteps))
	}
	if c.HWM < 0 {
		errs = append(errs, fmt.Errorf("kv events hwm must be >= 0, got %d", c.HWM))
	}
	if c.MaxQueueSize < 1 {
		errs = append(errs, fmt.Errorf("kv events max_queue_size must be >= 1, got %d", c.MaxQueueSize))
	}
	if c.Encoding != EncodingArray && c.Encoding != EncodingMap {
		errs = append(errs, fmt.Errorf("kv events encoding must be %q or %q, got %q", EncodingArray, EncodingMap, c.Encoding))
	}
	return errors.Join(errs...)
}

// bindsEndpoint is vLLM's bind-or-connect heuristic for the PUB socket.
func bindsEndpoint(ep string) bool {
	return strings.Contains(ep, "*") || strings.Contains(ep, "::") ||
		strings.HasPrefix(ep, "ipc://") || strings.HasPrefix(ep, "inproc://")
}

// ReplayEndSeq is the sequence number of the replay end marker: -1 as an
// 8-byte signed big-endian integer.
const ReplayEndSeq = ^uint64(0)

// message is one encoded batch and its sequence number.
type message struct {
	seq     uint64
	payload []byte
}

// PublisherStats are cumulative publisher counters, in batches.
type PublisherStats struct {
	// Published batches were handed to the PUB socket (which may still drop
	// them at its high-water mark or when no subscriber is connected).
	Published uint64
	// Dropped batches found the queue full, or the publisher closed.
	Dropped uint64
}

// Publisher publishes KV-event batches like vLLM's ZmqEventPublisher:
// a PUB socket sends every batch as the 3-frame message [topic, seq (8-byte
// big-endian, from 0, +1 per batch), msgpack payload]; an optional ROUTER
// socket replays buffered batches. Publish encodes the batch in the caller
// and queues it without blocking; one goroutine sends, another answers replay
// requests. Safe for concurrent use.
type Publisher struct {
	cfg    PublisherConfig
	topic  []byte
	ctx    context.Context
	cancel context.CancelFunc
	pub    zmq4.Socket
	replay zmq4.Socket // nil without ReplayEndpoint
	dial   bool        // connect the PUB socket (from the sending goroutine)

	mu       sync.Mutex // orders sequence numbers with queue order
	nextSeq  uint64
	closed   bool
	queue    chan message
	quit     chan struct{} // closed by Close
	dialed   chan struct{} // closed when the PUB socket is bound or connected (or gave up)
	sent     chan struct{} // closed when the sending goroutine exits
	replayWG sync.WaitGroup
	once     sync.Once

	bufMu sync.Mutex
	// buf[bufHead:] are the last sent batches kept for replay, oldest
	// first: at most BufferSteps of them and MaxBufferBytes of payload.
	buf      []message
	bufHead  int
	bufBytes int

	published, dropped atomic.Uint64
}

// NewPublisher validates cfg, opens the sockets (binding now, or
// connecting in the background per the endpoint heuristic) and starts the
// publishing goroutines. cfg.Enable is not consulted.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	p := &Publisher{
		cfg:    cfg,
		topic:  []byte(cfg.Topic),
		ctx:    ctx,
		cancel: cancel,
		dial:   !cfg.Bind && !bindsEndpoint(cfg.Endpoint),
		queue:  make(chan message, cfg.MaxQueueSize),
		quit:   make(chan struct{}),
		dialed: make(chan struct{}),
		sent:   make(chan struct{}),
	}
	if p.dial {
		p.pub = zmq4.NewPub(ctx, zmq4.WithLogger(quiet), zmq4.WithDialerMaxRetries(-1), zmq4.WithAutomaticReconnect(true))
	} else {
		p.pub = zmq4.NewPub(ctx, zmq4.WithLogger(quiet))
	}
	if err := p.pub.SetOption(zmq4.OptionHWM, cfg.HWM); err != nil {
		p.closeSockets()
		return nil, fmt.Errorf("kv events: setting hwm: %w", err)
	}
	if !p.dial {
		if err := p.pub.Listen(cfg.Endpoint); err != nil {
			p.closeSockets()
			return nil, fmt.Errorf("kv events: %w", err)
		}
	}
	if cfg.ReplayEndpoint != "" {
		p.replay = zmq4.NewRouter(ctx, zmq4.WithLogger(quiet))
		if err := p.replay.Listen(cfg.ReplayEndpoint); err != nil {
			p.closeSockets()
			return nil, fmt.Errorf("kv events replay: %w", err)
		}
		p.replayWG.Add(1)
		go p.serveReplay()
	}
	if p.dial {
		// zmq4 dials synchronously, retrying until the context is cancelled;
		// batches queue (and drop when the queue is full) meanwhile.
		go func() {
			_ = p.pub.Dial(cfg.Endpoint)
			close(p.dialed)
		}()
	} else {
		close(p.dialed)
	}
	go p.run()
	return p, nil
}

// Config returns the configuration with defaults applied.
func (p *Publisher) Config() PublisherConfig { return p.cfg }

// Addr returns the address the PUB socket listens on (useful with port 0),
// or nil when it connects.
func (p *Publisher) Addr() net.Addr {
	if p.dial {
		return nil
	}
	return p.pub.Addr()
}

// ReplayAddr returns the address of the replay ROUTER socket, or nil.
func (p *Publisher) ReplayAddr() net.Addr {
	if p.replay == nil {
		return nil
	}
	return p.replay.Addr()
}

// Stats returns the publisher's counters.
func (p *Publisher) Stats() PublisherStats {
	return PublisherStats{Published: p.published.Load(), Dropped: p.dropped.Load()}
}

// NextSeq returns the sequence number the next queued batch gets: the number
// of batches queued or dropped at a full queue so far. Once Published +
// Dropped reach it (Stats), the publisher has sent everything queued.
func (p *Publisher) NextSeq() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.nextSeq
}

// Publish encodes events as one KVEventBatch stamped ts (seconds since the
// Unix epoch) and queues it for sending, without blocking. It reports false
// when the batch was dropped (queue full or publisher closed). An empty
// batch is not published (vLLM publishes only steps with events). events
// may be reused once Publish returns.
func (p *Publisher) Publish(ts float64, events []Event) bool {
	if len(events) == 0 {
		return true
	}
	if p.cfg.TierScopedClearEvents {
		return p.publishTierScoped(ts, events)
	}
	return p.Enqueue(p.Encode(ts, events))
}

// publishTierScoped publishes events with every AllBlocksCleared as a
// TierBlocksCleared(medium="GPU") in a batch of its own, the events around
// it in batches before and after, in order (vLLM's
// isolate_tier_clear_batches: a subscriber that cannot decode the tag then
// loses only that batch).
func (p *Publisher) publishTierScoped(ts float64, events []Event) bool {
	ok := true
	start := 0
	for i := range events {
		if events[i].Type != AllBlocksCleared {
			continue
		}
		if i > start {
			ok = p.Enqueue(p.Encode(ts, events[start:i])) && ok
		}
		ok = p.Enqueue(p.Encode(ts, []Event{{Type: TierBlocksCleared}})) && ok
		start = i + 1
	}
	if start < len(events) {
		ok = p.Enqueue(p.Encode(ts, events[start:])) && ok
	}
	return ok
}

// Encode returns the payload of one batch of events stamped ts (seconds
// since the Unix epoch), in the configured encoding, data parallel rank 0,
// for Enqueue: a caller that must encode while its events are valid and
// queue later (the simulator's driver, whose step's events are only valid
// until the engine runs again) encodes first. Unlike Publish it does not
// isolate AllBlocksCleared events (TierScopedClearEvents).
func (p *Publisher) Encode(ts float64, events []Event) []byte {
	return AppendBatch(nil, ts, events, 0, p.cfg.Encoding)
}

// Enqueue gives an encoded batch (Encode) the next sequence number and
// queues it without blocking; a full queue drops it, leaving a gap in the
// sequence numbers, and a closed publisher drops it without a number. It
// reports whether the batch was queued.
func (p *Publisher) Enqueue(payload []byte) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.dropped.Add(1)
		return false
	}
	m := message{seq: p.nextSeq, payload: payload}
	p.nextSeq++
	select {
	case p.queue <- m:
		return true
	default:
		p.dropped.Add(1)
		return false
	}
}

// run is the sending goroutine: once the PUB socket is connected it sends
// queued batches and records them for replay until Close, then sends what is
// still queued. Closed before connecting, it drops the queue.
func (p *Publisher) run() {
	defer close(p.sent)
	select {
	case <-p.dialed:
	case <-p.quit:
		select {
		case <-p.dialed:
		default:
			p.cancel() // stop dialing
			<-p.dialed
			p.drain(nil)
			return
		}
	}
	for {
		select {
		case m := <-p.queue:
			p.send(m)
		case <-p.quit:
			p.drain(p.send)
			return
		}
	}
}

// drain empties the queue, passing each batch to f (or dropping it if f is nil).
func (p *Publisher) drain(f func(message)) {
	for {
		select {
		case m := <-p.queue:
			if f == nil {
				p.dropped.Add(1)
			} else {
				f(m)
			}
		default:
			return
		}
	}
}

func (p *Publisher) send(m message) {
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], m.seq)
	// A PUB send only queues inside zmq4 (dropping beyond the HWM); it does
	// not fail for lack of subscribers.
	_ = p.pub.SendMulti(zmq4.NewMsgFrom(p.topic, seq[:], m.payload))
	p.published.Add(1)
	p.bufMu.Lock()
	p.buf = append(p.buf, m)
	p.bufBytes += len(m.payload)
	for n := len(p.buf) - p.bufHead; n > p.cfg.BufferSteps || (n > 1 && p.bufBytes > p.cfg.MaxBufferBytes); n-- {
		p.bufBytes -= len(p.buf[p.bufHead].payload)
		p.buf[p.bufHead] = message{}
		p.bufHead++
	}
	if p.bufHead >= 1024 && p.bufHead*2 >= len(p.buf) {
		n := copy(p.buf, p.buf[p.bufHead:])
		clear(p.buf[n:])
		p.buf, p.bufHead = p.buf[:n], 0
	}
	p.bufMu.Unlock()
}

// buffered returns the buffered batches with seq >= start, oldest first.
func (p *Publisher) buffered(start uint64) []message {
	p.bufMu.Lock()
	defer p.bufMu.Unlock()
	out := make([]message, 0, len(p.buf)-p.bufHead)
	for _, m := range p.buf[p.bufHead:] {
		if m.seq >= start {
			out = append(out, m)
		}
	}
	return out
}

// serveReplay answers replay requests on the ROUTER socket: a request
// [identity, "", start_seq (8-byte BE)] gets every buffered batch with
// seq >= start_seq as [identity, "", seq, payload], then the end marker
// [identity, "", 0xFFFFFFFFFFFFFFFF, ""]. Requests of another frame count
// are ignored, as in vLLM.
func (p *Publisher) serveReplay() {
	defer p.replayWG.Done()
	end := binary.BigEndian.AppendUint64(nil, ReplayEndSeq)
	for {
		req, err := p.replay.Recv()
		if err != nil {
			if p.ctx.Err() != nil {
				return
			}
			continue
		}
		if len(req.Frames) != 3 {
			continue
		}
		id, raw := req.Frames[0], req.Frames[2]
		var start uint64 // int.from_bytes(raw, "big"), truncated to 64 bits
		for _, b := range raw {
			start = start<<8 | uint64(b)
		}
		for _, m := range p.buffered(start) {
			var seq [8]byte
			binary.BigEndian.PutUint64(seq[:], m.seq)
			if p.replay.Send(zmq4.NewMsgFrom(id, nil, seq[:], m.payload)) != nil {
				break
			}
		}
		_ = p.replay.Send(zmq4.NewMsgFrom(id, nil, end, nil))
	}
}

// Close sends the batches still queued, then closes the sockets and waits for
// the publisher's goroutines. Later Publish calls drop their batch.
// Idempotent.
func (p *Publisher) Close() error {
	p.once.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		close(p.quit)
		// Wait for the sender before closing the sockets it uses; the replay
		// goroutine exits when its socket closes.
		<-p.sent
		p.closeSockets()
		p.replayWG.Wait()
	})
	return nil
}

// closeSockets cancels the sockets' context and closes them.
func (p *Publisher) closeSockets() {
	p.cancel()
	_ = p.pub.Close()
	if p.replay != nil {
		_ = p.replay.Close()
	}
}

// OffsetEndpointPort is vLLM's ZmqEventPublisher.offset_endpoint_port: the
// publisher of data-parallel rank r adds r to a tcp port and appends "_dp<r>"
// to an inproc name. The simulator's fleet (simserver.StartFleet) applies it with
// the engine's index, so that its engines do not all bind one port; port 0
// (any free port) is kept.
func OffsetEndpointPort(ep string, rank int) string {
	if ep == "" || rank == 0 {
		return ep
	}
	if strings.Contains(ep, "inproc") {
		return fmt.Sprintf("%s_dp%d", ep, rank)
	}
	if strings.Contains(ep, "tcp") {
		i := strings.LastIndexByte(ep, ':')
		port, err := strconv.Atoi(ep[i+1:])
		if i < 0 || err != nil || port == 0 {
			return ep
		}
		return fmt.Sprintf("%s:%d", ep[:i], port+rank)
	}
	return ep
}
