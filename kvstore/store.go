package kvstore

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/infergate/infergate/kvevents/kvevent"
)

// Defaults and bounds of Config.
const (
	DefaultMaxObjectBytes = 64 << 20 // one block's payload
	DefaultMaxTokenIDs    = 8192     // token ids per entry
	DefaultMaxRemoteKeys  = 1 << 20  // keys of the remote index
	// MaxKeyBytes bounds a string key (LMCache's lm:// header holds 150;
	// its Redis keys are the same string).
	MaxKeyBytes = 512
)

// Errors of Put.
var (
	ErrTooLarge   = errors.New("kvstore: entry larger than the object bound or the memory tier")
	ErrInvalid    = errors.New("kvstore: invalid entry")
	ErrNotStored  = errors.New("kvstore: not stored")
	errStoreClose = errors.New("kvstore: store closed")
)

// Config configures a Store. Zero bounds take defaults; MemoryBytes is
// required.
type Config struct {
	// MemoryBytes is the capacity of the memory tier, in bytes of Cost.
	MemoryBytes int64
	// DiskDir, when set, enables the disk tier: entries the memory tier
	// evicts are written there (one file each) and read back on Get.
	// Files of a previous run (*.kvb) are removed at start: the store
	// starts empty (see the README). DiskBytes is its capacity in bytes of
	// Cost (required with DiskDir).
	DiskDir   string
	DiskBytes int64
	// MaxObjectBytes bounds one entry's payload or declared size, in bytes
	// (default DefaultMaxObjectBytes).
	MaxObjectBytes int64
	// MaxTokenIDs bounds the token ids one entry carries (default
	// DefaultMaxTokenIDs).
	MaxTokenIDs int
	// MaxRemoteKeys bounds the keys the remote index holds (default
	// DefaultMaxRemoteKeys); keys beyond it are not indexed (counted in
	// Stats.RemoteIndexFull).
	MaxRemoteKeys int
	// Remote, when set, is the shared remote tier (Redis in LMCache's
	// layout): entries with bytes are written through to it, misses with
	// the key in the remote index are read from it, deletes go to it.
	Remote Remote
	// Events, when set, receives the store's KV events, one batch per
	// operation, in the order the operations took effect (it is called
	// with the store's lock held: it must not block nor call the store;
	// kvevents.Publisher.Publish queues without blocking).
	Events func(events []kvevent.Event)
	// EventModel, when set, limits events to keys of that model (a
	// publisher's topic names one model); "" publishes every key whose
	// hash is known.
	EventModel string
	// Logger logs disk and remote errors (default slog's default).
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.MaxObjectBytes <= 0 {
		c.MaxObjectBytes = DefaultMaxObjectBytes
	}
	if c.MaxTokenIDs <= 0 {
		c.MaxTokenIDs = DefaultMaxTokenIDs
	}
	if c.MaxRemoteKeys <= 0 {
		c.MaxRemoteKeys = DefaultMaxRemoteKeys
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Meta describes one entry.
type Meta struct {
	// Size is the payload's size in bytes: len(data) for an entry with
	// bytes, the declared size of a metadata-only entry (the simulator's:
	// it stores no bytes, and its size counts against capacity exactly as
	// bytes would).
	Size int64 `json:"size"`
	// HasData reports an entry with bytes (set by Put from Item.Data).
	HasData bool `json:"has_data"`
	// Fmt, Dtype, Shape and Location are LMCache's tensor description
	// (docs/PROTOCOLS.md §6.2: MemoryFormat, dtype enum, 4 dims, location
	// enum), stored as given and echoed back; 0 when not given.
	Fmt      int32    `json:"fmt,omitempty"`
	Dtype    int32    `json:"dtype,omitempty"`
	Shape    [4]int32 `json:"shape"`
	Location int32    `json:"location,omitempty"`
	// ParentHash is the chained hash of the block before this one (valid
	// when HasParent), published as the event's parent_block_hash.
	ParentHash uint64 `json:"parent_block_hash,omitempty"`
	HasParent  bool   `json:"has_parent,omitempty"`
	// TokenIDs are the block's tokens (at most Config.MaxTokenIDs),
	// published as the event's token_ids; BlockSize is its block_size (0:
	// len(TokenIDs)).
	TokenIDs  []uint32 `json:"token_ids,omitempty"`
	BlockSize int      `json:"block_size,omitempty"`
}

// Item is one entry to store: a string key (Key.String for native keys),
// its metadata and, for an entry with bytes, the payload (nil:
// metadata-only, Meta.Size declared). Put takes ownership of Data and
// TokenIDs.
type Item struct {
	Key  string
	Meta Meta
	Data []byte
}

// Cost is what an entry counts against a tier's capacity, in bytes: its
// payload or declared size, its key and 4 bytes per token id.
func Cost(key string, m Meta) int64 {
	return m.Size + int64(len(key)) + 4*int64(len(m.TokenIDs))
}

// Remote is a shared remote tier (Redis, redis.go). Its calls are made
// without the store's lock.
type Remote interface {
	// Put writes entries with bytes.
	Put(ctx context.Context, items []Item) error
	// Get reads an entry; found false when absent.
	Get(ctx context.Context, key string, withData bool) (m Meta, data []byte, found bool, err error)
	// Delete removes entries.
	Delete(ctx context.Context, keys []string) error
}

// Tiers an entry is held in.
const (
	tierMem uint8 = iota + 1
	tierDisk
)

// entry is one local entry, in the memory or the disk tier.
type entry struct {
	key  string
	info KeyInfo
	meta Meta   // TokenIDs nil in the disk tier (they are in the file)
	data []byte // memory tier only
	cost int64
	tier uint8
	elem *list.Element
	ntok int // token ids (kept in the file in the disk tier)
}

// remoteEntry is one key of the remote index.
type remoteEntry struct {
	info KeyInfo
	size int64
}

// Stats are a store's gauges and counters.
type Stats struct {
	MemoryEntries   int    `json:"memory_entries"`
	MemoryBytes     int64  `json:"memory_bytes"`
	MemoryCapacity  int64  `json:"memory_capacity"`
	DiskEntries     int    `json:"disk_entries"`
	DiskBytes       int64  `json:"disk_bytes"`
	DiskCapacity    int64  `json:"disk_capacity"`
	RemoteKeys      int    `json:"remote_keys"`
	Puts            uint64 `json:"puts"`
	Stored          uint64 `json:"stored"`
	Gets            uint64 `json:"gets"`
	MemoryHits      uint64 `json:"memory_hits"`
	DiskHits        uint64 `json:"disk_hits"`
	RemoteHits      uint64 `json:"remote_hits"`
	Misses          uint64 `json:"misses"`
	Spilled         uint64 `json:"spilled"`
	Evicted         uint64 `json:"evicted"`
	Deleted         uint64 `json:"deleted"`
	DiskErrors      uint64 `json:"disk_errors"`
	RemoteErrors    uint64 `json:"remote_errors"`
	RemoteIndexFull uint64 `json:"remote_index_full"`
	EventsStored    uint64 `json:"events_stored"`
	EventsRemoved   uint64 `json:"events_removed"`
}

// Store is the KV block store: a byte-bounded LRU memory tier, an
// optional byte-bounded LRU disk tier the memory tier spills to, and an
// index of the keys a remote tier holds. A key is held while any of them
// holds it; a BlockStored event (medium REMOTE) is published when a key
// becomes held, a BlockRemoved when it no longer is (moves between tiers
// publish nothing). Safe for concurrent use: one mutex orders every
// operation, disk I/O included; remote I/O runs outside it.
type Store struct {
	cfg  Config
	disk *disk // nil without a disk tier

	mu      sync.Mutex
	closed  bool
	local   map[string]*entry
	mem     list.List // of *entry, most recent first
	memB    int64
	dsk     list.List
	dskB    int64
	remote  map[string]remoteEntry
	pending []kvevent.Event
	st      Stats
}

// New returns a store; with a disk tier it creates DiskDir and removes the
// files a previous run left there.
func New(cfg Config) (*Store, error) {
	cfg = cfg.withDefaults()
	if cfg.MemoryBytes <= 0 {
		return nil, fmt.Errorf("kvstore: memory capacity must be > 0 bytes, got %d", cfg.MemoryBytes)
	}
	s := &Store{cfg: cfg, local: map[string]*entry{}, remote: map[string]remoteEntry{}}
	if cfg.DiskDir != "" {
		if cfg.DiskBytes <= 0 {
			return nil, fmt.Errorf("kvstore: disk capacity must be > 0 bytes with a disk directory, got %d", cfg.DiskBytes)
		}
		d, err := openDisk(cfg.DiskDir)
		if err != nil {
			return nil, err
		}
		s.disk = d
	}
	return s, nil
}

// Config returns the configuration with defaults applied.
func (s *Store) Config() Config { return s.cfg }

// PutResult counts what a Put did.
type PutResult struct {
	// Stored counts new keys; Replaced keys held before (their entry
	// replaced, no event).
	Stored, Replaced int
}

// Validate checks one item against the store's bounds.
func (s *Store) Validate(it *Item) error {
	switch {
	case it.Key == "" || len(it.Key) > MaxKeyBytes:
		return fmt.Errorf("%w: key of %d bytes (want 1..%d)", ErrInvalid, len(it.Key), MaxKeyBytes)
	case it.Data == nil && it.Meta.Size < 0:
		return fmt.Errorf("%w: negative size %d", ErrInvalid, it.Meta.Size)
	case it.Data != nil && it.Meta.Size != 0 && it.Meta.Size != int64(len(it.Data)):
		return fmt.Errorf("%w: size %d but %d bytes", ErrInvalid, it.Meta.Size, len(it.Data))
	case len(it.Meta.TokenIDs) > s.cfg.MaxTokenIDs:
		return fmt.Errorf("%w: %d token ids (at most %d)", ErrInvalid, len(it.Meta.TokenIDs), s.cfg.MaxTokenIDs)
	case it.Meta.BlockSize < 0:
		return fmt.Errorf("%w: negative block size", ErrInvalid)
	}
	size := it.Meta.Size
	if it.Data != nil {
		size = int64(len(it.Data))
	}
	if size > s.cfg.MaxObjectBytes {
		return fmt.Errorf("%w: %d bytes (at most %d)", ErrTooLarge, size, s.cfg.MaxObjectBytes)
	}
	m := it.Meta
	m.Size = size
	if c := Cost(it.Key, m); c > s.cfg.MemoryBytes {
		return fmt.Errorf("%w: costs %d bytes, memory tier holds %d", ErrTooLarge, c, s.cfg.MemoryBytes)
	}
	return nil
}

// Put stores items (all or none: the first invalid one fails the call
// before anything is stored). Entries with bytes are then written through
// to the remote tier, when there is one; its error is returned with the
// local result.
func (s *Store) Put(ctx context.Context, items []Item) (PutResult, error) {
	var res PutResult
	for i := range items {
		if err := s.Validate(&items[i]); err != nil {
			return res, fmt.Errorf("block %d: %w", i, err)
		}
	}
	var through []Item
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return res, errStoreClose
	}
	for i := range items {
		it := &items[i]
		m := it.Meta
		m.HasData = it.Data != nil
		if m.HasData {
			m.Size = int64(len(it.Data))
		}
		wasHeld := s.heldLocked(it.Key)
		var info KeyInfo
		if old := s.local[it.Key]; old != nil {
			info = old.info
			s.unlinkLocked(old)
		} else if r, ok := s.remote[it.Key]; ok {
			info = r.info
		} else {
			info = ParseKey(it.Key)
		}
		e := &entry{key: it.Key, info: info, meta: m, data: it.Data, cost: Cost(it.Key, m), ntok: len(m.TokenIDs)}
		s.local[e.key] = e
		s.insertMemLocked(e)
		s.st.Puts++
		if wasHeld {
			res.Replaced++
		} else {
			res.Stored++
			s.st.Stored++
			s.storedEventLocked(info, &m)
		}
		if m.HasData && s.cfg.Remote != nil {
			through = append(through, Item{Key: it.Key, Meta: m, Data: it.Data})
		}
	}
	s.flushLocked()
	s.mu.Unlock()
	if len(through) > 0 {
		if err := s.cfg.Remote.Put(ctx, through); err != nil {
			s.count(func(st *Stats) { st.RemoteErrors++ })
			return res, fmt.Errorf("kvstore: remote write-through: %w", err)
		}
	}
	return res, nil
}

// Get returns key's metadata and, with withData, its bytes (nil for a
// metadata-only entry). A memory hit refreshes the entry; a disk hit reads
// the file and moves the entry back to the memory tier; a key only the
// remote tier holds is read from it (not cached locally). The returned
// bytes and token ids must not be modified.
func (s *Store) Get(ctx context.Context, key string, withData bool) (Meta, []byte, bool, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return Meta{}, nil, false, errStoreClose
	}
	s.st.Gets++
	if e := s.local[key]; e != nil {
		switch e.tier {
		case tierMem:
			s.mem.MoveToFront(e.elem)
			s.st.MemoryHits++
			m, d := e.meta, e.data
			s.mu.Unlock()
			if !withData {
				d = nil
			}
			return m, d, true, nil
		case tierDisk:
			if m, d, ok := s.promoteLocked(e); ok {
				s.st.DiskHits++
				s.flushLocked()
				s.mu.Unlock()
				if !withData {
					d = nil
				}
				return m, d, true, nil
			}
			s.flushLocked()
		}
	}
	_, remote := s.remote[key]
	if !remote || s.cfg.Remote == nil {
		s.st.Misses++
		s.mu.Unlock()
		return Meta{}, nil, false, nil
	}
	s.mu.Unlock()
	m, d, ok, err := s.cfg.Remote.Get(ctx, key, withData)
	s.count(func(st *Stats) {
		switch {
		case err != nil:
			st.RemoteErrors++
		case ok:
			st.RemoteHits++
		default:
			st.Misses++
		}
	})
	return m, d, ok, err
}

