package kvstore

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/infergate/infergate/kvevents"
)

// EngineTier is an infergate kvstore as a simulated engine's remote KV tier
// (it implements sim.RemoteTier): engines write their blocks through to the
// store and look them up there, as vLLM+LMCache engines do with a remote
// backend.
//
// An engine's step is a pure function of its state and cannot wait on the
// network, so EngineTier keeps two things beside the store:
//
//   - a mirror of what the store holds, fed by the store's own KV-event
//     stream (a kvevents.Subscriber: BlockStored/BlockRemoved, medium
//     REMOTE), which Holds answers from. It is as fresh as the stream: a
//     block another engine wrote is seen once its event arrives (one
//     network hop), an evicted one is forgotten once its removal does; a
//     reset of the stream (a gap without replay) empties the mirror, as
//     the gateway's index forgets the store's blocks then.
//   - a bounded queue of writes, sent in batches by one goroutine with
//     metadata-only blocks of BlockBytes each (the KV size of one block:
//     the store accounts capacity as if the bytes were there), their token
//     ids and parent hash (so the store's events name them for the gateway).
//     A full queue drops the oldest writes and counts them: the engine is
//     never slowed by the store.
//
// A lookup the mirror answers wrongly (a block evicted meanwhile) is still
// served by the engine as a remote hit: the simulator moves no bytes, and
// the error is bounded by the event stream's delay.
type EngineTier struct {
	cfg    EngineTierConfig
	client *Client
	sub    *kvevents.Subscriber

	mu      sync.Mutex
	held    map[uint64]struct{} // hashes the store holds, per its events
	queue   []Block             // writes not yet sent (oldest first)
	adapter []string            // adapter of each queued write
	dropped uint64
	sent    uint64
	failed  uint64
	wake    chan struct{}

	cancel context.CancelFunc
	done   sync.WaitGroup
}

// EngineTierConfig configures an EngineTier.
type EngineTierConfig struct {
	// URL is the store's native API base URL (http://host:port).
	URL string
	// Events is the store's KV-event PUB endpoint (tcp://host:port);
	// EventsReplay its ROUTER ("" for none); Topic the subscription
	// (default DefaultTopic(Model)).
	Events, EventsReplay, Topic string
	// Model is the served model the blocks are keyed under.
	Model string
	// BlockBytes is the declared size of one block (bytes, > 0): the
	// engine's KV bytes per block (sim.Config.BlockBytes).
	BlockBytes int64
	// QueueBlocks bounds the writes waiting to be sent (default 65536).
	QueueBlocks int
	// BatchBlocks is the most blocks one Put carries (default 256, within
	// the API's bounds).
	BatchBlocks int
	// Timeout bounds one Put (default 10 s).
	Timeout time.Duration
	// MaxHeld bounds the mirror (default 1<<24 blocks, 80 TiB of the 70B
	// default's 5 MiB blocks): a store announcing more is not believed
	// beyond it.
	MaxHeld int
}

// Defaults of EngineTierConfig.
const (
	DefaultEngineTierQueueBlocks = 65536
	DefaultEngineTierBatchBlocks = 256
	DefaultEngineTierTimeout     = 10 * time.Second
	DefaultEngineTierMaxHeld     = 1 << 24
)

// EngineTierStats are an EngineTier's counters.
type EngineTierStats struct {
	// Held is the number of blocks the mirror says the store holds.
	Held int
	// Sent, Failed and Dropped count blocks written, blocks whose Put
	// failed, and blocks dropped from a full queue.
	Sent, Failed, Dropped uint64
	// Queued is the number of writes waiting.
	Queued int
}

