package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// ZMTP framing guard.
//
// go-zeromq/zmq4 v0.17.0 reads a peer's frames in a goroutine of its own
// (qreader.listen → Conn.read) and allocates each frame's body at the size
// the peer announces, up to 2^63-1 bytes (conn.go: body := make([]byte,
// size)); a forged size panics there (makeslice: len out of range) or
// exhausts memory, and no recover outside the library can catch it. It also
// appends frames to a message for as long as the peer sets MORE. ZeroMQ's
// NULL mechanism authenticates nothing, so any process that can reach the
// subscriber (a compromised engine, or anything that binds a dead engine's
// port) can do this.
//
// Instead of a fork, the subscriber dials through a transport of its own
// (registered with zmq4.RegisterTransport) whose connections parse the ZMTP
// 3.x framing (rfc.zeromq.org/spec/23, "Framing": a flags byte — MORE 0x01,
// LONG 0x02, COMMAND 0x04 — then a 1-byte or 8-byte big-endian size, then
// the body) as the library reads it. A frame header is read ahead and
// checked before any of it reaches the library, so an oversized frame fails
// the read with a *ZMTPLimitError before the library allocates; the
// connection then closes and the subscriber counts it, backs off and
// redials. A replace directive in go.mod would not hold for programs that
// import this package, a wrapped transport does. The upstream fix is in
// zmq4-maxmsgsize.patch.
//
// The guard also bounds the handshake: the greeting and the peer's first
// command (NULL's READY) must arrive within a timeout (the library reads them
// without a deadline, so a peer that accepts and stays silent would hold the
// dial for ever), and the connection closes when the socket's context ends.

// Defaults of the guard's bounds.
const (
	// DefaultMaxMessageBytes bounds one ZeroMQ message from an engine (the
	// sum of its frames' bodies; a command alone too), bytes. A vLLM batch is
	// one scheduler step's events: about 5 bytes per token of the blocks the
	// step filled, well under a megabyte at max_num_batched_tokens 131072.
	DefaultMaxMessageBytes = 8 << 20
	// DefaultHandshakeTimeout bounds the ZMTP greeting and security
	// handshake after a dial.
	DefaultHandshakeTimeout = 10 * time.Second
	// maxFrames bounds the frames of one message: the stream's messages
	// have 3 ([topic, seq, payload]; replay replies on a DEALER the same).
	maxFrames = 16
	// zmtpGreetingLen is the size of a ZMTP 3.x greeting.
	zmtpGreetingLen = 64
)

// ZMTP frame flags (ZMTP 3.x, "Framing").
const (
	zmtpMore    = 0x01
	zmtpLong    = 0x02
	zmtpCommand = 0x04
)

// ZMTPLimitError is the read error of a guarded connection whose peer sent
// a frame or message over the bounds. It is a net.Error (not a timeout), so
// the library treats the connection as closed.
type ZMTPLimitError struct {
	// What is "frame size", "message size" or "frames".
	What string
	// Got is the announced frame size (plus what the message held before),
	// or the frame count; Limit the bound.
	Got, Limit uint64
}

func (e *ZMTPLimitError) Error() string {
	return fmt.Sprintf("kv events: ZMTP %s %d over the limit %d", e.What, e.Got, e.Limit)
}

// Timeout implements net.Error.
func (e *ZMTPLimitError) Timeout() bool { return false }

// Temporary implements net.Error.
func (e *ZMTPLimitError) Temporary() bool { return false }

// zmtpLimits are the bounds of guarded connections dialled under a context
// (withZMTPLimits), and the counter of connections cut for exceeding them.
type zmtpLimits struct {
	maxMessage uint64        // bytes per message or command
	maxFrames  int           // frames per message
	handshake  time.Duration // greeting and first command
	exceeded   *atomic.Uint64
}

type zmtpLimitsKey struct{}

func withZMTPLimits(ctx context.Context, l zmtpLimits) context.Context {
	return context.WithValue(ctx, zmtpLimitsKey{}, l)
}

func zmtpLimitsOf(ctx context.Context) zmtpLimits {
	if l, ok := ctx.Value(zmtpLimitsKey{}).(zmtpLimits); ok {
		return l
	}
	return zmtpLimits{maxMessage: DefaultMaxMessageBytes, maxFrames: maxFrames, handshake: DefaultHandshakeTimeout}
}

// Transports the subscriber dials through: "tcp" and "ipc" with the guard.
// (inproc is in-process and stays as it is.)
var guardedTransports = map[string]string{"tcp": "guarded-tcp", "ipc": "guarded-ipc"}

var registerGuard = sync.OnceValue(func() error {
	for scheme, name := range guardedTransports {
		network := scheme
		if scheme == "ipc" {
			network = "unix"
		}
		if err := zmq4.RegisterTransport(name, zmtpGuardTransport{base: transport.New(network)}); err != nil {
			return fmt.Errorf("kv events: %w", err)
		}
	}
	return nil
})

// guardedEndpoint returns ep (tcp://host:port, ipc://path, inproc://name)
// with its transport replaced by the guarded one.
func guardedEndpoint(ep string) (string, error) {
	if err := registerGuard(); err != nil {
		return "", err
	}
	scheme, addr, _ := strings.Cut(ep, "://")
	if name, ok := guardedTransports[scheme]; ok {
		return name + "://" + addr, nil
	}
	return ep, nil
}

