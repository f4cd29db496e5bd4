// Package kvevents speaks vLLM's KV-cache events (docs/PROTOCOLS.md §1;
// vllm/distributed/kv_events.py): an engine publishes what its prefix cache
// stores and evicts, a router subscribes and indexes it.
//
//	Event, Batch       the msgspec structs (BlockStored, BlockRemoved,
//	                   AllBlocksCleared, TierBlocksCleared; KVEventBatch)
//	AppendBatch        Events → one msgpack payload (array or map encoding)
//	DecodeBatch        one msgpack payload → Batch (both encodings, bounded)
//	Publisher          PUB socket + replay ROUTER, like vLLM's ZmqEventPublisher
//	Subscriber         SUB socket per engine: sequence numbers, gaps, replay
//	                   over the engine's ROUTER, reconnects, behind a ZMTP
//	                   framing guard (zmtpguard.go)
//
// The simulated engine (package sim) records its events as Event values
// (package kvevent, which links no transport) and its HTTP server (package
// simserver) publishes them with a Publisher; the gateway follows each engine with a
// Subscriber whose Handler is a fleet.KVEventApplier feeding its
// prefix.PreciseIndex. See README.md for the bounds.
package kvevents
