//go:build !stdtransport

package gateway

// stdTransport is false: plain http:// engines are reached through the
// hand-written client (package upstream). Build with -tags stdtransport to
// send every request through net/http's Transport instead, as the overhead
// benchmark and the CI step that runs this package's tests against it do.
const stdTransport = false