// zmtpGuardTransport is a zmq4 transport whose connections are guarded.
type zmtpGuardTransport struct{ base transport.Transport }

// Dial implements transport.Transport.
func (t zmtpGuardTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.base.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return newZMTPGuard(ctx, c, zmtpLimitsOf(ctx)), nil
}

// Listen implements transport.Transport. Listening sockets are not guarded
// (the gateway only dials).
func (t zmtpGuardTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	return t.base.Listen(ctx, addr)
}

// Addr implements transport.Transport.
func (t zmtpGuardTransport) Addr(ep string) (string, error) { return t.base.Addr(ep) }

// zmtpGuard is a net.Conn that checks the ZMTP framing it reads (see the
// comment at the top of this file). Reads must not be concurrent (the
// library reads a connection from one goroutine).
type zmtpGuard struct {
	net.Conn
	lim      zmtpLimits
	stop     func() bool // stops the close-on-context-done hook
	greeting int         // greeting bytes still to pass
	hdr      [9]byte
	pend     []byte // checked header bytes the library has not read yet
	body     uint64 // bytes of the current frame's body still to pass
	more     bool   // the current frame has MORE set
	msg      uint64 // body bytes of the current message so far
	frames   int    // frames of the current message so far
	// handshaking is set until the peer's first command (its READY) has
	// passed; the read deadline is set meanwhile.
	handshaking bool
	err         error // sticky: the limit error
}

func newZMTPGuard(ctx context.Context, c net.Conn, lim zmtpLimits) *zmtpGuard {
	g := &zmtpGuard{Conn: c, lim: lim, greeting: zmtpGreetingLen, handshaking: true}
	if lim.handshake > 0 {
		_ = c.SetReadDeadline(time.Now().Add(lim.handshake))
	}
	g.stop = context.AfterFunc(ctx, func() { _ = c.Close() })
	return g
}

// Close implements net.Conn.
func (g *zmtpGuard) Close() error {
	g.stop()
	return g.Conn.Close()
}

// Read implements net.Conn: it passes the greeting, then frame headers once
// checked, then frame bodies, never more than the current part.
func (g *zmtpGuard) Read(p []byte) (n int, err error) {
	if len(p) == 0 {
		return 0, nil
	}
	switch {
	case len(g.pend) > 0:
		n = copy(p, g.pend)
		g.pend = g.pend[n:]
		return n, nil
	case g.err != nil:
		return 0, g.err
	case g.greeting > 0:
		n, err = g.Conn.Read(p[:min(len(p), g.greeting)])
		g.greeting -= n
	case g.body > 0:
		n, err = g.Conn.Read(p[:min(uint64(len(p)), g.body)])
		g.body -= uint64(n)
		if g.body == 0 {
			g.frameDone()
		}
	default:
		if err = g.header(); err == nil {
			n = copy(p, g.pend)
			g.pend = g.pend[n:]
		}
	}
	if err != nil && g.handshaking {
		_ = g.Conn.Close() // the library leaves a failed handshake's connection open
	}
	return n, err
}

// header reads the next frame header into g.pend, checking it against the
// bounds first.
func (g *zmtpGuard) header() error {
	if _, err := io.ReadFull(g.Conn, g.hdr[:2]); err != nil {
		return noUnexpectedEOF(err)
	}
	flags, hl, size := g.hdr[0], 2, uint64(g.hdr[1])
	if flags&zmtpLong != 0 {
		if _, err := io.ReadFull(g.Conn, g.hdr[2:9]); err != nil {
			return noUnexpectedEOF(err)
		}
		hl, size = 9, binary.BigEndian.Uint64(g.hdr[1:9])
	}
	var lerr *ZMTPLimitError
	switch {
	case g.frames+1 > g.lim.maxFrames:
		lerr = &ZMTPLimitError{What: "frames", Got: uint64(g.frames + 1), Limit: uint64(g.lim.maxFrames)}
	case size > g.lim.maxMessage:
		lerr = &ZMTPLimitError{What: "frame size", Got: size, Limit: g.lim.maxMessage}
	case g.msg+size > g.lim.maxMessage:
		lerr = &ZMTPLimitError{What: "message size", Got: g.msg + size, Limit: g.lim.maxMessage}
	}
	if lerr != nil {
		g.err = lerr
		if g.lim.exceeded != nil {
			g.lim.exceeded.Add(1)
		}
		_ = g.Conn.Close()
		return lerr
	}
	g.frames++
	g.msg += size
	g.more = flags&zmtpMore != 0 && flags&zmtpCommand == 0
	g.body = size
	g.pend = g.hdr[:hl]
	if size == 0 {
		g.frameDone()
	}
	return nil
}

// frameDone ends the current frame (its header and body are passed).
func (g *zmtpGuard) frameDone() {
	if !g.more {
		g.msg, g.frames = 0, 0
	}
	if g.handshaking {
		// The first frame after the greeting is the peer's handshake
		// command (NULL: READY): the connection is established.
		g.handshaking = false
		_ = g.Conn.SetReadDeadline(time.Time{})
	}
}

// noUnexpectedEOF reports a connection that ended inside a frame header as
// io.EOF, which the library recognises as a closed connection.
func noUnexpectedEOF(err error) error {
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return io.EOF
	}
	return err
}