// Held reports whether key is held in any tier.
func (s *Store) Held(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.heldLocked(key)
}

// Lookup returns how many leading keys of keys are held in any tier (the
// longest held prefix of a chain); it refreshes nothing.
func (s *Store) Lookup(keys []string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, k := range keys {
		if !s.heldLocked(k) {
			return i
		}
	}
	return len(keys)
}

// Delete removes keys from every tier (the remote one too, when there is
// one) and returns how many were held.
func (s *Store) Delete(ctx context.Context, keys []string) (int, error) {
	n := 0
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return 0, errStoreClose
	}
	var remote []string
	for _, k := range keys {
		e := s.local[k]
		r, inRemote := s.remote[k]
		if e == nil && !inRemote {
			continue
		}
		info := r.info
		if e != nil {
			info = e.info
			s.unlinkLocked(e)
		}
		if inRemote {
			delete(s.remote, k)
			remote = append(remote, k)
		}
		n++
		s.st.Deleted++
		s.removedEventLocked(info)
	}
	s.flushLocked()
	s.mu.Unlock()
	if len(remote) > 0 && s.cfg.Remote != nil {
		if err := s.cfg.Remote.Delete(ctx, remote); err != nil {
			s.count(func(st *Stats) { st.RemoteErrors++ })
			return n, fmt.Errorf("kvstore: remote delete: %w", err)
		}
	}
	return n, nil
}

