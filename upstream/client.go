// Package upstream is the gateway's HTTP/1.1 client for engines, kept in its
// own package because it replaces a standard piece (net/http's Transport)
// for speed: see README.md for the figure that justifies it and how to
// check it again. It also holds the abortable header waits (wait.go) the
// health checker uses to end the requests of an engine that froze.
package upstream

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Client is the gateway's HTTP/1.1 client for engines reached over
// plain http:// — the request path's one hop that is neither routing nor
// relaying, so it is kept lean: the request is written and the response read
// by the handler's own goroutine on a pooled keep-alive connection
// (net/http's Transport hands each request to a write goroutine and each
// response from a read goroutine per connection; profiling the proxy under
// load put ~15% of the gateway's CPU there). The response is parsed by
// net/http (http.ReadResponse: status line, headers, chunked and
// Content-Length framing), so only connection management is ours. Requests
// to https:// endpoints, and any request whose body length is unknown, go
// to the fallback transport (TLS, HTTP/2).
//
// Behaviour kept from the Transport it replaces (Options; the gateway's Config fields): dial timeout
// (connect_timeout), response header timeout (response_header_timeout), idle
// connections per host (max_idle_conns_per_host) closed after
// idle_conn_timeout, response headers bounded (MaxHeaderBytes), and
// the context cancels a request at once (a client that disconnects closes
// its upstream connection). A pooled connection is probed before reuse (one
// non-blocking MSG_PEEK recv): one the engine closed, or that holds bytes
// nobody asked for (a late 408), is dropped. A request whose write fails on
// a reused connection before any byte of it was sent is sent once more on a
// new connection, as net/http does (nothingWrittenError); once any byte is
// out, a failure is returned to the caller (retry.go decides), never resent
// here. An engine that answers before reading the whole body (413) has its
// answer relayed rather than the failed write's error.
type Client struct {
	dialer        net.Dialer
	fallback      http.RoundTripper
	maxIdle       int
	idleTimeout   time.Duration
	headerTimeout time.Duration
	allFallback   bool

	mu     sync.Mutex
	idle   map[string][]*upConn // per host:port, most recently used last
	nIdle  int
	reaper *time.Timer // armed while any connection is idle
	// closeIdle: CloseIdleConnections ran and no connection was dialled
	// since; connections that become idle are closed (as net/http does).
	closeIdle bool
}

// Options configures a Client; each field is the gateway Config field of the
// same name.
type Options struct {
	// ConnectTimeout bounds a dial (connect_timeout).
	ConnectTimeout time.Duration
	// ResponseHeaderTimeout bounds the wait for response headers after the
	// request is written (response_header_timeout; 0: none).
	ResponseHeaderTimeout time.Duration
	// IdleConnTimeout closes a pooled connection idle that long
	// (idle_conn_timeout).
	IdleConnTimeout time.Duration
	// MaxIdleConnsPerHost bounds the pool per host:port
	// (max_idle_conns_per_host).
	MaxIdleConnsPerHost int
	// AllFallback sends every request through the fallback transport
	// (net/http's), with the same deadlines and header waits: the
	// reference the hand-written path is measured and tested against
	// (the gateway's -tags stdtransport build; README.md).
	AllFallback bool
}

// New returns a client with the given options that sends what it does not
// handle itself (https://, bodies of unknown length) through fallback.
func New(cfg Options, fallback http.RoundTripper) *Client {
	return &Client{
		dialer:        net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second},
		fallback:      fallback,
		maxIdle:       cfg.MaxIdleConnsPerHost,
		idleTimeout:   cfg.IdleConnTimeout,
		headerTimeout: cfg.ResponseHeaderTimeout,
		allFallback:   cfg.AllFallback,
		idle:          map[string][]*upConn{},
	}
}

// upConn is one keep-alive connection to an engine.
type upConn struct {
	c      net.Conn
	key    string
	lr     limitedConnReader
	cw     countingConnWriter
	br     *bufio.Reader
	bw     *bufio.Writer
	idleAt time.Time
	reused bool
}

