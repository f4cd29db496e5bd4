package gateway

import (
	"context"
	"errors"
	"net"
	"net/http"

	"github.com/infergate/infergate/openai"
)

// codeShuttingDown is the OpenAI error code of a request refused or ended
// because the gateway is shutting down (503, type
// service_unavailable_error).
const codeShuttingDown = "shutting_down"

// shutdownRetryAfter is the Retry-After of a shutdown 503 (seconds): the
// client should retry at once, on another replica.
const shutdownRetryAfter = "1"

// errShuttingDown is the cause with which Abort cancels the requests in
// flight; handlers tell it from a client disconnect with context.Cause.
var errShuttingDown = errors.New("gateway shutting down")

// baseContextKey marks a request context derived from the gateway's base
// context (its value is the *Gateway).
type baseContextKey struct{}

// initShutdown creates the base context that Abort cancels (called by New).
func (g *Gateway) initShutdown() {
	ctx, abort := context.WithCancelCause(context.Background())
	g.base, g.abort = context.WithValue(ctx, baseContextKey{}, g), abort
}

// BaseContext is the base context of the gateway's requests, for
// http.Server.BaseContext (Server sets it): Abort cancels it, and with it
// every request in flight, at no cost per request. Requests served by a
// server without it are tied to Abort one by one (a few allocations each).
func (g *Gateway) BaseContext(net.Listener) context.Context { return g.base }

// Drain starts a shutdown: requests waiting in an admission queue are
// answered 503 shutting_down (with Retry-After) at once, and so is every
// request that reaches admission from now on (one arriving on a keep-alive
// connection, say), with Connection: close; /readyz answers 503. Requests
// already admitted keep running. Call it when the server stops accepting
// (before http.Server.Shutdown). Idempotent.
func (g *Gateway) Drain() {
	if !g.draining.CompareAndSwap(false, true) {
		return
	}
	// A reload that publishes pools after this load drains their gates
	// itself (commit), having read draining after its store.
	for _, p := range g.state.Load().pools {
		p.gate.drain()
	}
	for _, a := range g.oldGates() {
		a.drain()
	}
}

// Abort ends the requests still in flight (after Drain, when the shutdown
// grace has expired): each one's upstream request is canceled, and the
// client is told rather than cut off — a request still waiting for the
// engine's answer gets a 503 shutting_down JSON error, a stream already
// started gets an error event (code shutting_down) and data: [DONE], a
// non-streaming answer already started has its connection aborted (the
// client sees the truncation). The handlers write those final answers and
// return at once: give them a moment (a second or two) before closing the
// connections. Abort implies Drain. Idempotent.
func (g *Gateway) Abort() {
	g.Drain()
	g.abort(errShuttingDown)
}

// Draining reports whether Drain (or Abort) was called.
func (g *Gateway) Draining() bool { return g.draining.Load() }

// bindShutdown returns r with a context Abort cancels, and the function to
// call when the request ends; r itself when its context already derives
// from the gateway's base context (a server built by Server, or with
// BaseContext set).
func (g *Gateway) bindShutdown(r *http.Request) (*http.Request, func()) {
	if r.Context().Value(baseContextKey{}) == g {
		return r, nil
	}
	ctx, cancel := context.WithCancelCause(r.Context())
	stop := context.AfterFunc(g.base, func() { cancel(context.Cause(g.base)) })
	return r.WithContext(ctx), func() {
		stop()
		cancel(nil)
	}
}

// shuttingDown reports whether r's context was canceled by Abort (not by
// the client going away).
func shuttingDown(r *http.Request) bool {
	return errors.Is(context.Cause(r.Context()), errShuttingDown)
}

// shutdownError is the error a request refused or ended by the shutdown is
// answered with.
func shutdownError() *openai.Error {
	return openai.NewError(http.StatusServiceUnavailable,
		"The gateway is shutting down; retry the request (another instance will take it).", "", codeShuttingDown)
}

// failShuttingDown answers 503 shutting_down with Retry-After, closing the
// connection after it, and counts it.
func (g *Gateway) failShuttingDown(w http.ResponseWriter, rm *routeMetrics) {
	h := w.Header()
	h.Set("Retry-After", shutdownRetryAfter)
	h.Set("Connection", "close")
	g.fail(w, rm, shutdownError())
}

// canceled accounts a request whose context ended before any byte of its
// answer reached the client: a client that went away is counted 499; a
// request ended by Abort is answered 503 shutting_down.
func (g *Gateway) canceled(w http.ResponseWriter, r *http.Request, rm *routeMetrics) {
	if shuttingDown(r) {
		g.failShuttingDown(w, rm)
		return
	}
	g.count(w, rm, codeClientClosed)
}
