package kvstore

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// LMCache's Redis layout (docs/PROTOCOLS.md §6.1, §6.3;
// lmcache/v1/storage_backend/connector/redis_connector.py@030c7718): two
// keys per chunk, "<key>kv_bytes" (the raw bytes) and "<key>metadata" (28
// bytes, RemoteMetadata: 7 native little-endian int32 length, fmt, dtype,
// shape0..3), written with SET in that order, read with GET; EXISTS
// "<key>metadata" is LMCache's lookup.

// Suffixes of LMCache's two keys.
const (
	RedisBytesSuffix = "kv_bytes"
	RedisMetaSuffix  = "metadata"
	RedisMetaBytes   = 28
)

// EncodeRedisMeta returns the 28-byte RemoteMetadata of m (length =
// m.Size).
func EncodeRedisMeta(m Meta) []byte {
	b := make([]byte, 0, RedisMetaBytes)
	for _, v := range []int32{int32(m.Size), m.Fmt, m.Dtype, m.Shape[0], m.Shape[1], m.Shape[2], m.Shape[3]} {
		b = binary.LittleEndian.AppendUint32(b, uint32(v))
	}
	return b
}

// DecodeRedisMeta reads a 28-byte RemoteMetadata (HasData set, Size =
// length); anything else, or a negative length, is an error.
func DecodeRedisMeta(b []byte) (Meta, error) {
	if len(b) != RedisMetaBytes {
		return Meta{}, fmt.Errorf("kvstore: redis metadata of %d bytes, want %d", len(b), RedisMetaBytes)
	}
	i32 := func(i int) int32 { return int32(binary.LittleEndian.Uint32(b[4*i:])) }
	if i32(0) < 0 {
		return Meta{}, fmt.Errorf("kvstore: redis metadata: negative length %d", i32(0))
	}
	return Meta{Size: int64(i32(0)), HasData: true, Fmt: i32(1), Dtype: i32(2),
		Shape: [4]int32{i32(3), i32(4), i32(5), i32(6)}}, nil
}

// Defaults of RedisConfig.
const (
	DefaultRedisTimeout       = 10 * time.Second
	DefaultRedisScanCount     = 1000
	DefaultRedisNotifyTimeout = 30 * time.Second
)

// RedisConfig configures a Redis tier. Zero fields take defaults.
type RedisConfig struct {
	// URL is redis://[user:password@]host:port[/db] (also rediss:// and
	// unix://, as go-redis parses them).
	URL string
	// DialTimeout, ReadTimeout and WriteTimeout bound every command's
	// parts (default 10 s each).
	DialTimeout, ReadTimeout, WriteTimeout time.Duration
	// NoConfigSet leaves notify-keyspace-events alone (a managed Redis that
	// refuses CONFIG SET, configured by its operator); by default the
	// indexer adds the flags it needs, K$gxe, to those set.
	NoConfigSet bool
	// ScanCount is SCAN's COUNT hint (default 1000).
	ScanCount int
	// MaxObjectBytes bounds a payload read from Redis (default the store's
	// bound): a larger length in a key's metadata is a miss.
	MaxObjectBytes int64
	Logger         *slog.Logger
}

// RedisStats are a Redis tier's counters.
type RedisStats struct {
	Writes        uint64 `json:"writes"`
	Reads         uint64 `json:"reads"`
	Deletes       uint64 `json:"deletes"`
	Errors        uint64 `json:"errors"`
	Notifications uint64 `json:"notifications"`
	Subscriptions uint64 `json:"subscriptions"`
	Scans         uint64 `json:"scans"`
	ScannedKeys   uint64 `json:"scanned_keys"`
	BadMetadata   uint64 `json:"bad_metadata"`
}

// Redis is a Redis server in LMCache's layout, as a Store's Remote tier
// (write-through of entries with bytes, reads of misses, deletes) and as
// the source of the store's remote index (Run: keyspace notifications and
// SCAN). A vLLM+LMCache fleet configured with the same remote_url shares
// its entries with the store both ways.
type Redis struct {
	c   *redis.Client
	db  int
	cfg RedisConfig

	writes, reads, deletes, errs, notes, subs, scans, scanned, badMeta atomic.Uint64
}

