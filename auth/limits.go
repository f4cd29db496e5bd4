package auth

import (
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Limits are one key's token buckets (one per key name: memory is bounded
// by the keys configured), for requests and for tokens. A reload keeps them
// for a key it keeps (Load), its limits changed in place (LimitChange).
// Every method takes the time it acts at (no clock is read here) and is
// safe for concurrent use.
type Limits struct {
	mu  sync.Mutex
	req bucket // requests
	tok bucket // tokens
}

// newLimits returns the buckets for the per-minute limits (0: none), or
// nil when the key has no limit.
func newLimits(rpm, tpm int) *Limits {
	if rpm <= 0 && tpm <= 0 {
		return nil
	}
	return &Limits{req: newBucket(rpm), tok: newBucket(tpm)}
}

// setLimits changes the per-minute limits (0: none) at now, keeping what
// the key has used of them (bucket.setLimit).
func (l *Limits) setLimits(rpm, tpm int, now time.Time) {
	l.mu.Lock()
	l.req.setLimit(rpm, now)
	l.tok.setLimit(tpm, now)
	l.mu.Unlock()
}

// Charge is what Limits.Charge decided.
type Charge struct {
	// OK: the request and Tokens were taken from the buckets.
	OK bool
	// TooLarge: the tokens the client asked for exceed the whole minute of
	// the token limit, so the request can never pass (not OK).
	TooLarge bool
	// Limit is the limit that refused the request, "requests" or "tokens"
	// (requests first when both do); "" when OK.
	Limit string
	// PerMinute is that limit's value (requests or tokens a minute).
	PerMinute float64
	// Wait is how long until the refused request would pass (0 when OK or
	// TooLarge).
	Wait time.Duration
	// Tokens is the request's token charge: the estimate, held to the
	// token limit unless TooLarge.
	Tokens float64
	// Reserved are the tokens charged (Tokens when OK under a token limit,
	// else 0), to give back with Refund or settle with Settle.
	Reserved float64
}

// Charge takes one request and est tokens (the request's bound on what it
// uses; asked: the part of it the client fixed itself) from the buckets at
// now, if both have them, and sets OpenAI's x-ratelimit-* headers in h
// from what is left. An estimate over the whole minute that comes from
// the context length (asked within the minute) is held to the minute: the
// request waits for a full bucket instead of never passing; what the
// client asked for itself is not (TooLarge). A request of no tokens
// (est 0: tokenize and the like) is not stopped by an overdrawn token
// minute.
func (l *Limits) Charge(now time.Time, est, asked float64, h http.Header) Charge {
	l.mu.Lock() // a reload may change the limits (setLimits)
	defer l.mu.Unlock()
	reqLimit, tokLimit := l.req.limit, l.tok.limit
	tooLarge := tokLimit > 0 && asked > tokLimit
	if tokLimit > 0 && !tooLarge {
		est = min(est, tokLimit)
	}
	okReq, waitReq := l.req.check(now, 1)
	okTok, waitTok := true, time.Duration(0)
	if est > 0 {
		okTok, waitTok = l.tok.check(now, est)
	}
	if okReq && okTok && !tooLarge {
		l.req.take(1)
		l.tok.take(est)
	}
	l.req.setHeaders(h, &requestHeaderNames)
	l.tok.setHeaders(h, &tokenHeaderNames)

	c := Charge{Tokens: est}
	switch {
	case tooLarge:
		c.TooLarge, c.Limit, c.PerMinute = true, "tokens", tokLimit
	case !okReq:
		c.Limit, c.PerMinute, c.Wait = "requests", reqLimit, waitReq
	case !okTok:
		c.Limit, c.PerMinute, c.Wait = "tokens", tokLimit, waitTok
	default:
		c.OK = true
		if tokLimit > 0 {
			c.Reserved = est
		}
	}
	return c
}

// Refund gives a charge back (1 request, reserved tokens): the request was
// refused before it was sent anywhere. h, when not nil, gets the
// x-ratelimit-* headers again.
func (l *Limits) Refund(reserved float64, h http.Header) {
	l.mu.Lock()
	l.req.adjust(-1)
	l.tok.adjust(-reserved)
	if h != nil {
		l.req.setHeaders(h, &requestHeaderNames)
		l.tok.setHeaders(h, &tokenHeaderNames)
	}
	l.mu.Unlock()
}

// Settle charges the difference between the tokens a request used (its
// reported usage; negative counts as 0) and the reserved tokens charged
// for it (a refund when it used less). A no-op without a token limit.
func (l *Limits) Settle(used int, reserved float64) {
	l.mu.Lock()
	l.tok.adjust(float64(max(used, 0)) - reserved)
	l.mu.Unlock()
}

// Levels are what the request and token buckets hold now (their levels as
// of their last refill; negative: overdrawn by usage).
func (l *Limits) Levels() (requests, tokens float64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.req.level, l.tok.level
}

// bucket is a token bucket holding up to limit units and refilled at limit
// per minute; starting full. Its level may go negative (to −limit at most)
// when usage reported after a response exceeds what admission charged, so
// the excess delays the key's next requests. limit 0: unlimited.
type bucket struct {
	limit float64
	level float64
	last  time.Time
}

func newBucket(perMinute int) bucket {
	return bucket{limit: float64(max(perMinute, 0)), level: float64(max(perMinute, 0))}
}

// refill adds what accrued since the last refill.
func (b *bucket) refill(now time.Time) {
	if !b.last.IsZero() {
		if dt := now.Sub(b.last); dt > 0 {
			b.level = min(b.limit, b.level+dt.Minutes()*b.limit)
		}
	}
	b.last = now
}

// check refills and reports whether n units are available now, else how
// long until they are.
func (b *bucket) check(now time.Time, n float64) (bool, time.Duration) {
	if b.limit <= 0 {
		return true, 0
	}
	b.refill(now)
	if b.level >= n {
		return true, 0
	}
	need := min(n, b.limit) - b.level
	return false, time.Duration(need / b.limit * float64(time.Minute))
}

// setLimit changes the bucket's limit at now to perMinute (0: unlimited),
// keeping what was used of the minute: a bucket limit − level short of full
// stays as short of full under the new limit (within [−limit, limit]), so
// a raised limit is available at once and a lowered one holds what was
// already spent against it. A bucket that had no limit starts full.
func (b *bucket) setLimit(perMinute int, now time.Time) {
	n := float64(max(perMinute, 0))
	if b.limit <= 0 || n <= 0 {
		*b = newBucket(perMinute)
		return
	}
	b.refill(now)
	used := b.limit - b.level
	b.limit = n
	b.level = max(-n, min(n, n-used))
}

// take removes n units (after a successful check).
func (b *bucket) take(n float64) {
	if b.limit > 0 {
		b.level -= n
	}
}

// adjust removes delta units (negative: returns them), keeping the level
// within [−limit, limit].
func (b *bucket) adjust(delta float64) {
	if b.limit > 0 {
		b.level = max(-b.limit, min(b.limit, b.level-delta))
	}
}

// Header names of OpenAI's rate-limit headers, per limit kind.
var (
	requestHeaderNames = [3]string{"X-Ratelimit-Limit-Requests", "X-Ratelimit-Remaining-Requests", "X-Ratelimit-Reset-Requests"}
	tokenHeaderNames   = [3]string{"X-Ratelimit-Limit-Tokens", "X-Ratelimit-Remaining-Tokens", "X-Ratelimit-Reset-Tokens"}
)

// setHeaders sets OpenAI's x-ratelimit-limit-, -remaining- and -reset-
// headers named by names (reset: the time until the bucket is full again,
// as a Go duration like OpenAI's "6m0s" or "20ms").
func (b *bucket) setHeaders(h http.Header, names *[3]string) {
	if b.limit <= 0 {
		return
	}
	remaining := max(0, math.Floor(b.level))
	reset := time.Duration((b.limit - b.level) / b.limit * float64(time.Minute)).Round(time.Millisecond)
	h[names[0]] = []string{strconv.FormatFloat(b.limit, 'f', 0, 64)}
	h[names[1]] = []string{strconv.FormatFloat(remaining, 'f', 0, 64)}
	h[names[2]] = []string{reset.String()}
}