// Stats returns the store's gauges and counters.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.st
	st.MemoryEntries, st.MemoryBytes, st.MemoryCapacity = s.mem.Len(), s.memB, s.cfg.MemoryBytes
	st.DiskEntries, st.DiskBytes = s.dsk.Len(), s.dskB
	if s.disk != nil {
		st.DiskCapacity = s.cfg.DiskBytes
	}
	st.RemoteKeys = len(s.remote)
	return st
}

// Close drops every local entry (no events: the store's stream ends with
// it) and removes the disk tier's files. Later calls fail. Idempotent.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	s.local, s.remote = map[string]*entry{}, map[string]remoteEntry{}
	s.mem.Init()
	s.dsk.Init()
	s.memB, s.dskB = 0, 0
	if s.disk != nil {
		return s.disk.wipe()
	}
	return nil
}

// Remote index: the remote tier's indexer (Redis keyspace notifications)
// tells the store which keys it holds.

// RemoteStored records that the remote tier holds key (size: its payload
// bytes), publishing BlockStored when the key was not held.
func (s *Store) RemoteStored(key string, size int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.remoteStoredLocked(key, size)
	s.flushLocked()
}

func (s *Store) remoteStoredLocked(key string, size int64) {
	if s.closed || key == "" || len(key) > MaxKeyBytes {
		return
	}
	if r, ok := s.remote[key]; ok {
		r.size = size
		s.remote[key] = r
		return
	}
	if len(s.remote) >= s.cfg.MaxRemoteKeys {
		s.st.RemoteIndexFull++
		return
	}
	wasHeld := s.heldLocked(key)
	info := ParseKey(key)
	if e := s.local[key]; e != nil {
		info = e.info
	}
	s.remote[key] = remoteEntry{info: info, size: size}
	if !wasHeld {
		s.st.Stored++
		s.storedEventLocked(info, &Meta{Size: size, HasData: true})
	}
}

