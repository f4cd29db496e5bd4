//go:build !unix

package upstream

import "net"

// peerClosed cannot probe without a non-blocking peek here; a connection the
// engine closed is found when a request fails on it (and is sent again).
func peerClosed(net.Conn) bool { return false }
