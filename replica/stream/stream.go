// Package stream carries package replica's messages between gateway
// replicas over one Redis stream: each replica appends its messages
// (XADD with an approximate MAXLEN trim) and reads everyone's (XREAD
// BLOCK, from where it left off), skipping its own in replica.Node.Apply.
// A Redis stream gives what the exchange needs and nothing it must build:
// one total order (so a peer's learns and load reports arrive in the order
// it sent them), a bounded history a restarted replica reads to warm its
// index, and a server the deployment may already run (infergate kvstore's
// Redis layout, LMCache's remote). See gateway/README.md "Replicas" for the
// choice against memberlist and NATS.
//
// Nothing here is on the request path: Publish puts a message on a bounded
// queue and never waits (a full queue drops it, counted); one goroutine
// writes, one reads. Redis down means local-only routing: errors are
// counted, logged at most once per LogEvery, and retried with exponential
// backoff; go-redis reconnects. An entry that is not a bounded, well-formed
// message is counted and skipped by the handler (replica.Decode); go-redis
// reads a reply whole, so an entry's size is bounded by Redis's own 512 MB
// bulk limit before the handler refuses it (replica.MaxMessage).
package stream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Defaults of Config.
const (
	DefaultStream       = "infergate:replicas"
	DefaultMaxLen       = 10000
	DefaultQueue        = 4096
	DefaultBlock        = time.Second
	DefaultTimeout      = 2 * time.Second
	DefaultLoadInterval = 200 * time.Millisecond
	// LogEvery bounds the exchange's error logs: one per period.
	LogEvery = 30 * time.Second
	// batch is the most entries one XADD pipeline or XREAD carries.
	batch = 256
	// maxBackoff bounds the wait between failed Redis calls.
	maxBackoff = 5 * time.Second
	// field is the entry's one field: the message bytes.
	field = "m"
)

// Config configures an Exchange.
type Config struct {
	// URL is the Redis server (redis://[:password@]host:port[/db]).
	URL string
	// Stream is the stream's key (DefaultStream).
	Stream string
	// MaxLen trims the stream to about this many entries at each XADD
	// (MAXLEN ~; DefaultMaxLen): the history a new replica replays.
	MaxLen int64
	// Queue bounds the messages waiting to be written (DefaultQueue).
	Queue int
	// Block is XREAD's BLOCK (DefaultBlock); Timeout the dial, read and
	// write timeouts of other calls (DefaultTimeout).
	Block, Timeout time.Duration
	// Replay reads the stream's history at start (true: learns warm the
	// index; loads in it are skipped, being stale) instead of only what
	// comes after.
	Replay bool
	// Logger receives the rate-limited error logs (slog.Default()).
	Logger *slog.Logger
	// Connected, when set, is called once, on the reader's goroutine
	// before its first read, with the round trip of a PING to the server
	// (retried with the reads' backoff until the server answers it, an
	// error reply included: a user whose ACL lacks PING): the gateway
	// seeds its estimate of the exchange's delay with it
	// (replica.Unseen.Seed) before any learn has come back.
	Connected func(rtt time.Duration)
}

// Handler receives each entry read: its bytes and whether it is from the
// history replayed at start (Config.Replay). It runs on the reader's
// goroutine.
type Handler func(b []byte, replayed bool)

// Counts are an Exchange's counters (monotonic).
type Counts struct {
	// Published: entries written; Dropped: messages dropped on a full
	// queue or a failed write; Read: entries read; NotBytes: entries
	// without a message field (skipped); Errors: failed Redis calls.
	Published, Dropped, Read, NotBytes, Errors atomic.Uint64
}

// Exchange is one replica's connection to the stream.
type Exchange struct {
	cfg     Config
	c       *redis.Client
	q       chan []byte
	handle  Handler
	Counts  Counts
	up      atomic.Bool  // the last Redis call succeeded
	lastLog atomic.Int64 // unix ns of the last error log
	stop    context.CancelFunc
	wg      sync.WaitGroup
}