// RemoteRemoved records that the remote tier no longer holds key,
// publishing BlockRemoved when no tier holds it now.
func (s *Store) RemoteRemoved(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.remoteRemovedLocked(key)
	s.flushLocked()
}

func (s *Store) remoteRemovedLocked(key string) {
	r, ok := s.remote[key]
	if !ok {
		return
	}
	delete(s.remote, key)
	if !s.heldLocked(key) {
		s.st.Evicted++
		s.removedEventLocked(r.info)
	}
}

// RemoteReplace makes the remote index exactly keys (key → payload bytes;
// a full scan of the remote tier), publishing the differences as one batch.
func (s *Store) RemoteReplace(keys map[string]int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k := range s.remote {
		if _, ok := keys[k]; !ok {
			s.remoteRemovedLocked(k)
		}
	}
	for k, size := range keys {
		s.remoteStoredLocked(k, size)
	}
	s.flushLocked()
}

// RemoteKeys returns how many keys the remote index holds.
func (s *Store) RemoteKeys() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.remote)
}

// --- internals; s.mu held.

func (s *Store) count(f func(*Stats)) {
	s.mu.Lock()
	f(&s.st)
	s.mu.Unlock()
}

func (s *Store) heldLocked(key string) bool {
	if _, ok := s.local[key]; ok {
		return true
	}
	_, ok := s.remote[key]
	return ok
}