// newUpConn wraps a new connection to key with its 32 KiB buffers.
func newUpConn(c net.Conn, key string) *upConn {
	pc := &upConn{c: c, key: key}
	pc.lr.c, pc.cw.c = c, c
	pc.br = bufio.NewReaderSize(&pc.lr, 32<<10)
	pc.bw = bufio.NewWriterSize(&pc.cw, 32<<10)
	return pc
}

// countingConnWriter writes to a connection, counting the bytes the kernel
// took (a request none of whose bytes left can be resent).
type countingConnWriter struct {
	c       net.Conn
	written int64
}

func (w *countingConnWriter) Write(p []byte) (int, error) {
	n, err := w.c.Write(p)
	w.written += int64(n)
	return n, err
}

// setReadDeadline sets the connection's read deadline, keeping a
// cancellation that landed meanwhile: the context's AfterFunc poisons the
// deadline from another goroutine, and a later set would undo it.
func (pc *upConn) setReadDeadline(ctx context.Context, t time.Time) {
	_ = pc.c.SetReadDeadline(t)
	if ctx.Err() != nil {
		_ = pc.c.SetDeadline(aLongTimeAgo)
	}
}

// setWriteDeadline is setReadDeadline for writes.
func (pc *upConn) setWriteDeadline(ctx context.Context, t time.Time) {
	_ = pc.c.SetWriteDeadline(t)
	if ctx.Err() != nil {
		_ = pc.c.SetDeadline(aLongTimeAgo)
	}
}

// limitedConnReader reads from a connection, at most n bytes (the response
// header budget while headers are read; unlimited for the body).
type limitedConnReader struct {
	c net.Conn
	n int64
}

var errHeaderTooLarge = fmt.Errorf("upstream response headers larger than %d bytes", MaxHeaderBytes)

