//go:build unix

package upstream

import (
	"net"
	"syscall"
)

// peerClosed reports whether the engine closed (or reset) an idle
// connection, by one non-blocking MSG_PEEK recv: EOF, an error, or bytes
// nobody asked for all mean the connection cannot be reused.
func peerClosed(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	closed := false
	var b [1]byte
	err = raw.Read(func(fd uintptr) bool {
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		closed = n > 0 || err == nil || (err != syscall.EAGAIN && err != syscall.EWOULDBLOCK)
		return true
	})
	return closed || err != nil
}
