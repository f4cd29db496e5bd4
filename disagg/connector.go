package disagg

import (
	"fmt"
	"strings"
)

// Connector names a P/D hand-off protocol (the gateway's pd.connector).
type Connector string

// The connectors.
const (
	NIXL     Connector = "nixl"
	Mooncake Connector = "mooncake"
	SGLang   Connector = "sglang"
	LLMD     Connector = "llm-d"
)

// Connectors lists the connectors, in documentation order.
func Connectors() []Connector { return []Connector{NIXL, Mooncake, SGLang, LLMD} }

// ParseConnector parses a connector name ("" is NIXL, the default).
func ParseConnector(s string) (Connector, error) {
	switch c := Connector(strings.ToLower(strings.TrimSpace(s))); c {
	case "":
		return NIXL, nil
	case NIXL, Mooncake, SGLang, LLMD:
		return c, nil
	}
	return "", fmt.Errorf("unknown P/D connector %q (want nixl, mooncake, sglang or llm-d)", s)
}

// Concurrent reports whether the connector sends P and D at once (Mooncake,
// SGLang): a failed D is retried by running both legs again.
func (c Connector) Concurrent() bool { return c == Mooncake || c == SGLang }

// Bootstraps reports whether the connector needs P's bootstrap port
// (the endpoint's bootstrap_port).
func (c Connector) Bootstraps() bool { return c == Mooncake || c == SGLang }

// DefaultBootstrapPort is SGLang's disaggregation bootstrap port and vLLM's
// VLLM_MOONCAKE_BOOTSTRAP_PORT default.
const DefaultBootstrapPort = 8998

// PrefillerHeader is the request header with which llm-d's scheduler tells
// the decode pod's routing sidecar which prefill pod to use (host:port).
const PrefillerHeader = "x-prefiller-host-port"

// DataParallelRankHeader carries the data-parallel rank to a Mooncake P.
const DataParallelRankHeader = "X-data-parallel-rank"