// insertMemLocked puts e, not linked, at the front of the memory tier and
// spills least recently used entries until the tier fits (e itself fits:
// Validate).
func (s *Store) insertMemLocked(e *entry) {
	e.tier = tierMem
	e.elem = s.mem.PushFront(e)
	s.memB += e.cost
	for s.memB > s.cfg.MemoryBytes {
		old := s.mem.Back().Value.(*entry)
		s.mem.Remove(old.elem)
		s.memB -= old.cost
		s.spillLocked(old)
	}
}

// spillLocked moves old, just out of the memory tier, to the disk tier,
// or drops it from the store.
func (s *Store) spillLocked(old *entry) {
	if s.disk == nil || old.cost > s.cfg.DiskBytes {
		s.dropLocked(old)
		return
	}
	if err := s.disk.write(old.key, &old.meta, old.data); err != nil {
		s.st.DiskErrors++
		s.cfg.Logger.Warn("kvstore: disk tier write failed; entry dropped", "err", err)
		s.dropLocked(old)
		return
	}
	s.st.Spilled++
	old.tier = tierDisk
	old.data = nil
	old.meta.TokenIDs = nil
	old.elem = s.dsk.PushFront(old)
	s.dskB += old.cost
	for s.dskB > s.cfg.DiskBytes {
		d := s.dsk.Back().Value.(*entry)
		s.dsk.Remove(d.elem)
		s.dskB -= d.cost
		s.disk.remove(d.key)
		s.dropLocked(d)
	}
}

