package upstream

import (
	"context"
	"errors"
	"net"
	"sync"
)

// Aborting the requests that wait on an engine that stopped answering.
//
// A non-streaming answer's response headers come when the whole completion
// is done, so the only bound on that wait is response_header_timeout
// (10 minutes by default: a long generation is legitimate). An engine that
// is frozen (SIGSTOPped, a wedged event loop) still has its kernel accept
// connections and take requests, and nothing answers them: without more,
// its non-streaming clients waited the whole response_header_timeout. The
// health checker does notice (its probe times out): after
// health_check_abort_after consecutive failed probes every attempt still
// waiting for the endpoint's response headers is aborted — its connection
// is closed, as a client that hangs up closes it, which makes a live vLLM
// abort the request — and retried elsewhere like any failure before the
// first byte (nothing reached the client). Streams are covered by the same
// mechanism until their headers, and by first_event_timeout and
// stream_idle_timeout after them.
//
// An attempt that began waiting after a failed probe is aborted by the
// next one (each failed probe past the threshold aborts the waiters of the
// moment), so none waits longer than about health_check_abort_after ×
// (health_check_interval + health_check_timeout) on a frozen engine.

// Wait is one attempt waiting for an endpoint's response headers
// (it lives in the pooled exchange: no allocation). Its fields are guarded
// by its list's mutex.
type Wait struct {
	// list is the endpoint's waiters, set by the attempt before the round
	// trip (nil: not abortable, as in benchmarks with their own transport).
	list       *Waits
	prev, next *Wait
	linked     bool
	// conn is the upstream connection the attempt waits on
	// (Client), cancel the fallback transport's request context.
	conn   net.Conn
	cancel context.CancelFunc
	// aborted is set by AbortAll while the attempt waited.
	aborted bool
}

// Waits is an endpoint's list of attempts waiting for response
// headers: one lock and two pointer writes per attempt.
type Waits struct {
	mu   sync.Mutex
	head *Wait
}

// ErrEndpointDown is the round-trip error of an attempt aborted by
// AbortAll: the endpoint failed its health checks while it waited.
var ErrEndpointDown = errors.New("the endpoint failed its health checks while the request waited for its response headers")

// On makes w an entry of l for the round trips it is passed to (nil: w is
// not abortable). The caller sets it before RoundTripBy and clears it after.
func (w *Wait) On(l *Waits) { w.list = l }

// arm records that w waits on conn or, for the fallback transport, on a
// request that cancel ends. A nil w or one without a list is a no-op.
func (w *Wait) arm(conn net.Conn, cancel context.CancelFunc) {
	if w == nil || w.list == nil {
		return
	}
	l := w.list
	l.mu.Lock()
	w.conn, w.cancel, w.aborted = conn, cancel, false
	if !w.linked {
		w.prev, w.next = nil, l.head
		if l.head != nil {
			l.head.prev = w
		}
		l.head, w.linked = w, true
	}
	l.mu.Unlock()
}

// repoison poisons w's connection again if it was aborted: the round trip
// sets the header read deadline after the write, which would undo an
// abort that landed during it.
func (w *Wait) repoison() {
	if w == nil || w.list == nil {
		return
	}
	w.list.mu.Lock()
	if w.aborted && w.conn != nil {
		_ = w.conn.SetDeadline(aLongTimeAgo)
	}
	w.list.mu.Unlock()
}

// disarm ends the wait (headers arrived, or the round trip failed) and
// reports whether AbortAll aborted it meanwhile. Idempotent.
func (w *Wait) disarm() (aborted bool) {
	if w == nil || w.list == nil {
		return false
	}
	l := w.list
	l.mu.Lock()
	if w.linked {
		if w.prev != nil {
			w.prev.next = w.next
		} else {
			l.head = w.next
		}
		if w.next != nil {
			w.next.prev = w.prev
		}
		w.prev, w.next, w.linked = nil, nil, false
	}
	aborted = w.aborted
	w.conn, w.cancel, w.aborted = nil, nil, false
	l.mu.Unlock()
	return aborted
}

// AbortAll aborts every attempt waiting on the list: a past deadline on
// its connection (the read of the response headers fails at once) or the
// cancel of its fallback request. It returns how many it aborted.
func (l *Waits) AbortAll() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for w := l.head; w != nil; w = w.next {
		if w.aborted {
			continue
		}
		w.aborted = true
		if w.conn != nil {
			_ = w.conn.SetDeadline(aLongTimeAgo)
		}
		if w.cancel != nil {
			w.cancel()
		}
		n++
	}
	return n
}
