package hftokenizer

import (
	"strconv"
	"sync"
	"testing"
)

// TestWordCacheEvictsColdKeepsHot: after a flood of one-off words three
// times the cache's size, a word hit between every few hundred of them is
// still cached, the latest words are cached too (a cache that takes no
// more once full would keep the first 65,536 words it met for ever), and
// the cache holds at most its bound.
func TestWordCacheEvictsColdKeepsHot(t *testing.T) {
	var c wordCache
	c.put("hot", []uint32{7})
	const flood = 3 * cacheShards * cacheShardCap
	for i := range flood {
		c.put("cold"+strconv.Itoa(i), []uint32{uint32(i)})
		if i%300 == 0 {
			if ids, ok := c.get("hot"); !ok || len(ids) != 1 || ids[0] != 7 {
				t.Fatalf("after %d cold words the hot word is gone (%v, %v)", i, ids, ok)
			}
		}
	}
	for i := flood - 100; i < flood; i++ {
		if ids, ok := c.get("cold" + strconv.Itoa(i)); !ok || ids[0] != uint32(i) {
			t.Fatalf("recent word %d not cached (%v, %v)", i, ids, ok)
		}
	}
	if _, ok := c.get("cold0"); ok {
		t.Fatal("the first cold word, never hit, survived three times the cache's size")
	}
	n := 0
	for i := range c.shards {
		sh := &c.shards[i]
		if len(sh.m) != len(sh.slots) || len(sh.slots) > cacheShardCap {
			t.Fatalf("shard %d: %d words mapped, %d slots", i, len(sh.m), len(sh.slots))
		}
		for w, j := range sh.m {
			if sh.slots[j].word != w {
				t.Fatalf("shard %d: %q maps to slot %d holding %q", i, w, j, sh.slots[j].word)
			}
		}
		n += len(sh.m)
	}
	if n > cacheShards*cacheShardCap {
		t.Fatalf("%d words cached, bound %d", n, cacheShards*cacheShardCap)
	}
	if a := testing.AllocsPerRun(100, func() { c.get("hot") }); a != 0 {
		t.Fatalf("a hit allocates %.1f times", a)
	}
}

// TestWordCacheConcurrent: hits and evicting puts at once (run with -race);
// a word read is always its own ids.
func TestWordCacheConcurrent(t *testing.T) {
	var c wordCache
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 40000 {
				w := strconv.Itoa((i*7 + g) % 90000)
				if ids, ok := c.get(w); ok {
					if strconv.Itoa(int(ids[0])) != w {
						t.Errorf("word %s read ids %v", w, ids)
						return
					}
					continue
				}
				n, _ := strconv.Atoi(w)
				c.put(w, []uint32{uint32(n)})
			}
		}()
	}
	wg.Wait()
}
