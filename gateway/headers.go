package gateway

import (
	"net"
	"net/http"
	"net/textproto"
	"strings"
)

// isHopByHop reports whether canonical header key k is a hop-by-hop header
// (RFC 9110 §7.6.1; Proxy-Connection is the non-standard one curl sends).
func isHopByHop(k string) bool {
	switch k {
	case "Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return true
	}
	return strings.HasPrefix(k, "Proxy-")
}

// dropUpstream reports whether client header k is not forwarded to an
// engine: hop-by-hop headers, credentials meant for the gateway
// (Authorization, X-Api-Key, Api-Key, Cookie), headers the gateway sets
// itself (Host, Content-Length, X-Request-Id, X-Forwarded-For), the
// gateway's internal namespace X-Infergate-* (so a client cannot forge what
// the gateway may tell engines), the gateway's own admission header
// X-Priority (capped by the key's max_priority inside the gateway; an
// engine or second-tier router must not see the uncapped value), and
// Accept-Encoding and Expect (the gateway
// parses the engine's response as it streams, so it asks for identity
// encoding, and it holds the whole body already). The other forwarding
// headers are removed at the edge unless the peer is a trusted proxy
// (scrubForwarding). X-Session-Id is kept: it is the client's own
// conversation id, no credential, and a second-tier router or an engine
// with session-aware caching may use it.
func dropUpstream(k string) bool {
	switch k {
	case "Authorization", "X-Api-Key", "Api-Key", "Cookie", "Host", "Content-Length", "Accept-Encoding", "Expect",
		"X-Request-Id", "X-Forwarded-For", PriorityHeader:
		return true
	}
	return isHopByHop(k) || strings.HasPrefix(k, "X-Infergate-")
}

// isForwarding reports whether canonical header key k says where a request
// came from: X-Forwarded-*, Forwarded (RFC 7239) and X-Real-Ip.
func isForwarding(k string) bool {
	return strings.HasPrefix(k, "X-Forwarded-") || k == "Forwarded" || k == "X-Real-Ip"
}

// scrubForwarding makes the request's forwarding headers the gateway's own:
// from a peer that is not a trusted proxy every forwarding header the
// client sent is removed (upstreamHeader then sets X-Forwarded-For to the
// peer alone); X-Forwarded-Proto is set to the scheme the client used
// unless a trusted proxy sent one.
func scrubForwarding(h http.Header, trusted, https bool) {
	if !trusted {
		for k := range h {
			if isForwarding(k) {
				delete(h, k)
			}
		}
	}
	if _, ok := h["X-Forwarded-Proto"]; !ok {
		if https {
			h["X-Forwarded-Proto"] = protoHTTPS
		} else {
			h["X-Forwarded-Proto"] = protoHTTP
		}
	}
}

// Shared X-Forwarded-Proto values (header value slices are never mutated in
// place; Add would copy).
var (
	protoHTTP  = []string{"http"}
	protoHTTPS = []string{"https"}
)

// listedInConnection reports whether k is named by one of the Connection
// header values conn (case-insensitively).
func listedInConnection(conn []string, k string) bool {
	for _, v := range conn {
		for f := range strings.SplitSeq(v, ",") {
			if f = textproto.TrimString(f); f != "" && strings.EqualFold(f, k) {
				return true
			}
		}
	}
	return false
}

// contentTypeJSON is a shared header value: never modified.
var contentTypeJSON = []string{"application/json"}

