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
// (Authorization, Cookie), headers the gateway sets itself (Host,
// Content-Length, X-Request-Id, X-Forwarded-For) and Accept-Encoding and
// Expect (the gateway parses the engine's response as it streams, so it asks
// for identity encoding, and it holds the whole body already).
func dropUpstream(k string) bool {
	switch k {
	case "Authorization", "Cookie", "Host", "Content-Length", "Accept-Encoding", "Expect",
		"X-Request-Id", "X-Forwarded-For":
		return true
	}
	return isHopByHop(k)
}

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

// upstreamHeader returns the headers sent to the engine: the client's
// end-to-end headers (value slices shared, not copied: nothing mutates
// them), X-Request-Id, X-Forwarded-For with the client's address appended,
// and Content-Type application/json if the client sent none.
func upstreamHeader(in http.Header, requestID, remoteAddr string) http.Header {
	out := make(http.Header, len(in)+3)
	conn := in["Connection"]
	for k, vs := range in {
		if dropUpstream(k) || (conn != nil && listedInConnection(conn, k)) {
			continue
		}
		out[k] = vs
	}
	out["X-Request-Id"] = []string{requestID}
	if ip, _, err := net.SplitHostPort(remoteAddr); err == nil {
		if prior := in["X-Forwarded-For"]; len(prior) > 0 {
			ip = strings.Join(prior, ", ") + ", " + ip
		}
		out["X-Forwarded-For"] = []string{ip}
	}
	if _, ok := out["Content-Type"]; !ok {
		out["Content-Type"] = []string{"application/json"}
	}
	return out
}

// copyResponseHeader copies the engine's end-to-end response headers into
// dst, leaving out hop-by-hop headers, those the Connection header names,
// X-Request-Id (the gateway sets it; vLLM echoes it) and Content-Length when
// the body is re-framed (streaming).
func copyResponseHeader(dst, src http.Header, keepLength bool) {
	conn := src["Connection"]
	for k, vs := range src {
		if isHopByHop(k) || k == "X-Request-Id" || (!keepLength && k == "Content-Length") ||
			(conn != nil && listedInConnection(conn, k)) {
			continue
		}
		dst[k] = append(dst[k], vs...)
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