// Start connects to cfg.URL (not waiting for it: Redis down at start is
// local-only routing until it is up) and starts the writer and the reader,
// which passes every entry to h. Close stops both.
func Start(cfg Config, h Handler) (*Exchange, error) {
	opt, err := redis.ParseURL(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("replica stream: redis URL: %w", err)
	}
	if cfg.Stream == "" {
		cfg.Stream = DefaultStream
	}
	if cfg.MaxLen <= 0 {
		cfg.MaxLen = DefaultMaxLen
	}
	if cfg.Queue <= 0 {
		cfg.Queue = DefaultQueue
	}
	if cfg.Block <= 0 {
		cfg.Block = DefaultBlock
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	opt.DialTimeout, opt.ReadTimeout, opt.WriteTimeout = cfg.Timeout, cfg.Timeout, cfg.Timeout
	opt.MaxRetries = -1 // the loops retry, with backoff
	opt.PoolSize = 4
	opt.DisableIdentity = true
	ctx, stop := context.WithCancel(context.Background())
	x := &Exchange{cfg: cfg, c: redis.NewClient(opt), q: make(chan []byte, cfg.Queue), handle: h, stop: stop}
	x.wg.Add(2)
	go x.write(ctx)
	go x.read(ctx)
	return x, nil
}

// Publish queues message b to be written; it never waits. It reports
// false, counting the message dropped, when the queue is full.
func (x *Exchange) Publish(b []byte) bool {
	select {
	case x.q <- b:
		return true
	default:
		x.Counts.Dropped.Add(1)
		return false
	}
}

// Up reports whether the last call to Redis succeeded.
func (x *Exchange) Up() bool { return x.up.Load() }

// Close stops the loops and closes the connection; queued messages are
// dropped.
func (x *Exchange) Close() {
	x.stop()
	x.wg.Wait()
	_ = x.c.Close()
}

// write appends the queued messages, up to batch per pipeline.
func (x *Exchange) write(ctx context.Context) {
	defer x.wg.Done()
	var backoff time.Duration
	msgs := make([][]byte, 0, batch)
	for {
		msgs = msgs[:0]
		select {
		case <-ctx.Done():
			return
		case b := <-x.q:
			msgs = append(msgs, b)
		}
	more:
		for len(msgs) < batch {
			select {
			case b := <-x.q:
				msgs = append(msgs, b)
			default:
				break more
			}
		}
		cctx, cancel := context.WithTimeout(ctx, x.cfg.Timeout)
		_, err := x.c.Pipelined(cctx, func(p redis.Pipeliner) error {
			for _, b := range msgs {
				p.XAdd(cctx, &redis.XAddArgs{Stream: x.cfg.Stream, MaxLen: x.cfg.MaxLen, Approx: true, Values: []any{field, b}})
			}
			return nil
		})
		cancel()
		if err != nil {
			x.Counts.Dropped.Add(uint64(len(msgs)))
			backoff = x.fail(ctx, "write", err, backoff)
			continue
		}
		backoff = 0
		x.up.Store(true)
		x.Counts.Published.Add(uint64(len(msgs)))
	}
}

// read reads the stream from where it left off ("$" at start, or the
// beginning with Config.Replay) and hands each entry to the handler.
func (x *Exchange) read(ctx context.Context) {
	defer x.wg.Done()
	var backoff time.Duration
	last, replaying := "$", x.cfg.Replay
	if replaying {
		last = "0-0"
	}
	for x.cfg.Connected != nil && ctx.Err() == nil {
		cctx, cancel := context.WithTimeout(ctx, x.cfg.Timeout)
		t0 := time.Now()
		err := x.c.Ping(cctx).Err()
		rtt := time.Since(t0)
		cancel()
		// An error reply (NOPERM from an ACL that grants the stream
		// commands only, LOADING) is a round trip too: waiting for a
		// PING that the server refuses would never start the reads.
		var reply redis.Error
		if err == nil || errors.As(err, &reply) {
			x.up.Store(err == nil)
			x.cfg.Connected(rtt)
			break
		}
		backoff = x.fail(ctx, "ping", err, backoff)
	}
	for ctx.Err() == nil {
		if last == "$" {
			// Anchor at the newest entry, so that what is written between
			// two reads is not skipped (each XREAD from "$" would).
			var err error
			if last, err = x.anchor(ctx); err != nil {
				last = "$"
				backoff = x.fail(ctx, "read", err, backoff)
				continue
			}
		}
		res, err := x.c.XRead(ctx, &redis.XReadArgs{Streams: []string{x.cfg.Stream, last}, Count: batch, Block: x.cfg.Block}).Result()
		switch {
		case errors.Is(err, redis.Nil): // BLOCK timed out: nothing new
			x.up.Store(true)
			replaying, backoff = false, 0
			if x.behind(ctx, last) {
				// The stream was deleted and made anew (by a DEL, a FLUSHDB,
				// a server that lost it) below where this reader was: its
				// entries are all new, read from its start as a replay.
				x.cfg.Logger.Warn("replica exchange: the stream's newest entry is older than the last one read; the stream was recreated, reading it from its start",
					"stream", x.cfg.Stream, "last", last)
				last, replaying = "0-0", true
			}
			continue
		case err != nil:
			backoff = x.fail(ctx, "read", err, backoff)
			continue
		}
		x.up.Store(true)
		backoff = 0
		n := 0
		for _, s := range res {
			for _, m := range s.Messages {
				n++
				last = m.ID
				x.Counts.Read.Add(1)
				v, ok := m.Values[field].(string)
				if !ok || len(m.Values) != 1 {
					x.Counts.NotBytes.Add(1)
					continue
				}
				x.handle([]byte(v), replaying)
			}
		}
		if n < batch {
			replaying = false // caught up
		}
	}
}

// behind reports whether the stream's newest entry (none: "0-0") is below
// last, an id this reader read: the stream was recreated, and an XREAD
// after last would wait for good for an entry above an id that the new
// stream reaches only in its own time (never, after an entry of a far
// future id such as 99999999999999-0). false when Redis fails to tell.
func (x *Exchange) behind(ctx context.Context, last string) bool {
	newest, err := x.anchor(ctx)
	if err != nil {
		return false
	}
	return idLess(newest, last)
}

// idLess compares two stream ids, ms-seq; false when either is not one.
func idLess(a, b string) bool {
	am, as, ok := parseID(a)
	if !ok {
		return false
	}
	bm, bs, ok := parseID(b)
	if !ok {
		return false
	}
	return am < bm || (am == bm && as < bs)
}

func parseID(id string) (ms, seq uint64, ok bool) {
	m, sq, found := strings.Cut(id, "-")
	if !found {
		return 0, 0, false
	}
	var err1, err2 error
	ms, err1 = strconv.ParseUint(m, 10, 64)
	seq, err2 = strconv.ParseUint(sq, 10, 64)
	return ms, seq, err1 == nil && err2 == nil
}

// anchor returns the id of the stream's newest entry ("0-0" when it is
// empty or missing).
func (x *Exchange) anchor(ctx context.Context) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, x.cfg.Timeout)
	defer cancel()
	ms, err := x.c.XRevRangeN(cctx, x.cfg.Stream, "+", "-", 1).Result()
	if err != nil {
		return "", err
	}
	if len(ms) == 0 {
		return "0-0", nil
	}
	return ms[0].ID, nil
}

// fail counts and (rate-limited) logs a failed call, and waits the next
// backoff (100 ms doubling to maxBackoff) unless ctx ends.
func (x *Exchange) fail(ctx context.Context, op string, err error, backoff time.Duration) time.Duration {
	if ctx.Err() != nil {
		return backoff
	}
	x.up.Store(false)
	x.Counts.Errors.Add(1)
	now := time.Now().UnixNano()
	if last := x.lastLog.Load(); now-last >= int64(LogEvery) && x.lastLog.CompareAndSwap(last, now) {
		x.cfg.Logger.Warn("replica exchange: redis "+op+" failed; routing on this replica's own view until it is back",
			"stream", x.cfg.Stream, "err", redact(err.Error(), x.cfg.URL))
	}
	backoff = min(max(2*backoff, 100*time.Millisecond), maxBackoff)
	t := time.NewTimer(backoff)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
	return backoff
}

// redact drops url's password from s.
func redact(s, url string) string {
	if opt, err := redis.ParseURL(url); err == nil && opt.Password != "" {
		s = strings.ReplaceAll(s, opt.Password, "…")
	}
	return s
}