// upstreamHeader returns the headers sent to the engine, in out (cleared
// first; made when nil, so a pooled map is reused): the client's end-to-end
// headers (value slices shared, not copied: nothing mutates them),
// X-Request-Id (the one-element requestID), X-Forwarded-For with the
// client's address appended, and Content-Type application/json if the
// client sent none.
func upstreamHeader(out, in http.Header, requestID []string, remoteAddr string) http.Header {
	if out == nil {
		out = make(http.Header, len(in)+3)
	}
	clear(out)
	conn := in["Connection"]
	for k, vs := range in {
		if dropUpstream(k) || (conn != nil && listedInConnection(conn, k)) {
			continue
		}
		out[k] = vs
	}
	out["X-Request-Id"] = requestID
	if ip, _, err := net.SplitHostPort(remoteAddr); err == nil {
		if prior := in["X-Forwarded-For"]; len(prior) > 0 {
			ip = strings.Join(prior, ", ") + ", " + ip
		}
		out["X-Forwarded-For"] = []string{ip}
	}
	if _, ok := out["Content-Type"]; !ok {
		out["Content-Type"] = contentTypeJSON
	}
	return out
}

// dropDownstream reports whether an engine's response header k (canonical)
// is not relayed to the client because it speaks for the gateway's origin
// or instructs a proxy in front of it, neither of which an engine may do
// (a deny-list: engines' own informational headers, such as TGI's
// X-Compute-Time or vLLM's timing headers, pass):
//   - X-Infergate-*: the gateway's own namespace (X-Infergate-Attempts is
//     the gateway's count; an engine must not forge it);
//   - Set-Cookie, Set-Cookie2: state on the gateway's origin;
//   - Location, Content-Location, Refresh: redirects and resource
//     identities in the engine's URL space (leaking internal hosts, or an
//     open redirect through the gateway);
//   - Alt-Svc, Strict-Transport-Security, Public-Key-Pins: the transport
//     policy of the gateway's origin;
//   - Access-Control-*, Timing-Allow-Origin: its cross-origin policy;
//   - X-Accel-*, X-Sendfile: control headers an nginx (or Apache) in front
//     obeys (X-Accel-Redirect serves an internal location); the gateway
//     sets X-Accel-Buffering on streams itself;
//   - Server, Date: the engine's software and clock (net/http sets the
//     gateway's Date; nginx hides both by default as well);
//   - X-Request-Id: the gateway sets it (vLLM echoes it).
func dropDownstream(k string) bool {
	switch k {
	case "Set-Cookie", "Set-Cookie2", "Location", "Content-Location", "Refresh",
		"Alt-Svc", "Strict-Transport-Security", "Public-Key-Pins", "Timing-Allow-Origin",
		"X-Sendfile", "Server", "Date", "X-Request-Id":
		return true
	}
	return strings.HasPrefix(k, "X-Infergate-") || strings.HasPrefix(k, "Access-Control-") ||
		strings.HasPrefix(k, "X-Accel-")
}

// copyResponseHeader copies the engine's end-to-end response headers into
// dst, leaving out hop-by-hop headers, those the Connection header names,
// those dropDownstream names, Content-Length and Content-Encoding when the
// body is re-framed (streaming: the gateway writes the events it parsed)
// and X-Ratelimit-* headers the gateway set itself (the key's limits, not
// the engine's).
func copyResponseHeader(dst, src http.Header, keepLength bool) {
	conn := src["Connection"]
	for k, vs := range src {
		if isHopByHop(k) || dropDownstream(k) || (!keepLength && (k == "Content-Length" || k == "Content-Encoding")) ||
			(conn != nil && listedInConnection(conn, k)) {
			continue
		}
		if _, own := dst[k]; own && strings.HasPrefix(k, "X-Ratelimit-") {
			continue
		}
		if prior, ok := dst[k]; ok {
			dst[k] = append(prior, vs...)
		} else {
			dst[k] = vs // shared: src is the engine's answer, not kept or modified
		}
	}
}

// saneRequestID reports whether a client-supplied X-Request-Id can be kept:
// 1 to 128 characters of [A-Za-z0-9._:/+=-] (UUIDs, hex, base64 and
// "prefix-id" tokens pass; anything that could break logs or headers does
// not).
func saneRequestID(id string) bool {
	if len(id) == 0 || len(id) > 128 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case c == '.' || c == '_' || c == ':' || c == '/' || c == '+' || c == '=' || c == '-':
		default:
			return false
		}
	}
	return true
}