// NewEngineTier connects to the store at cfg.URL and subscribes to its events.
// Close stops both.
func NewEngineTier(cfg EngineTierConfig) (*EngineTier, error) {
	if cfg.URL == "" || cfg.Events == "" || cfg.Model == "" {
		return nil, errors.New("kvstore engine tier: URL, Events and Model must be set")
	}
	if cfg.BlockBytes <= 0 {
		return nil, errors.New("kvstore engine tier: BlockBytes must be > 0")
	}
	if cfg.QueueBlocks <= 0 {
		cfg.QueueBlocks = DefaultEngineTierQueueBlocks
	}
	if cfg.BatchBlocks <= 0 {
		cfg.BatchBlocks = DefaultEngineTierBatchBlocks
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultEngineTierTimeout
	}
	if cfg.MaxHeld <= 0 {
		cfg.MaxHeld = DefaultEngineTierMaxHeld
	}
	if cfg.Topic == "" {
		cfg.Topic = DefaultTopic(cfg.Model)
	}
	client, err := NewClient(cfg.URL, ClientConfig{Timeout: cfg.Timeout})
	if err != nil {
		return nil, err
	}
	sub, err := kvevents.NewSubscriber(kvevents.SubscriberConfig{Endpoint: cfg.Events, ReplayEndpoint: cfg.EventsReplay, Topic: cfg.Topic})
	if err != nil {
		client.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &EngineTier{cfg: cfg, client: client, sub: sub, held: make(map[uint64]struct{}), wake: make(chan struct{}, 1), cancel: cancel}
	r.done.Add(2)
	go func() {
		defer r.done.Done()
		_ = sub.Run(ctx, (*remoteMirror)(r))
	}()
	go func() {
		defer r.done.Done()
		r.send(ctx)
	}()
	return r, nil
}

// Holds reports whether the store holds block h, as its events tell.
func (r *EngineTier) Holds(h uint64) bool {
	r.mu.Lock()
	_, ok := r.held[h]
	r.mu.Unlock()
	return ok
}

// Store queues blocks written through (sim.RemoteTier): hashes are
// chained, the first from parent when hasParent; tokens holds blockSize
// per block.
func (r *EngineTier) Store(hashes []uint64, parent uint64, hasParent bool, tokens []uint32, blockSize int, lora string) {
	r.mu.Lock()
	for i, h := range hashes {
		if _, ok := r.held[h]; ok {
			continue // held already: nothing to write
		}
		b := Block{Hash: h, BlockSize: blockSize, Size: r.cfg.BlockBytes}
		if len(tokens) >= (i+1)*blockSize {
			b.TokenIDs = append([]uint32(nil), tokens[i*blockSize:(i+1)*blockSize]...)
		}
		switch {
		case i > 0:
			p := hashes[i-1]
			b.ParentBlockHash = &p
		case hasParent:
			p := parent
			b.ParentBlockHash = &p
		}
		if len(r.queue) >= r.cfg.QueueBlocks {
			r.queue, r.adapter = r.queue[1:], r.adapter[1:]
			r.dropped++
		}
		r.queue = append(r.queue, b)
		r.adapter = append(r.adapter, lora)
	}
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// send writes the queue in batches of one adapter until ctx ends. A store
// that is down fails every batch at once: failures are logged at most once
// per warnEvery, with the count since the last warning.
func (r *EngineTier) send(ctx context.Context) {
	const warnEvery = 10 * time.Second
	var lastWarn time.Time
	var unwarned uint64
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
		}
		for {
			r.mu.Lock()
			if len(r.queue) == 0 {
				r.mu.Unlock()
				break
			}
			n, adapter := 0, r.adapter[0]
			for n < len(r.queue) && n < r.cfg.BatchBlocks && r.adapter[n] == adapter {
				n++
			}
			batch := append([]Block(nil), r.queue[:n]...)
			r.queue, r.adapter = r.queue[n:], r.adapter[n:]
			r.mu.Unlock()
			pctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout)
			_, err := r.client.Put(pctx, r.cfg.Model, adapter, batch)
			cancel()
			r.mu.Lock()
			if err != nil {
				r.failed += uint64(n)
			} else {
				r.sent += uint64(n)
			}
			r.mu.Unlock()
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				unwarned += uint64(n)
				if now := time.Now(); now.Sub(lastWarn) >= warnEvery {
					slog.Warn("kvstore engine tier: puts failed", "blocks", unwarned, "err", err)
					lastWarn, unwarned = now, 0
				}
			}
		}
	}
}

// Stats returns the counters.
func (r *EngineTier) Stats() EngineTierStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	return EngineTierStats{Held: len(r.held), Sent: r.sent, Failed: r.failed, Dropped: r.dropped, Queued: len(r.queue)}
}

// Close stops the subscription and the writer (queued writes are dropped).
func (r *EngineTier) Close() {
	r.cancel()
	r.done.Wait()
	r.client.Close()
}

// remoteMirror is EngineTier as the subscription's kvevents.Handler.
type remoteMirror EngineTier

func (m *remoteMirror) KVBatch(_ uint64, b *kvevents.Batch) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Type {
		case kvevents.BlockStored:
			for _, h := range ev.BlockHashes {
				if len(m.held) < m.cfg.MaxHeld {
					m.held[h] = struct{}{}
				}
			}
		case kvevents.BlockRemoved:
			for _, h := range ev.BlockHashes {
				delete(m.held, h)
			}
		case kvevents.AllBlocksCleared, kvevents.TierBlocksCleared:
			clear(m.held)
		}
	}
}

func (m *remoteMirror) KVReset(kvevents.ResetReason) {
	m.mu.Lock()
	clear(m.held)
	m.mu.Unlock()
}