func (l *limitedConnReader) Read(p []byte) (int, error) {
	if l.n <= 0 {
		return 0, errHeaderTooLarge
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.c.Read(p)
	l.n -= int64(n)
	return n, err
}

// RoundTrip sends req and returns the engine's response, whose body the
// caller must read to EOF (the connection then returns to the pool) or
// close (the connection is then closed). Errors: the dial's *net.OpError
// (Op "dial"), a timeout (net.Error) when the response headers do not come
// within response_header_timeout, the context's error when it is done, else
// the connection's read or write error.
func (u *Client) RoundTrip(req *http.Request) (*http.Response, error) {
	return u.RoundTripBy(req, time.Time{}, nil)
}

// ReadDeadliner is a response body whose reads can be bounded: the bodies
// RoundTripBy returns. A read past the deadline fails with a timeout
// (net.Error); the zero time clears it.
type ReadDeadliner interface {
	SetReadDeadline(t time.Time) error
}

// RoundTripBy is RoundTrip with a read deadline by (zero: none) that
// bounds the response headers too (the earlier of by and
// response_header_timeout) and stays in force on the body until the
// caller moves it (the body is a ReadDeadliner): a stream's first event is
// due by it. Without by, the body's reads are unbounded until the caller
// sets a deadline. The fallback transport's bodies are bounded by a timer
// that cancels the request (watchedBody). w (nil: none) is the attempt's
// entry in its endpoint's header waits (wait.go): an abort ends the
// wait with ErrEndpointDown.
func (u *Client) RoundTripBy(req *http.Request, by time.Time, w *Wait) (*http.Response, error) {
	if u.allFallback || req.URL.Scheme != "http" || (req.Body != nil && req.Body != http.NoBody && req.ContentLength <= 0) {
		return u.watchedRoundTrip(req, by, w)
	}
	key := req.URL.Host
	if req.URL.Port() == "" {
		key = net.JoinHostPort(req.URL.Hostname(), "80")
	}
	ctx := req.Context()
	for try := 0; ; try++ {
		pc, err := u.get(ctx, key, try > 0)
		if err != nil {
			if req.Body != nil {
				req.Body.Close()
			}
			return nil, err
		}
		if try > 0 {
			if req.GetBody == nil {
				pc.c.Close()
				return nil, errors.New("upstream connection closed; request body cannot be resent")
			}
			if req.Body, err = req.GetBody(); err != nil {
				pc.c.Close()
				return nil, err
			}
		}
		resp, err := u.roundTrip(ctx, pc, req, by, w)
		if err == nil {
			return resp, nil
		}
		var st staleConnError
		if try == 0 && errors.As(err, &st) && ctx.Err() == nil {
			continue // nothing was sent: once more, on a new connection
		}
		if e := ctx.Err(); e != nil {
			return nil, e
		}
		return nil, err
	}
}

// probeIdle is peerClosed; tests replace it to reach the resend path.
var probeIdle = peerClosed

// staleConnError is a write failure on a reused connection before any byte
// of the request was sent: the engine had closed it.
type staleConnError struct{ err error }

func (e staleConnError) Error() string { return e.err.Error() }
func (e staleConnError) Unwrap() error { return e.err }

// roundTrip sends req on pc and reads the response headers; w (nil: none)
// is the attempt's entry in its endpoint's header waits (wait.go),
// armed for the write and the wait: aborted meanwhile, the connection is
// closed and the error is ErrEndpointDown.
func (u *Client) roundTrip(ctx context.Context, pc *upConn, req *http.Request, by time.Time, w *Wait) (*http.Response, error) {
	w.arm(pc.c, nil)
	resp, err := u.send(ctx, pc, req, by, w)
	if w.disarm() {
		if err == nil {
			pc.c.Close() // its deadlines are poisoned: never pooled
			resp.Body.Close()
		}
		return nil, ErrEndpointDown
	}
	return resp, err
}

func (u *Client) send(ctx context.Context, pc *upConn, req *http.Request, by time.Time, w *Wait) (*http.Response, error) {
	var stop func() bool
	if ctx.Done() != nil {
		c := pc.c
		stop = context.AfterFunc(ctx, func() { _ = c.SetDeadline(aLongTimeAgo) })
	}
	pc.cw.written = 0
	fail := func(err error) (*http.Response, error) {
		if stop != nil {
			stop()
		}
		pc.c.Close()
		return nil, err
	}
	// The header deadline bounds the request's write too: an engine that
	// stops reading (its socket buffers full of a large body) while its
	// health checks pass held the request, and its client, for ever.
	headerBy := u.headerDeadline(by)
	pc.setWriteDeadline(ctx, headerBy)
	w.repoison() // an abort that landed since arm
	if err := writeRequest(pc.bw, req); err != nil {
		var fe bodyFramingError
		switch {
		case errors.As(err, &fe) || pc.cw.written == 0:
			if pc.reused && pc.cw.written == 0 && fe == (bodyFramingError{}) && !IsTimeout(err) {
				return fail(staleConnError{err})
			}
			return fail(err) // nothing the engine could have answered
		}
		// An engine may answer (413, 400) and close before it has read the
		// whole body: prefer its answer to the write error, as net/http's
		// Transport does.
		if resp := earlyAnswer(ctx, pc, req); resp != nil {
			if stop != nil && !stop() {
				resp.Body.Close()
				return fail(ctx.Err()) // cancelled meanwhile
			}
			resp.Body = &upBody{u: u, pc: pc, ctx: ctx, body: resp.Body, close: true}
			return resp, nil
		}
		return fail(err)
	}
	pc.setWriteDeadline(ctx, time.Time{}) // the connection's next request sets its own
	pc.lr.n = MaxHeaderBytes
	// The header deadline is always set: a pooled connection may carry the
	// deadline its previous body was read under.
	pc.setReadDeadline(ctx, headerBy)
	w.repoison() // an abort that landed during the write
	var resp *http.Response
	for {
		var err error
		if resp, err = http.ReadResponse(pc.br, req); err != nil {
			return fail(err)
		}
		if !ValidStatus(resp.StatusCode) {
			return fail(fmt.Errorf("upstream answered an invalid status code %d", resp.StatusCode))
		}
		if resp.StatusCode >= 200 {
			break
		}
		if resp.StatusCode == http.StatusSwitchingProtocols {
			return fail(errors.New("upstream answered 101 Switching Protocols"))
		}
		// 1xx informational (103 Early Hints, an unasked 100 Continue):
		// the final answer follows.
	}
	pc.lr.n = math.MaxInt64
	if !headerBy.Equal(by) {
		pc.setReadDeadline(ctx, by) // the body's: by, or none
	}
	resp.Body = &upBody{u: u, pc: pc, ctx: ctx, body: resp.Body, stop: stop, close: resp.Close || req.Close}
	return resp, nil
}

// headerDeadline is the deadline of a request's write and its answer's
// headers: the earlier of by (zero: none) and response_header_timeout from
// now (zero when neither is set).
func (u *Client) headerDeadline(by time.Time) time.Time {
	if u.headerTimeout > 0 {
		if t := time.Now().Add(u.headerTimeout); by.IsZero() || t.Before(by) {
			return t
		}
	}
	return by
}

// ValidStatus reports whether code is an HTTP status code (100 to 599, RFC
// 9110 section 15). http.ReadResponse and net/http's HTTP/2 client accept
// any three digits (000 to 999) or any integer: an engine's status outside
// the range must not reach the client (net/http's server panics at
// WriteHeader of a code below 100) nor be taken for a 5xx.
func ValidStatus(code int) bool { return code >= 100 && code <= 599 }

// earlyAnswerWait bounds the wait for an answer after a failed write.
const earlyAnswerWait = time.Second

// earlyAnswer reads, within earlyAnswerWait, an answer the engine sent
// before a write of the request failed; nil if there is none.
func earlyAnswer(ctx context.Context, pc *upConn, req *http.Request) *http.Response {
	if ctx.Err() != nil {
		return nil
	}
	pc.lr.n = MaxHeaderBytes
	pc.setReadDeadline(ctx, time.Now().Add(earlyAnswerWait))
	resp, err := http.ReadResponse(pc.br, req)
	if err != nil || resp.StatusCode < 200 || !ValidStatus(resp.StatusCode) {
		return nil
	}
	pc.lr.n = math.MaxInt64
	pc.setReadDeadline(ctx, time.Time{})
	return resp // the connection is closed after it (the body may be partial)
}

// MaxHeaderBytes bounds an engine's response headers (bytes); more fails
// the round trip.
const MaxHeaderBytes = 1 << 20

// IsResponseTimeout reports whether err is a timeout waiting for the
// engine's answer (response header or read deadline), not a dial timeout.
func IsResponseTimeout(err error) bool {
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		return false
	}
	var op *net.OpError
	return !(errors.As(err, &op) && op.Op == "dial")
}

