package kvstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/infergate/infergate/kvevents"
)

func startService(t *testing.T, cfg ServiceConfig) *Service {
	t.Helper()
	cfg.Logger = quietLogger()
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	cfg.Events = kvevents.PublisherConfig{Enable: true, Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Bind: true}
	svc, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = svc.Close(context.Background()) })
	return svc
}

func rawRedis(t *testing.T, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: addr, Protocol: 2})
	t.Cleanup(func() { c.Close() })
	return c
}

// TestRedisLayout: what the store writes through is LMCache's two-key
// layout, byte for byte; what it reads back from Redis alone is the same.
func TestRedisLayout(t *testing.T) {
	addr := startRedis(t)
	ctx := context.Background()
	svc := startService(t, ServiceConfig{Store: Config{MemoryBytes: 8 << 20}, Redis: RedisConfig{URL: "redis://" + addr + "/0"}, Model: "m"})
	raw := rawRedis(t, addr)
	data := bytes.Repeat([]byte{1, 2, 3, 4, 5, 6, 7, 8}, 1<<17) // 1 MiB
	key := "m@1@0@abcdef@bfloat16"
	if _, err := svc.Store.Put(ctx, []Item{{Key: key, Data: data, Meta: Meta{Fmt: 1, Dtype: 3, Shape: [4]int32{2, 16, 8, 256}}}}); err != nil {
		t.Fatal(err)
	}
	meta, err := raw.Get(ctx, key+"metadata").Bytes()
	if err != nil {
		t.Fatal(err)
	}
	var want bytes.Buffer
	for _, v := range []int32{1 << 20, 1, 3, 2, 16, 8, 256} { // length, fmt, dtype, shape0..3
		binary.Write(&want, binary.LittleEndian, v)
	}
	if !bytes.Equal(meta, want.Bytes()) {
		t.Fatalf("metadata % x\nwant     % x", meta, want.Bytes())
	}
	if b, err := raw.Get(ctx, key+"kv_bytes").Bytes(); err != nil || !bytes.Equal(b, data) {
		t.Fatalf("kv_bytes: %v, equal %v", err, bytes.Equal(b, data))
	}
	// Metadata-only entries stay local: LMCache would read them as tensors.
	svc.Store.Put(ctx, []Item{{Key: nk(5), Meta: Meta{Size: 100}}})
	if n, _ := raw.Exists(ctx, nk(5)+"metadata").Result(); n != 0 {
		t.Fatal("a metadata-only entry was written to Redis")
	}
	// A block LMCache wrote (SET kv_bytes, then SET metadata) is served
	// from Redis; one whose bytes do not match its metadata is a miss.
	raw.Set(ctx, "m@1@0@77@half"+"kv_bytes", []byte("0123456789"), 0)
	raw.Set(ctx, "m@1@0@77@half"+"metadata", EncodeRedisMeta(Meta{Size: 10, Fmt: 4, Dtype: 1, Shape: [4]int32{10}}), 0)
	waitHeld(t, svc.Store, "m@1@0@77@half")
	m, b, ok, err := svc.Store.Get(ctx, "m@1@0@77@half", true)
	if err != nil || !ok || string(b) != "0123456789" || m.Fmt != 4 || m.Dtype != 1 || m.Shape != [4]int32{10} {
		t.Fatalf("remote get: %+v %q %v %v", m, b, ok, err)
	}
	raw.Set(ctx, "m@1@0@77@half"+"kv_bytes", []byte("short"), 0)
	if _, _, ok, _ := svc.Store.Get(ctx, "m@1@0@77@half", true); ok {
		t.Fatal("bytes of another length than the metadata's were served")
	}
	// Delete removes both keys.
	if n, err := svc.Store.Delete(ctx, []string{key}); n != 1 || err != nil {
		t.Fatalf("delete: %d %v", n, err)
	}
	if n, _ := raw.Exists(ctx, key+"metadata", key+"kv_bytes").Result(); n != 0 {
		t.Fatalf("%d keys left after delete", n)
	}
}

func waitHeld(t *testing.T, s *Store, key string) {
	t.Helper()
	snk := newSink()
	snk.await(t, "the store to index "+key, func(*sink) bool { return s.Held(key) })
}

// TestRedisIndexEvents: what an LMCache instance writes to Redis, before
// the store starts (SCAN) or while it runs (keyspace notifications), is
// published as BlockStored/BlockRemoved REMOTE to a kvevents.Subscriber.
func TestRedisIndexEvents(t *testing.T) {
	addr := startRedis(t)
	ctx := context.Background()
	raw := rawRedis(t, addr)
	lmset := func(key string, data []byte) {
		t.Helper()
		if err := raw.Set(ctx, key+"kv_bytes", data, 0).Err(); err != nil {
			t.Fatal(err)
		}
		if err := raw.Set(ctx, key+"metadata", EncodeRedisMeta(Meta{Size: int64(len(data)), Fmt: 1, Dtype: 3}), 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	lmset("m@1@0@aa01@bfloat16", []byte("before start"))
	svc := startService(t, ServiceConfig{Store: Config{MemoryBytes: 1 << 20}, Redis: RedisConfig{URL: "redis://" + addr + "/0"}, Model: "m"})
	pub := svc.Publisher()
	snk := subscribe(t, "tcp://"+pub.Addr().String(), "tcp://"+pub.ReplayAddr().String())
	snk.await(t, "the scanned key's BlockStored", func(s *sink) bool { return s.held[0xaa01] })
	lmset("m@1@0@aa02@bfloat16", []byte("while running"))
	lmset("other-model@1@0@aa03@bfloat16", []byte("not this stream's"))
	snk.await(t, "the notified key's BlockStored", func(s *sink) bool { return s.held[0xaa02] })
	snk.mu.Lock()
	e, _ := snk.find(kvevents.BlockStored, 0xaa02)
	snk.mu.Unlock()
	if e.Medium != "REMOTE" || len(e.TokenIDs) != 0 || e.HasParent {
		t.Fatalf("event %+v", e)
	}
	raw.Del(ctx, "m@1@0@aa01@bfloat16kv_bytes") // LMCache: metadata without bytes is a miss
	raw.Set(ctx, "m@1@0@aa02@bfloat16metadata", EncodeRedisMeta(Meta{Size: 13}), 0)
	raw.Expire(ctx, "m@1@0@aa02@bfloat16metadata", time.Second) // expired by Redis
	snk.await(t, "BlockRemoved for the deleted and the expired key", func(s *sink) bool { return !s.held[0xaa01] && !s.held[0xaa02] })
	if st := svc.Stats(); st.Store.RemoteKeys != 1 || st.Redis.Subscriptions < 1 || st.Redis.Scans < 1 { // aa03 is indexed, not published
		t.Fatalf("stats %+v %+v", st.Store, st.Redis)
	}
	snk.mu.Lock()
	_, other := snk.find(kvevents.BlockStored, 0xaa03)
	snk.mu.Unlock()
	if other {
		t.Fatal("another model's block published")
	}
	// A resubscription (Redis drops the pubsub connection) rescans: a key
	// written meanwhile is indexed either way.
	if err := raw.Do(ctx, "CLIENT", "KILL", "TYPE", "pubsub").Err(); err != nil {
		t.Fatal(err)
	}
	lmset("m@1@0@aa04@bfloat16", []byte("after the kill"))
	snk.await(t, "the key written across a resubscription", func(s *sink) bool { return s.held[0xaa04] })
	snk.await(t, "the resubscription", func(*sink) bool { return svc.Redis().Stats().Subscriptions >= 2 })
}