// NewRedis connects to cfg.URL and checks it with PING.
func NewRedis(ctx context.Context, cfg RedisConfig) (*Redis, error) {
	opt, err := redis.ParseURL(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("kvstore: redis URL: %w", err)
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = DefaultRedisTimeout
	}
	if cfg.ReadTimeout <= 0 {
		cfg.ReadTimeout = DefaultRedisTimeout
	}
	if cfg.WriteTimeout <= 0 {
		cfg.WriteTimeout = DefaultRedisTimeout
	}
	if cfg.ScanCount <= 0 {
		cfg.ScanCount = DefaultRedisScanCount
	}
	if cfg.MaxObjectBytes <= 0 {
		cfg.MaxObjectBytes = DefaultMaxObjectBytes
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	opt.DialTimeout, opt.ReadTimeout, opt.WriteTimeout = cfg.DialTimeout, cfg.ReadTimeout, cfg.WriteTimeout
	opt.Protocol = 2 // RESP2, as LMCache's redis-py client speaks
	opt.DisableIdentity = true
	r := &Redis{c: redis.NewClient(opt), db: opt.DB, cfg: cfg}
	pctx, cancel := context.WithTimeout(ctx, cfg.DialTimeout)
	defer cancel()
	if err := r.c.Ping(pctx).Err(); err != nil {
		_ = r.c.Close()
		return nil, fmt.Errorf("kvstore: redis %s: %w", redactURL(cfg.URL), err)
	}
	return r, nil
}

// redactURL drops a URL's password for messages.
func redactURL(u string) string {
	scheme, rest, ok := strings.Cut(u, "://")
	if !ok {
		return u
	}
	if at := strings.LastIndexByte(rest, '@'); at >= 0 {
		rest = "…@" + rest[at+1:]
	}
	return scheme + "://" + rest
}

// Client returns the underlying go-redis client.
func (r *Redis) Client() *redis.Client { return r.c }

// Stats returns the tier's counters.
func (r *Redis) Stats() RedisStats {
	return RedisStats{Writes: r.writes.Load(), Reads: r.reads.Load(), Deletes: r.deletes.Load(), Errors: r.errs.Load(),
		Notifications: r.notes.Load(), Subscriptions: r.subs.Load(), Scans: r.scans.Load(), ScannedKeys: r.scanned.Load(),
		BadMetadata: r.badMeta.Load()}
}

// Close closes the client (Run returns).
func (r *Redis) Close() error { return r.c.Close() }

func (r *Redis) fail(err error) error {
	if err != nil {
		r.errs.Add(1)
	}
	return err
}

// Put writes items with bytes in LMCache's layout, pipelined: for each,
// SET <key>kv_bytes then SET <key>metadata. Items without bytes, or over
// an int32 length, are skipped (LMCache would read them as KV tensors).
func (r *Redis) Put(ctx context.Context, items []Item) error {
	p := r.c.Pipeline()
	n := 0
	for i := range items {
		it := &items[i]
		if it.Data == nil || len(it.Data) > math.MaxInt32 {
			continue
		}
		m := it.Meta
		m.Size = int64(len(it.Data))
		p.Set(ctx, it.Key+RedisBytesSuffix, it.Data, 0)
		p.Set(ctx, it.Key+RedisMetaSuffix, EncodeRedisMeta(m), 0)
		n++
	}
	if n == 0 {
		return nil
	}
	_, err := p.Exec(ctx)
	if err == nil {
		r.writes.Add(uint64(n))
	}
	return r.fail(err)
}

// Get reads key's metadata and, with withData, its bytes (GET
// <key>metadata, GET <key>kv_bytes). Bytes missing, or of another length
// than the metadata's, are a miss, as in LMCache.
func (r *Redis) Get(ctx context.Context, key string, withData bool) (Meta, []byte, bool, error) {
	raw, err := r.c.Get(ctx, key+RedisMetaSuffix).Bytes()
	if errors.Is(err, redis.Nil) {
		return Meta{}, nil, false, nil
	}
	if err != nil {
		return Meta{}, nil, false, r.fail(err)
	}
	m, err := DecodeRedisMeta(raw)
	if err != nil || m.Size > r.cfg.MaxObjectBytes {
		r.badMeta.Add(1)
		return Meta{}, nil, false, nil
	}
	r.reads.Add(1)
	if !withData {
		return m, nil, true, nil
	}
	data, err := r.c.Get(ctx, key+RedisBytesSuffix).Bytes()
	if errors.Is(err, redis.Nil) {
		return Meta{}, nil, false, nil
	}
	if err != nil {
		return Meta{}, nil, false, r.fail(err)
	}
	if int64(len(data)) != m.Size {
		r.badMeta.Add(1)
		return Meta{}, nil, false, nil
	}
	return m, data, true, nil
}

// Delete removes keys' two Redis keys.
func (r *Redis) Delete(ctx context.Context, keys []string) error {
	if len(keys) == 0 {
		return nil
	}
	rk := make([]string, 0, 2*len(keys))
	for _, k := range keys {
		rk = append(rk, k+RedisBytesSuffix, k+RedisMetaSuffix)
	}
	err := r.c.Del(ctx, rk...).Err()
	if err == nil {
		r.deletes.Add(uint64(len(keys)))
	}
	return r.fail(err)
}

// notifyFlags are the notify-keyspace-events classes the indexer needs:
// keyspace channels (K) for string commands ($: SET), generic ones (g:
// DEL, UNLINK, RENAME, …), expirations (x) and evictions (e).
const notifyFlags = "K$gxe"

// ensureNotifications adds notifyFlags to the server's
// notify-keyspace-events.
func (r *Redis) ensureNotifications(ctx context.Context) error {
	cur, err := r.c.ConfigGet(ctx, "notify-keyspace-events").Result()
	if err != nil {
		return err
	}
	flags := cur["notify-keyspace-events"]
	want := flags
	for _, f := range notifyFlags {
		if strings.ContainsRune(want, f) {
			continue
		}
		if f != 'K' && strings.ContainsRune(want, 'A') {
			continue // A: every class but K, E (and m, n)
		}
		want += string(f)
	}
	if want == flags {
		return nil
	}
	return r.c.ConfigSet(ctx, "notify-keyspace-events", want).Err()
}

// Run indexes what the Redis server holds in LMCache's layout into
// store's remote index until ctx ends or the client is closed: it
// subscribes to the keyspace channels of its database
// (__keyspace@<db>__:*), then, on every (re)subscription, SCANs the
// "*metadata" keys and makes the index exactly what it found; a SET of
// <key>metadata indexes <key> (its metadata read with GET), a DEL,
// UNLINK, RENAME away, expiry or eviction of either of the two keys
// removes it. The store publishes the changes. What Redis cannot tell:
// token ids, parent hashes and adapters (events for these keys carry
// none) and the chunk hash of keys not in LMCache's key format (not
// published; still served).
func (r *Redis) Run(ctx context.Context, store *Store) error {
	if !r.cfg.NoConfigSet {
		if err := r.ensureNotifications(ctx); err != nil {
			r.cfg.Logger.Warn("kvstore: could not enable Redis keyspace notifications (set notify-keyspace-events "+notifyFlags+" on the server)", "err", err)
		}
	}
	prefix := "__keyspace@" + strconv.Itoa(r.db) + "__:"
	ps := r.c.PSubscribe(ctx, prefix+"*")
	defer ps.Close()
	backoff := time.Duration(0)
	for {
		msg, err := ps.ReceiveTimeout(ctx, DefaultRedisNotifyTimeout)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, redis.ErrClosed) {
				return nil
			}
			var ne interface{ Timeout() bool }
			if errors.As(err, &ne) && ne.Timeout() {
				// Quiet: check the connection (a failed ping drops it, and the
				// next receive resubscribes).
				_ = ps.Ping(ctx)
				continue
			}
			r.errs.Add(1)
			backoff = min(max(2*backoff, 50*time.Millisecond), 5*time.Second)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff):
			}
			continue
		}
		backoff = 0
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "psubscribe" {
				r.subs.Add(1)
				if err := r.scan(ctx, store); err != nil && ctx.Err() == nil {
					r.errs.Add(1)
					r.cfg.Logger.Warn("kvstore: Redis scan failed; the index is incomplete until the next subscription", "err", err)
				}
			}
		case *redis.Message:
			r.notes.Add(1)
			r.apply(ctx, store, strings.TrimPrefix(m.Channel, prefix), m.Payload)
		}
	}
}