// IsDialError reports whether err is a failure to connect (refused, no
// route, dial timeout): the engine is not there.
func IsDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// IsTimeout reports whether err is a timeout (net.Error), a dial's included.
func IsTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// aLongTimeAgo is a deadline in the past: blocked reads and writes on the
// connection return at once.
var aLongTimeAgo = time.Unix(1, 0)

// writeRequest writes req in HTTP/1.1 (request line, Host, Content-Length —
// 0 for a POST, PUT or PATCH without a body —, Connection: close when
// req.Close, req.Header in map order, then exactly ContentLength bytes of
// body) and flushes. Header values have CR and LF replaced by spaces, as
// net/http's Header.Write does; a body longer or shorter than ContentLength
// is an error, never a second request on the wire.
func writeRequest(bw *bufio.Writer, req *http.Request) error {
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	bw.WriteString(method)
	bw.WriteByte(' ')
	bw.WriteString(req.URL.RequestURI())
	bw.WriteString(" HTTP/1.1\r\nHost: ")
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	bw.WriteString(host)
	bw.WriteString("\r\n")
	switch {
	case req.ContentLength > 0:
		bw.WriteString("Content-Length: ")
		var nb [20]byte
		bw.Write(strconv.AppendInt(nb[:0], req.ContentLength, 10))
		bw.WriteString("\r\n")
	case method == http.MethodPost || method == http.MethodPut || method == http.MethodPatch:
		bw.WriteString("Content-Length: 0\r\n")
	}
	if req.Close {
		bw.WriteString("Connection: close\r\n")
	}
	for k, vs := range req.Header {
		switch k {
		case "Host", "Content-Length", "Transfer-Encoding", "Connection", "Trailer":
			continue
		}
		for _, v := range vs {
			bw.WriteString(k)
			bw.WriteString(": ")
			if strings.ContainsAny(v, "\r\n") {
				v = strings.NewReplacer("\r", " ", "\n", " ").Replace(v)
			}
			bw.WriteString(v)
			bw.WriteString("\r\n")
		}
	}
	if _, ok := req.Header["User-Agent"]; !ok {
		bw.WriteString("User-Agent: infergate\r\n")
	}
	bw.WriteString("\r\n")
	if req.Body != nil && req.Body != http.NoBody {
		body := &readErrReader{r: req.Body}
		n, err := io.CopyN(bw, body, max(req.ContentLength, 0))
		switch {
		case body.err != nil:
			err = bodyFramingError{fmt.Errorf("upstream request body: %w", body.err)}
		case err == io.EOF:
			err = bodyFramingError{fmt.Errorf("upstream request body: %d bytes, Content-Length %d", n, req.ContentLength)}
		case err == nil:
			var one [1]byte
			if m, _ := io.ReadFull(req.Body, one[:]); m > 0 {
				err = bodyFramingError{fmt.Errorf("upstream request body longer than its Content-Length %d", req.ContentLength)}
			}
		}
		req.Body.Close()
		if err != nil {
			return err // a bodyFramingError, or the connection's write error
		}
	}
	return bw.Flush()
}

