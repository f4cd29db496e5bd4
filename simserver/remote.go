package simserver

import (
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/sim"
)

// The shared remote KV tier of a fleet (sim/tiers.go, TiersConfig.Remote):
// one sim.RemoteStore that every engine writes through to and loads from,
// as LMCache's remote backend or infergate kvstore serves a pool. sim's
// store is not safe for concurrent use (the virtual fleet's engines run on
// one goroutine); a real-time fleet's drivers each run on their own, so
// the store is wrapped here in a mutex, and its KV events — medium REMOTE,
// with the writer's token ids and parent, as kvstore publishes them — are
// taken under the same mutex right after each Store and published (encoded,
// hence copied) before it is released, so that batches leave in store
// order on the store's own endpoint, topic DefaultRemoteTopic(model).

// DefaultRemoteTopic is the topic of a remote store's KV events: llm-d's
// "kv@<pod>@<model>" with the pod "kvstore", as infergate kvstore
// publishes them.
func DefaultRemoteTopic(model string) string { return "kv@kvstore@" + model }

// RemoteStore is a sim.RemoteStore safe for concurrent engines, publishing
// its KV events when it has a publisher.
type RemoteStore struct {
	mu  sync.Mutex
	r   *sim.RemoteStore
	pub *kvevents.Publisher // nil: no events
}

// newRemoteStore returns a store of capacity blocks publishing its events
// with pc when pc publishes (endpoints defaulted to loopback, ephemeral
// ports, with replay; topic DefaultRemoteTopic(model)).
func newRemoteStore(capacity int, pc kvevents.PublisherConfig, model string) (*RemoteStore, error) {
	s := &RemoteStore{r: sim.NewRemoteStore(capacity, pc.Publishes())}
	if !pc.Publishes() {
		return s, nil
	}
	if pc.Endpoint == "" {
		pc.Endpoint, pc.ReplayEndpoint, pc.Bind = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", true
	}
	if pc.Topic == "" {
		pc.Topic = DefaultRemoteTopic(model)
	}
	if err := pc.Validate(); err != nil {
		return nil, fmt.Errorf("sim: kv_remote_events: %w", err)
	}
	var err error
	if s.pub, err = kvevents.NewPublisher(pc); err != nil {
		return nil, fmt.Errorf("sim: kv_remote_events: %w", err)
	}
	return s, nil
}

// Holds implements sim.RemoteTier.
func (s *RemoteStore) Holds(h uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.Holds(h)
}

// Store implements sim.RemoteTier: the blocks are stored, then their
// events published (encoded) under the same lock.
func (s *RemoteStore) Store(hashes []uint64, parent uint64, hasParent bool, tokens []uint32, blockSize int, lora string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.r.Store(hashes, parent, hasParent, tokens, blockSize, lora)
	if s.pub != nil {
		if evs := s.r.TakeEvents(); len(evs) > 0 {
			now := time.Now()
			s.pub.Publish(float64(now.UnixNano())/1e9, evs)
		}
	}
}

// Capacity returns the store's capacity in blocks.
func (s *RemoteStore) Capacity() int { return s.r.Capacity() }

// Len returns the number of blocks held.
func (s *RemoteStore) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.Len()
}

// Publisher returns the store's KV-event publisher, or nil when its events
// are off.
func (s *RemoteStore) Publisher() *kvevents.Publisher { return s.pub }

// KVEventEndpoints returns the addresses a subscriber dials for the
// store's events and their replay ("" when it publishes none).
func (s *RemoteStore) KVEventEndpoints() (pub, replay string) {
	if s == nil || s.pub == nil {
		return "", ""
	}
	if a, ok := s.pub.Addr().(*net.TCPAddr); ok {
		pub = dialAddr(a)
	}
	if a, ok := s.pub.ReplayAddr().(*net.TCPAddr); ok {
		replay = dialAddr(a)
	}
	return pub, replay
}

// close closes the publisher (after the engines stopped storing).
func (s *RemoteStore) close() {
	if s != nil && s.pub != nil {
		_ = s.pub.Close()
	}
}
