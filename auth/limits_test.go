package auth

import (
	"net/http"
	"testing"
	"time"
)

func TestBucket(t *testing.T) {
	t0 := time.Now()
	b := newBucket(60) // one per second
	if ok, _ := b.check(t0, 60); !ok {
		t.Fatal("a new bucket is not full")
	}
	b.take(60)
	ok, wait := b.check(t0, 1)
	if ok || wait != time.Second {
		t.Fatalf("empty bucket: ok %v wait %v, want false 1s", ok, wait)
	}
	if ok, _ := b.check(t0.Add(1500*time.Millisecond), 1); !ok {
		t.Fatal("no refill after 1.5 s")
	}
	if ok, _ := b.check(t0.Add(time.Hour), 61); ok {
		t.Fatal("refilled above the limit")
	}
	b.take(10)
	b.adjust(500) // usage far over the charge: debt capped at one minute
	if b.level != -60 {
		t.Fatalf("level %v, want -60", b.level)
	}
	b.adjust(-1000)
	if b.level != 60 {
		t.Fatalf("refund above the limit: level %v", b.level)
	}
	h := http.Header{}
	b.level = 15
	b.setHeaders(h, &requestHeaderNames)
	if h.Get("X-Ratelimit-Limit-Requests") != "60" || h.Get("X-Ratelimit-Remaining-Requests") != "15" ||
		h.Get("X-Ratelimit-Reset-Requests") != "45s" {
		t.Fatalf("headers %v", h)
	}
	var none bucket
	if ok, _ := none.check(t0, 1e9); !ok {
		t.Fatal("an unlimited bucket refused")
	}
}

// TestBucketSetLimit: a changed limit keeps what was used of the minute.
func TestBucketSetLimit(t *testing.T) {
	t0 := time.Now()
	b := newBucket(10)
	b.check(t0, 1)
	b.take(4) // 6 left
	b.setLimit(20, t0)
	if b.limit != 20 || b.level != 16 {
		t.Fatalf("raised to 20: limit %v level %v, want 20 16", b.limit, b.level)
	}
	b.setLimit(2, t0)
	if b.level != -2 {
		t.Fatalf("lowered to 2 with 4 used: level %v, want -2 (the floor)", b.level)
	}
	b.setLimit(0, t0)
	if ok, _ := b.check(t0, 1e9); !ok {
		t.Fatal("no limit any more, but refused")
	}
	b.setLimit(5, t0)
	if b.level != 5 {
		t.Fatalf("limited again: level %v, want 5 (a bucket that had no limit starts full)", b.level)
	}
}