// readErrReader records the error of its reader other than io.EOF (to
// tell a body that failed to read from a connection that failed to write).
type readErrReader struct {
	r   io.Reader
	err error
}

func (r *readErrReader) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	if err != nil && err != io.EOF {
		r.err = err
	}
	return n, err
}

// bodyFramingError is a request body that does not match its
// Content-Length, or that failed to read: nothing of it reached the engine
// (the buffered request is dropped with the connection).
type bodyFramingError struct{ err error }

func (e bodyFramingError) Error() string { return e.err.Error() }
func (e bodyFramingError) Unwrap() error { return e.err }

// upBody is an engine's response body on a pooled connection: read to EOF,
// it gives the connection back; closed before, it closes it.
type upBody struct {
	u     *Client
	pc    *upConn
	ctx   context.Context // the request's
	body  io.ReadCloser
	stop  func() bool
	close bool // the engine asked to close the connection
	done  bool
}

// SetReadDeadline bounds the body's further reads (the connection's read
// deadline; a cancellation keeps its poisoned deadline). A body already
// read to its end or closed is left alone: its connection may serve
// another request.
func (b *upBody) SetReadDeadline(t time.Time) error {
	if b.done {
		return nil
	}
	b.pc.setReadDeadline(b.ctx, t)
	return nil
}

func (b *upBody) Read(p []byte) (int, error) {
	if b.done {
		return 0, io.EOF
	}
	n, err := b.body.Read(p)
	if err != nil {
		b.release(err == io.EOF)
	}
	return n, err
}

// Close closes the body. Closed before its end while its request is still
// wanted (an SSE stream is closed at [DONE], often just before the chunked
// body's last chunk arrives), the rest is read in the background — at most
// drainMaxBytes within drainTimeout, as net/http's server drains request
// bodies — so that the connection can be reused; otherwise, and when the
// request's context has ended, the connection is closed.
func (b *upBody) Close() error {
	if b.done {
		return nil
	}
	if b.stop != nil && !b.stop() {
		b.stop = nil
		b.release(false) // cancelled: the connection is closed at once
		return nil
	}
	b.stop = nil
	b.done = true
	if b.close {
		b.pc.c.Close()
		return nil
	}
	go b.drain()
	return nil
}

// Bounds of the background read of a body closed before its end.
const (
	drainMaxBytes = 64 << 10
	drainTimeout  = 250 * time.Millisecond
)

func (b *upBody) drain() {
	_ = b.pc.c.SetReadDeadline(time.Now().Add(drainTimeout))
	n, err := io.Copy(io.Discard, io.LimitReader(b.body, drainMaxBytes+1))
	if err != nil || n > drainMaxBytes || b.pc.br.Buffered() != 0 || b.pc.c.SetReadDeadline(time.Time{}) != nil {
		b.pc.c.Close()
		return
	}
	b.u.put(b.pc)
}

