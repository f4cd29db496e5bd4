package gateway

import "github.com/prometheus/client_golang/prometheus"

// The request body budget (max_body_bytes_in_flight): the bytes of request
// bodies being read, all requests together. max_body_bytes bounds one
// body, body_read_timeout how long it may take; neither bounds how many
// are read at once, and N clients that each sent part of a large body and
// stalled held N × what they sent (each buffer up to twice that: it
// doubles as bytes arrive). The bytes are charged as they arrive, not for
// the Content-Length announced (charged up front, a few clients announcing
// 16 MiB and sending nothing held the whole budget: kvstore's
// TestAPIBodyBudgetChargedAsSent measured it there), and given back when
// the read ends: whole, refused, timed out or abandoned. A read that
// would take the total past the limit is refused at once, never waited
// for: 503 (the gateway's memory is short, not this client's rate, which
// is what a 429 says) with Retry-After: 1 and code "overloaded", and the
// connection is closed (the rest of the body is not read).

// The held-body budget (max_body_bytes_held): the bytes of the request
// bodies read whole and held by requests in progress, all requests
// together, from the end of the read to the request's end (putExchange).
// The read budget above gives a body back once read, and admission
// (max_in_flight, max_queue per endpoint) counts requests, not bytes: with
// 1,024 requests admitted per endpoint and as many queued, each holding a
// body of up to max_body_bytes (16 MiB) and ~3 bytes of decoded request
// per body byte, a few clients held gigabytes (measured 2026-12-06: 16
// concurrent 15 MB bodies parked at a stalled engine, resident memory 2.5
// GB). A body that would take the total past the limit is refused at once,
// before it is decoded: 503 overloaded with Retry-After: 1, as the read
// budget's.

// codeBodyBudget is the OpenAI error code of a body refused by the budget.
const codeBodyBudget = "overloaded"

// initBodyBudget sets up g.bodies and registers its metrics.
func (g *Gateway) initBodyBudget(reg prometheus.Registerer) (err error) {
	g.bodies, err = newByteBudget(reg, g.cfg.MaxBodyBytesInFlight,
		"request_body_budget_refusals_total", "Requests refused (503) because the request bodies being read held max_body_bytes_in_flight.",
		"request_body_bytes_in_flight", "Bytes of request bodies being read, all requests together (bounded by max_body_bytes_in_flight).")
	if err != nil {
		return err
	}
	g.held, err = newByteBudget(reg, g.cfg.MaxBodyBytesHeld,
		"request_body_held_refusals_total", "Requests refused (503) because the request bodies held by requests in progress held max_body_bytes_held.",
		"request_body_bytes_held", "Bytes of request bodies held by requests in progress, all requests together (bounded by max_body_bytes_held).")
	return err
}
