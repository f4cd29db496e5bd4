// Package fleet is the gateway's view of its engines: engine kinds, metric
// scraping, and the application of their KV events to the gateway's index.
//
// An engine's [Kind] says what it can tell the gateway: its health path, the
// metrics page it serves and which load signals that page carries, and where
// it reports cached prompt tokens. [ParseMetrics] turns one metrics page into
// a [Load]; a [Scraper] polls the pages of many endpoints and keeps the latest
// Load of each. A [KVEventApplier] keeps one engine's blocks in a
// prefix.PreciseIndex from the batches a kvevents.Subscriber delivers. See
// README.md for the per-engine tables and their sources.
package fleet