func (b *upBody) release(reuse bool) {
	b.done = true
	if b.stop != nil && !b.stop() {
		reuse = false // the context ended: the deadline is poisoned
	}
	if reuse && !b.close && b.pc.br.Buffered() == 0 {
		b.u.put(b.pc)
		return
	}
	b.pc.c.Close()
}

// watchedRoundTrip sends req through the fallback transport (TLS, HTTP/2)
// with the deadline semantics of RoundTripBy, which net/http's Transport
// has no per-request form of: a timer cancels the request's context when
// the deadline passes (the transport then closes the stream or
// connection), and the failure is reported as ErrTimeout. One
// context and one timer per request, on the path that pays for TLS.
func (u *Client) watchedRoundTrip(req *http.Request, by time.Time, w *Wait) (*http.Response, error) {
	parent := req.Context()
	ctx, cancel := context.WithCancel(parent)
	wb := &watchedBody{cancel: cancel}
	wb.timer = time.AfterFunc(time.Hour, wb.expire)
	// The header deadline bounds the request's write too (send): net/http's
	// ResponseHeaderTimeout starts only once the body is written, so an
	// engine that stopped reading held the request for ever.
	headerBy := u.headerDeadline(by)
	if headerBy.IsZero() {
		wb.timer.Stop()
	} else {
		wb.timer.Reset(time.Until(headerBy))
	}
	w.arm(nil, cancel)
	resp, err := u.fallback.RoundTrip(req.WithContext(ctx))
	if w.disarm() && parent.Err() == nil {
		wb.timer.Stop()
		if err == nil {
			_ = resp.Body.Close()
		}
		cancel()
		return nil, ErrEndpointDown
	}
	if err != nil {
		wb.timer.Stop()
		cancel()
		if wb.expired.Load() && parent.Err() == nil {
			return nil, ErrTimeout
		}
		return nil, err
	}
	if !ValidStatus(resp.StatusCode) {
		wb.timer.Stop()
		_ = resp.Body.Close()
		cancel()
		return nil, fmt.Errorf("upstream answered an invalid status code %d", resp.StatusCode)
	}
	if wb.expired.Load() && parent.Err() == nil {
		// The deadline canceled the request and the answer raced the
		// cancel (net/http's HTTP/2 client can return either): the engine
		// answered late, typically because the cancel ended its handler.
		_ = resp.Body.Close()
		cancel()
		return nil, ErrTimeout
	}
	switch {
	case by.IsZero():
		wb.timer.Stop() // the body's reads are unbounded until the caller sets a deadline
	case !headerBy.Equal(by):
		wb.timer.Reset(time.Until(by)) // the body's: by
	}
	if wb.expired.Load() && parent.Err() == nil { // the header deadline raced the answer
		_ = resp.Body.Close()
		cancel()
		return nil, ErrTimeout
	}
	wb.body, resp.Body = resp.Body, wb
	return resp, nil
}

// watchedBody is a fallback transport's response body under a read
// deadline kept by a timer (watchedRoundTrip).
type watchedBody struct {
	body    io.ReadCloser
	timer   *time.Timer
	cancel  context.CancelFunc
	expired atomic.Bool
}

func (b *watchedBody) expire() {
	b.expired.Store(true)
	b.cancel()
}

// Read reports any end of a body whose deadline passed as the timeout: the
// transport ends a canceled body with an error or, racing the close of its
// connection, a plain EOF.
func (b *watchedBody) Read(p []byte) (int, error) {
	n, err := b.body.Read(p)
	if err != nil && b.expired.Load() {
		err = ErrTimeout
	}
	return n, err
}

// SetReadDeadline re-arms the timer for t (zero: stops it). A deadline
// that has passed already ended the request.
func (b *watchedBody) SetReadDeadline(t time.Time) error {
	if t.IsZero() {
		b.timer.Stop()
	} else {
		b.timer.Reset(time.Until(t))
	}
	return nil
}

