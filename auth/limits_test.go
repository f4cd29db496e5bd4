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

// TestCharge: Charge's outcomes, Refund and Settle, at a stopped clock.
func TestCharge(t *testing.T) {
	t0 := time.Now()
	l := newLimits(2, 100)
	h := http.Header{}
	c := l.Charge(t0, 40, 40, h)
	if !c.OK || c.Reserved != 40 || c.Tokens != 40 || h.Get("X-Ratelimit-Remaining-Requests") != "1" || h.Get("X-Ratelimit-Remaining-Tokens") != "60" {
		t.Fatalf("first: %+v %v", c, h)
	}
	// A bound from the context over the minute is held to the minute…
	if c := l.Charge(t0, 500, 10, http.Header{}); c.OK || c.TooLarge || c.Limit != "tokens" || c.PerMinute != 100 || c.Tokens != 100 ||
		c.Wait != 24*time.Second {
		t.Fatalf("context bound over the minute: %+v, want tokens refused, 24s (40 of 100 tokens short)", c)
	}
	// …what the client asked for is not.
	if c := l.Charge(t0, 500, 500, http.Header{}); c.OK || !c.TooLarge || c.Limit != "tokens" || c.Tokens != 500 || c.Wait != 0 {
		t.Fatalf("asked over the minute: %+v, want TooLarge", c)
	}
	l.Settle(10, c.Reserved) // used 10 of the 40 charged: 30 back
	if req, tok := l.Levels(); req != 1 || tok != 90 {
		t.Fatalf("settled: levels %v %v, want 1 90", req, tok)
	}
	c = l.Charge(t0, 1, 1, http.Header{})
	if !c.OK {
		t.Fatalf("second: %+v", c)
	}
	if c := l.Charge(t0, 1, 1, http.Header{}); c.OK || c.Limit != "requests" || c.PerMinute != 2 || c.Wait != 30*time.Second {
		t.Fatalf("third: %+v, want requests refused for 30s", c)
	}
	h = http.Header{}
	l.Refund(c.Reserved, h)
	if req, tok := l.Levels(); req != 1 || tok != 90 || h.Get("X-Ratelimit-Remaining-Requests") != "1" {
		t.Fatalf("refunded: levels %v %v headers %v, want 1 90", req, tok, h)
	}
	// No token limit: nothing reserved, usage not charged.
	r := newLimits(5, 0)
	if c := r.Charge(t0, 1e6, 1e6, http.Header{}); !c.OK || c.Reserved != 0 {
		t.Fatalf("request limit only: %+v", c)
	}
	r.Settle(1e6, 0)
	if newLimits(0, 0) != nil {
		t.Fatal("limits for a key without any")
	}
}