// dropLocked forgets e, unlinked from its tier, publishing BlockRemoved
// unless the remote tier holds it.
func (s *Store) dropLocked(e *entry) {
	delete(s.local, e.key)
	if _, ok := s.remote[e.key]; !ok {
		s.st.Evicted++
		s.removedEventLocked(e.info)
	}
}

// unlinkLocked removes e from its tier and the map, without an event.
func (s *Store) unlinkLocked(e *entry) {
	switch e.tier {
	case tierMem:
		s.mem.Remove(e.elem)
		s.memB -= e.cost
	case tierDisk:
		s.dsk.Remove(e.elem)
		s.dskB -= e.cost
		s.disk.remove(e.key)
	}
	delete(s.local, e.key)
}

// promoteLocked reads a disk-tier entry back and moves it to the memory
// tier. A file that cannot be read drops the entry.
func (s *Store) promoteLocked(e *entry) (Meta, []byte, bool) {
	m := e.meta
	tok, data, err := s.disk.read(e.key, &m, e.ntok)
	s.dsk.Remove(e.elem)
	s.dskB -= e.cost
	s.disk.remove(e.key)
	if err != nil {
		s.st.DiskErrors++
		s.cfg.Logger.Warn("kvstore: disk tier read failed; entry dropped", "err", err)
		s.dropLocked(e)
		return Meta{}, nil, false
	}
	m.TokenIDs = tok
	e.meta, e.data = m, data
	s.insertMemLocked(e)
	return m, data, true
}

func (s *Store) publishes(info KeyInfo) bool {
	return s.cfg.Events != nil && info.Hashed && (s.cfg.EventModel == "" || info.Model == s.cfg.EventModel)
}

func (s *Store) storedEventLocked(info KeyInfo, m *Meta) {
	if !s.publishes(info) {
		return
	}
	bs := m.BlockSize
	if bs == 0 {
		bs = len(m.TokenIDs)
	}
	s.st.EventsStored++
	s.pending = append(s.pending, kvevent.Event{Type: kvevent.BlockStored, BlockHashes: []uint64{info.Hash},
		ParentBlockHash: m.ParentHash, HasParent: m.HasParent, TokenIDs: m.TokenIDs, BlockSize: bs,
		LoRAName: info.Adapter, Medium: kvevent.MediumRemote, GroupIdx: -1})
}

func (s *Store) removedEventLocked(info KeyInfo) {
	if !s.publishes(info) {
		return
	}
	s.st.EventsRemoved++
	s.pending = append(s.pending, kvevent.Event{Type: kvevent.BlockRemoved, BlockHashes: []uint64{info.Hash},
		Medium: kvevent.MediumRemote, GroupIdx: -1})
}

func (s *Store) flushLocked() {
	if len(s.pending) == 0 {
		return
	}
	s.cfg.Events(s.pending)
	s.pending = s.pending[:0]
}

// HeldWithData reports whether key is held with bytes: a local entry with
// a payload, or a key of the remote index (the remote tier holds bytes).
func (s *Store) HeldWithData(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.local[key]; e != nil && e.meta.HasData {
		return true
	}
	_, ok := s.remote[key]
	return ok
}