func (b *watchedBody) Close() error {
	b.timer.Stop()
	err := b.body.Close()
	b.cancel()
	return err
}

// ErrTimeout is a read of the fallback transport's answer past its
// deadline. It is a net.Error timeout, and errors.Is it
// os.ErrDeadlineExceeded, like a connection's read deadline.
var ErrTimeout error = upstreamTimeoutError{}

type upstreamTimeoutError struct{}

func (upstreamTimeoutError) Error() string   { return "upstream read deadline exceeded" }
func (upstreamTimeoutError) Timeout() bool   { return true }
func (upstreamTimeoutError) Temporary() bool { return true }
func (upstreamTimeoutError) Unwrap() error   { return os.ErrDeadlineExceeded }

// get returns an idle connection to key (the most recently used; stale or
// expired ones are closed on the way), or dials a new one (always with
// fresh).
func (u *Client) get(ctx context.Context, key string, fresh bool) (*upConn, error) {
	if !fresh {
		now := time.Now()
		for {
			u.mu.Lock()
			list := u.idle[key]
			if len(list) == 0 {
				u.mu.Unlock()
				break
			}
			pc := list[len(list)-1]
			list[len(list)-1] = nil
			u.idle[key] = list[:len(list)-1]
			u.nIdle--
			u.mu.Unlock()
			if (u.idleTimeout > 0 && now.Sub(pc.idleAt) > u.idleTimeout) || probeIdle(pc.c) {
				pc.c.Close()
				continue
			}
			pc.reused = true
			return pc, nil
		}
	}
	u.mu.Lock()
	u.closeIdle = false
	u.mu.Unlock()
	c, err := u.dialer.DialContext(ctx, "tcp", key)
	if err != nil {
		return nil, err
	}
	return newUpConn(c, key), nil
}

// put makes pc idle, or closes it when its host already keeps maxIdle.
func (u *Client) put(pc *upConn) {
	pc.idleAt = time.Now()
	u.mu.Lock()
	list := u.idle[pc.key]
	if u.closeIdle || (u.maxIdle > 0 && len(list) >= u.maxIdle) {
		u.mu.Unlock()
		pc.c.Close()
		return
	}
	u.idle[pc.key] = append(list, pc)
	u.nIdle++
	if u.reaper == nil && u.idleTimeout > 0 {
		u.reaper = time.AfterFunc(u.idleTimeout, u.reap)
	}
	u.mu.Unlock()
}

// reap closes connections idle longer than idleTimeout; it runs while any
// connection is idle.
func (u *Client) reap() {
	now := time.Now()
	var expired []*upConn
	next := u.idleTimeout // until the oldest remaining connection expires
	u.mu.Lock()
	for key, list := range u.idle {
		n := 0 // oldest first: expired ones form a prefix
		for n < len(list) && now.Sub(list[n].idleAt) > u.idleTimeout {
			n++
		}
		if n > 0 {
			expired = append(expired, list[:n]...)
			list = append(list[:0], list[n:]...)
			clear(list[len(list):cap(list)])
			u.idle[key] = list
			u.nIdle -= n
		}
		if len(list) > 0 {
			next = min(next, u.idleTimeout-now.Sub(list[0].idleAt))
		}
	}
	if u.nIdle > 0 {
		u.reaper.Reset(max(next, time.Millisecond))
	} else {
		u.reaper = nil
	}
	u.mu.Unlock()
	for _, pc := range expired {
		pc.c.Close()
	}
}

// CloseIdleConnections closes every idle connection (and the fallback's).
func (u *Client) CloseIdleConnections() {
	u.mu.Lock()
	var all []*upConn
	for key, list := range u.idle {
		all = append(all, list...)
		delete(u.idle, key)
	}
	u.nIdle = 0
	u.closeIdle = true
	if u.reaper != nil {
		u.reaper.Stop()
		u.reaper = nil
	}
	u.mu.Unlock()
	for _, pc := range all {
		pc.c.Close()
	}
	if ci, ok := u.fallback.(interface{ CloseIdleConnections() }); ok {
		ci.CloseIdleConnections()
	}
}