// apply applies one keyspace notification: event on rkey.
func (r *Redis) apply(ctx context.Context, store *Store, rkey, event string) {
	var key string
	var meta bool
	switch {
	case strings.HasSuffix(rkey, RedisMetaSuffix):
		key, meta = strings.TrimSuffix(rkey, RedisMetaSuffix), true
	case strings.HasSuffix(rkey, RedisBytesSuffix):
		key = strings.TrimSuffix(rkey, RedisBytesSuffix)
	default:
		return
	}
	if key == "" || len(key) > MaxKeyBytes {
		return
	}
	switch event {
	case "set", "rename_to", "restore", "copy_to":
		if !meta {
			return
		}
		raw, err := r.c.Get(ctx, rkey).Bytes()
		if errors.Is(err, redis.Nil) {
			return // gone again: its del follows
		}
		if err != nil {
			r.errs.Add(1)
			return
		}
		m, err := DecodeRedisMeta(raw)
		if err != nil {
			r.badMeta.Add(1)
			return
		}
		store.RemoteStored(key, m.Size)
	case "del", "expired", "evicted", "rename_from":
		store.RemoteRemoved(key)
	}
}

// scan makes store's remote index what a full SCAN of "*metadata" keys
// finds (at most the store's MaxRemoteKeys).
func (r *Redis) scan(ctx context.Context, store *Store) error {
	r.scans.Add(1)
	found := map[string]int64{}
	limit := store.cfg.MaxRemoteKeys
	var cursor uint64
	for {
		keys, next, err := r.c.Scan(ctx, cursor, "*"+RedisMetaSuffix, int64(r.cfg.ScanCount)).Result()
		if err != nil {
			return err
		}
		if len(keys) > 0 {
			vals, err := r.c.MGet(ctx, keys...).Result()
			if err != nil {
				return err
			}
			for i, v := range vals {
				s, ok := v.(string)
				if !ok {
					continue // gone since
				}
				m, err := DecodeRedisMeta([]byte(s))
				if err != nil {
					r.badMeta.Add(1)
					continue
				}
				k := strings.TrimSuffix(keys[i], RedisMetaSuffix)
				if k == "" || len(k) > MaxKeyBytes || len(found) >= limit {
					continue
				}
				found[k] = m.Size
			}
			r.scanned.Add(uint64(len(keys)))
		}
		cursor = next
		if cursor == 0 {
			break
		}
	}
	store.RemoteReplace(found)
	return nil
}
