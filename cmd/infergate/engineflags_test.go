package main

import (
	"strings"
	"testing"

	"github.com/infergate/infergate/kvevents"
)

// TestParseKVEventsVLLMSchema: --kv-events-config takes vLLM's own JSON,
// every field of vllm/config/kv_events.py (publisher, tier_scoped_clear_events
// included), and refuses what vLLM's pydantic config refuses.
func TestParseKVEventsVLLMSchema(t *testing.T) {
	c, err := parseKVEvents(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
		"replay_endpoint": "tcp://*:5558", "buffer_steps": 500, "hwm": 1000, "max_queue_size": 2000,
		"topic": "kv@pod@m", "tier_scoped_clear_events": true}`)
	if err != nil {
		t.Fatal(err)
	}
	want := kvevents.PublisherConfig{Enable: true, Publisher: "zmq", Endpoint: "tcp://*:5557", ReplayEndpoint: "tcp://*:5558",
		BufferSteps: 500, HWM: 1000, MaxQueueSize: 2000, Topic: "kv@pod@m", TierScopedClearEvents: true}
	if c != want || !c.Publishes() {
		t.Fatalf("got %+v, want %+v", c, want)
	}
	for in, publishes := range map[string]bool{
		`{"enable_kv_cache_events": true}`:                      true,  // publisher defaults to zmq
		`{"enable_kv_cache_events": true, "publisher": "null"}`: false, // recorded, published nowhere
		`{"enable_kv_cache_events": false, "publisher": "zmq"}`: false,
		`{}`: false,
	} {
		c, err := parseKVEvents(in)
		if err != nil || c.Publishes() != publishes {
			t.Errorf("%s: %+v, %v; want publishes=%v", in, c, err, publishes)
		}
	}
	for in, msg := range map[string]string{
		`{"enable_kv_cache_events": true, "publisher": "kafka"}`:  "publisher",
		`{"publisher": "kafka"}`:                                  "publisher",
		`{"enable_kv_cache_events": true, "endpoint": "udp://x"}`: "unsupported transport",
		`{"enable_kv_cache_events": true, "nope": 1}`:             "unknown field",
		`{"enable_kv_cache_events": true} {}`:                     "after the JSON object",
	} {
		if _, err := parseKVEvents(in); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("%s: %v, want an error containing %q", in, err, msg)
		}
	}
}
