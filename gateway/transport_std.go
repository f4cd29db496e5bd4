//go:build stdtransport

package gateway

// stdTransport is true in the -tags stdtransport build: every upstream
// request goes through net/http's Transport (upstream.Options.AllFallback).
const stdTransport = true
