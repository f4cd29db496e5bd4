package upstream

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/internal/polltest"
)

// upstreamTestConfig is the upstream client's configuration in these tests.
func upstreamTestConfig() Options {
	return Options{ConnectTimeout: 2 * time.Second, ResponseHeaderTimeout: 5 * time.Second,
		IdleConnTimeout: time.Minute, MaxIdleConnsPerHost: 16}
}

func newTestUpstream(t *testing.T, cfg Options) *Client {
	t.Helper()
	u := New(cfg, http.DefaultTransport)
	t.Cleanup(u.CloseIdleConnections)
	return u
}

func postTo(t *testing.T, ctx context.Context, url, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	return req
}

// countingServer is an httptest server that counts the connections it
// accepted and echoes each request's method, URI, a header and body.
func countingServer(t *testing.T, h http.HandlerFunc) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var conns atomic.Int64
	if h == nil {
		h = func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			fmt.Fprintf(w, "%s %s %s %s len=%d", r.Method, r.URL.RequestURI(), r.Header.Get("X-Test"), b, r.ContentLength)
		}
	}
	s := httptest.NewUnstartedServer(h)
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			conns.Add(1)
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s, &conns
}

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return string(b)
}

func TestUpstreamReusesConnections(t *testing.T) {
	s, conns := countingServer(t, nil)
	u := newTestUpstream(t, upstreamTestConfig())
	for i := range 20 {
		req := postTo(t, context.Background(), s.URL+"/v1/completions?x=1", fmt.Sprintf(`{"n":%d}`, i))
		req.Header.Set("X-Test", "a\r\nInjected: yes") // CR LF cannot split headers
		resp, err := u.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf(`POST /v1/completions?x=1 a  Injected: yes {"n":%d} len=%d`, i, len(fmt.Sprintf(`{"n":%d}`, i)))
		if got := readAll(t, resp); got != want {
			t.Fatalf("answer %q, want %q", got, want)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("%d connections for 20 sequential requests, want 1", n)
	}
}

func TestUpstreamStreamsChunkedBodies(t *testing.T) {
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			fmt.Fprintf(w, "data: %d\n\n", i)
			w.(http.Flusher).Flush()
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
	u := newTestUpstream(t, upstreamTestConfig())
	for range 5 {
		resp, err := u.RoundTrip(postTo(t, context.Background(), s.URL, "{}"))
		if err != nil {
			t.Fatal(err)
		}
		if got := readAll(t, resp); got != "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n" {
			t.Fatalf("body %q", got)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("%d connections, want 1", n)
	}
}

// A body closed before its end (a relay stops at [DONE]) is drained in the
// background and its connection reused.
func TestUpstreamDrainsBodyClosedEarly(t *testing.T) {
	release := make(chan struct{})
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "data: [DONE]\n\n")
		w.(http.Flusher).Flush()
		<-release // the final chunk comes after the client closed the body
	})
	u := newTestUpstream(t, upstreamTestConfig())
	for range 3 {
		resp, err := u.RoundTrip(postTo(t, context.Background(), s.URL, "{}"))
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 14)
		if _, err := io.ReadFull(resp.Body, buf); err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		release <- struct{}{}
		waitFor(t, "the drained connection back in the pool", func() bool { return idleCount(u) == 1 })
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("%d connections, want 1", n)
	}
}

// A body closed early whose rest does not come within drainTimeout costs
// its connection, not a goroutine.
func TestUpstreamDrainGivesUp(t *testing.T) {
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "data: x\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-done:
		case <-r.Context().Done():
		}
	})
	u := newTestUpstream(t, upstreamTestConfig())
	resp, err := u.RoundTrip(postTo(t, context.Background(), s.URL, "{}"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	time.Sleep(drainTimeout + 100*time.Millisecond)
	if n := idleCount(u); n != 0 {
		t.Fatalf("%d idle connections, want 0", n)
	}
}

func idleCount(u *Client) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.nIdle
}

// rawServer accepts connections on loopback and hands each to serve.
func rawServer(t *testing.T, serve func(c net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { defer c.Close(); serve(c) })
		}
	})
	return "http://" + ln.Addr().String()
}

// readRequest reads one request from c (nil at EOF).
func readRawRequest(br *bufio.Reader) *http.Request {
	req, err := http.ReadRequest(br)
	if err != nil {
		return nil
	}
	_, _ = io.Copy(io.Discard, req.Body)
	return req
}

// oneAnswerPerConnection serves "ok" to one request per connection and
// closes it without saying so (with a reset when reset), counting the
// connections it accepted.
func oneAnswerPerConnection(t *testing.T, reset bool) (string, *atomic.Int64) {
	var accepted atomic.Int64
	url := rawServer(t, func(c net.Conn) {
		accepted.Add(1)
		if readRawRequest(bufio.NewReader(c)) == nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		if reset {
			c.(*net.TCPConn).SetLinger(0)
		}
	})
	return url, &accepted
}

// sendOK sends n requests to url one after another, pause before each,
// and checks each is answered "ok".
func sendOK(t *testing.T, u *Client, url string, n int, pause time.Duration) {
	t.Helper()
	for i := range n {
		time.Sleep(pause)
		resp, err := u.RoundTrip(postTo(t, context.Background(), url, "{}"))
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if got := readAll(t, resp); got != "ok" {
			t.Fatalf("request %d: body %q", i, got)
		}
	}
}

// withoutProbe turns the idle-connection probe off for the test (to reach
// the race it cannot close).
func withoutProbe(t *testing.T) {
	probeIdle = func(net.Conn) bool { return false }
	t.Cleanup(func() { probeIdle = peerClosed })
}

// An engine that closes a keep-alive connection after each answer, without
// saying so: the probe finds each closed before reuse and the next request
// goes out on a new connection.
func TestUpstreamClosedIdleConnectionProbed(t *testing.T) {
	url, accepted := oneAnswerPerConnection(t, false)
	sendOK(t, newTestUpstream(t, upstreamTestConfig()), url, 6, 20*time.Millisecond) // the close has landed
	if n := accepted.Load(); n != 6 {
		t.Fatalf("%d connections, want 6", n)
	}
}

// Without the probe (the race it cannot close), a request whose write fails
// on a reused connection before any byte left (the engine reset it) is sent
// once more on a new connection.
func TestUpstreamResendWhenNothingWritten(t *testing.T) {
	withoutProbe(t)
	url, accepted := oneAnswerPerConnection(t, true)
	sendOK(t, newTestUpstream(t, upstreamTestConfig()), url, 4, 50*time.Millisecond) // the reset has landed
	if n := accepted.Load(); n != 4 {
		t.Fatalf("%d connections, want 4", n)
	}
}

// A request fully written on a reused connection that the engine then drops
// without an answer (it crashed while generating) is not sent again here: the
// error goes to the caller, whose retry policy decides (net/http does the
// same for a POST).
func TestUpstreamNoResendAfterWrite(t *testing.T) {
	withoutProbe(t)
	var received atomic.Int64
	url := rawServer(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			req := readRawRequest(br)
			if req == nil {
				return
			}
			if req.URL.Path == "/generate" {
				received.Add(1)
				time.Sleep(100 * time.Millisecond)
				return // dies without an answer
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	u := newTestUpstream(t, upstreamTestConfig())
	resp, err := u.RoundTrip(postTo(t, context.Background(), url+"/warm", "{}"))
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if resp, err = u.RoundTrip(postTo(t, context.Background(), url+"/generate", `{"prompt":"x"}`)); err == nil {
		readAll(t, resp)
		t.Fatal("no error for a request the engine dropped")
	}
	if n := received.Load(); n != 1 {
		t.Fatalf("the engine received the request %d times, want 1", n)
	}
}

// Bytes an engine sends on an idle connection (a late 408) are never taken
// as the next request's answer.
func TestUpstreamUnsolicitedBytesDropConnection(t *testing.T) {
	url := rawServer(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		if readRawRequest(br) == nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		time.Sleep(20 * time.Millisecond)
		io.WriteString(c, "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
		readRawRequest(br)
	})
	u := newTestUpstream(t, upstreamTestConfig())
	for i := range 2 {
		resp, err := u.RoundTrip(postTo(t, context.Background(), url, "{}"))
		if err != nil {
			t.Fatal(err)
		}
		if got := readAll(t, resp); resp.StatusCode != 200 || got != "ok" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, got)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// A connection whose read (a drain) ends after CloseIdleConnections is
// closed, not pooled: Gateway.Close leaves no connection behind.
func TestUpstreamNoPoolingAfterCloseIdle(t *testing.T) {
	url := rawServer(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for readRawRequest(br) != nil {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
			time.Sleep(50 * time.Millisecond)
			io.WriteString(c, "67890")
		}
	})
	u := newTestUpstream(t, upstreamTestConfig())
	resp, err := u.RoundTrip(postTo(t, context.Background(), url, "{}"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(resp.Body, buf); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close() // drains in the background
	u.CloseIdleConnections()
	time.Sleep(150 * time.Millisecond)
	u.mu.Lock()
	idle, armed := u.nIdle, u.reaper != nil
	u.mu.Unlock()
	if idle != 0 || armed {
		t.Fatalf("after CloseIdleConnections: %d idle, reaper armed %v", idle, armed)
	}
}

// cancelConn wraps a connection to land a context cancellation at an exact
// point of a request: after its write, or after the first read.
type cancelConn struct {
	net.Conn
	afterWrite, afterRead func()
	poisoned              chan struct{}
	once                  sync.Once
}

func (w *cancelConn) Write(p []byte) (int, error) {
	n, err := w.Conn.Write(p)
	if f := w.afterWrite; f != nil {
		w.afterWrite = nil
		f()
	}
	return n, err
}

func (w *cancelConn) Read(p []byte) (int, error) {
	n, err := w.Conn.Read(p)
	if f := w.afterRead; f != nil && n > 0 {
		w.afterRead = nil
		f()
	}
	return n, err
}

func (w *cancelConn) SetDeadline(t time.Time) error {
	err := w.Conn.SetDeadline(t)
	if t.Before(time.Now()) {
		w.once.Do(func() { close(w.poisoned) })
	}
	return err
}

// A cancellation that lands between the request's write and the header
// deadline's set, or between the headers and the deadline's clear, is kept:
// the request ends at once, not at the header timeout or the engine's end.
func TestUpstreamCancelNotLostToDeadlines(t *testing.T) {
	for _, at := range []string{"after-write", "after-headers"} {
		t.Run(at, func(t *testing.T) {
			hold := make(chan struct{})
			url := rawServer(t, func(c net.Conn) {
				readRawRequest(bufio.NewReader(c))
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
				select {
				case <-hold:
				case <-time.After(5 * time.Second):
				}
			})
			t.Cleanup(func() { close(hold) })
			cfg := upstreamTestConfig()
			cfg.ResponseHeaderTimeout = 3 * time.Second
			u := newTestUpstream(t, cfg)
			c, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			w := &cancelConn{Conn: c, poisoned: make(chan struct{})}
			pc := newUpConn(w, "k")
			ctx, cancel := context.WithCancel(context.Background())
			land := func() { cancel(); <-w.poisoned }
			if at == "after-write" {
				w.afterWrite = land
			} else {
				w.afterRead = land
			}
			start := time.Now()
			resp, err := u.roundTrip(ctx, pc, postTo(t, ctx, url, "{}"), time.Time{}, nil)
			if err == nil {
				_, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			if err == nil {
				t.Fatal("a cancelled request completed")
			}
			if d := time.Since(start); d > time.Second {
				t.Fatalf("cancellation took %s", d)
			}
		})
	}
}

// The request on the wire: Content-Length 0 for an empty POST, Connection:
// close when asked, and a body longer than its Content-Length refused
// rather than sent as a second request.
func TestUpstreamRequestFraming(t *testing.T) {
	got := make(chan string, 4)
	url := rawServer(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			b, _ := io.ReadAll(req.Body)
			got <- fmt.Sprintf("cl=%d close=%v body=%q", req.ContentLength, req.Close, b)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
		}
	})
	u := newTestUpstream(t, upstreamTestConfig())
	req, _ := http.NewRequest(http.MethodPost, url, nil)
	req.Close = true
	resp, err := u.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if g := <-got; g != `cl=0 close=true body=""` {
		t.Errorf("empty POST: %s", g)
	}
	req = postTo(t, context.Background(), url, "{}extra")
	req.ContentLength = 2 // shorter than the body
	if _, err := u.RoundTrip(req); err == nil || !strings.Contains(err.Error(), "longer") {
		t.Errorf("body longer than Content-Length: err %v", err)
	}
	select {
	case g := <-got:
		t.Errorf("the engine received %s", g)
	case <-time.After(100 * time.Millisecond):
	}
}

// A request that fails on a new connection is not sent again.
func TestUpstreamFreshConnectionFailureNotRetried(t *testing.T) {
	var accepted atomic.Int64
	url := rawServer(t, func(c net.Conn) {
		accepted.Add(1)
		readRawRequest(bufio.NewReader(c)) // and close without an answer
	})
	u := newTestUpstream(t, upstreamTestConfig())
	if _, err := u.RoundTrip(postTo(t, context.Background(), url, "{}")); err == nil {
		t.Fatal("no error for a connection closed without an answer")
	}
	if n := accepted.Load(); n != 1 {
		t.Fatalf("%d connections, want 1 (no resend on a fresh connection)", n)
	}
}

func TestUpstreamResponseHeaderTimeout(t *testing.T) {
	url := rawServer(t, func(c net.Conn) {
		readRawRequest(bufio.NewReader(c))
		time.Sleep(400 * time.Millisecond)
	})
	cfg := upstreamTestConfig()
	cfg.ResponseHeaderTimeout = 100 * time.Millisecond
	u := newTestUpstream(t, cfg)
	_, err := u.RoundTrip(postTo(t, context.Background(), url, "{}"))
	if err == nil || !IsResponseTimeout(err) {
		t.Fatalf("err %v, want a response timeout", err)
	}
}

// zeros is an endless reader of zero bytes.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// stalledReader is an engine that reads a request's headers and then
// nothing more, neither its body nor anything after: a large body fills the
// socket buffers and the write blocks. It returns the engine's URL.
func stalledReader(t *testing.T) string {
	done := make(chan struct{})
	url := rawServer(t, func(c net.Conn) {
		br := bufio.NewReaderSize(c, 64)
		for {
			line, err := br.ReadString('\n')
			if err != nil || line == "\r\n" {
				break
			}
		}
		<-done
	})
	t.Cleanup(func() { close(done) }) // before rawServer's cleanup waits for serve
	return url
}

// bigPost is a POST of n zero bytes to url.
func bigPost(t *testing.T, url string, n int64) *http.Request {
	req, err := http.NewRequest(http.MethodPost, url, io.NopCloser(io.LimitReader(zeros{}, n)))
	if err != nil {
		t.Fatal(err)
	}
	req.ContentLength = n
	return req
}

// TestUpstreamWriteBounded: response_header_timeout (or the round trip's
// deadline, the earlier) bounds the request's write too. An engine that
// stopped reading a large body held the round trip, and so the client's
// request, for ever: the write had no deadline and the header deadline was
// set only after it. The same through the fallback transport, whose
// ResponseHeaderTimeout starts once the body is written.
func TestUpstreamWriteBounded(t *testing.T) {
	const body = 256 << 20 // far more than loopback's socket buffers
	for _, fallback := range []bool{false, true} {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("fallback=%v,by=%v", fallback, stream), func(t *testing.T) {
				url := stalledReader(t)
				cfg := upstreamTestConfig()
				cfg.ResponseHeaderTimeout = 200 * time.Millisecond
				var by time.Time
				if stream { // a stream's first-event deadline, the earlier
					cfg.ResponseHeaderTimeout = time.Hour
					by = time.Now().Add(200 * time.Millisecond)
				}
				cfg.AllFallback = fallback
				tr := &http.Transport{}
				t.Cleanup(tr.CloseIdleConnections)
				u := New(cfg, tr)
				t.Cleanup(u.CloseIdleConnections)
				errc := make(chan error, 1)
				go func() {
					resp, err := u.RoundTripBy(bigPost(t, url, body), by, nil)
					if err == nil {
						resp.Body.Close()
					}
					errc <- err
				}()
				select {
				case err := <-errc:
					if err == nil || !IsResponseTimeout(err) {
						t.Fatalf("err %v, want a response timeout", err)
					}
				case <-time.After(30 * time.Second):
					t.Fatal("the write to an engine that reads nothing is not bounded")
				}
			})
		}
	}
}

// The header timeout bounds the headers only: a body may take longer.
func TestUpstreamHeaderTimeoutSparesTheBody(t *testing.T) {
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		time.Sleep(300 * time.Millisecond)
		io.WriteString(w, "late")
	})
	cfg := upstreamTestConfig()
	cfg.ResponseHeaderTimeout = 100 * time.Millisecond
	u := newTestUpstream(t, cfg)
	resp, err := u.RoundTrip(postTo(t, context.Background(), s.URL, "{}"))
	if err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, resp); got != "late" {
		t.Fatalf("body %q", got)
	}
}

// Cancelling the context aborts a request waiting for headers and a body
// being read, at once, and the connection is not reused.
func TestUpstreamCancel(t *testing.T) {
	var accepted atomic.Int64
	hold := make(chan struct{})
	url := rawServer(t, func(c net.Conn) {
		accepted.Add(1)
		br := bufio.NewReader(c)
		req := readRawRequest(br)
		if req == nil {
			return
		}
		if req.URL.Path == "/body" {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
		}
		select {
		case <-hold:
		case <-time.After(10 * time.Second):
		}
	})
	t.Cleanup(func() { close(hold) }) // before rawServer's cleanup waits
	u := newTestUpstream(t, upstreamTestConfig())

	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	start := time.Now()
	if _, err := u.RoundTrip(postTo(t, ctx, url+"/headers", "{}")); !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v, want context.Canceled", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("cancel took %s", d)
	}

	ctx, cancel = context.WithCancel(context.Background())
	resp, err := u.RoundTrip(postTo(t, ctx, url+"/body", "{}"))
	if err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(50*time.Millisecond, cancel)
	if _, err := io.ReadAll(resp.Body); err == nil {
		t.Fatal("reading a cancelled body: no error")
	}
	resp.Body.Close()
	if n := idleCount(u); n != 0 {
		t.Fatalf("%d idle connections after cancels, want 0", n)
	}
}

func TestUpstreamHostileAnswers(t *testing.T) {
	cases := []struct {
		name, answer string
		wantErr      bool
		wantBody     string
	}{
		{"huge-headers", "HTTP/1.1 200 OK\r\nX-Big: " + strings.Repeat("a", MaxHeaderBytes+10) + "\r\n\r\n", true, ""},
		{"not-http", "SSH-2.0-OpenSSH\r\n\r\n", true, ""},
		{"switching-protocols", "HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", true, ""},
		{"early-hints-then-200", "HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", false, "ok"},
		{"close-delimited", "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil-eof", false, "until-eof"},
		// http.ReadResponse takes any three digits: a status below 100
		// made the gateway's WriteHeader panic, one above 599 was relayed.
		{"status-000", "HTTP/1.1 000 Zero\r\nContent-Length: 2\r\n\r\n{}", true, ""},
		{"status-050", "HTTP/1.1 050 Low\r\nContent-Length: 2\r\n\r\n{}", true, ""},
		{"status-600", "HTTP/1.1 600 High\r\nContent-Length: 2\r\n\r\n{}", true, ""},
		{"status-999", "HTTP/1.1 999 High\r\nContent-Length: 2\r\n\r\n{}", true, ""},
		{"early-hints-then-000", "HTTP/1.1 103 Early Hints\r\n\r\nHTTP/1.1 000 Zero\r\nContent-Length: 2\r\n\r\n{}", true, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			url := rawServer(t, func(c net.Conn) {
				if readRawRequest(bufio.NewReader(c)) != nil {
					io.WriteString(c, tc.answer)
				}
			})
			u := newTestUpstream(t, upstreamTestConfig())
			resp, err := u.RoundTrip(postTo(t, context.Background(), url, "{}"))
			if tc.wantErr {
				if err == nil {
					resp.Body.Close()
					t.Fatal("no error")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := readAll(t, resp); got != tc.wantBody {
				t.Fatalf("body %q, want %q", got, tc.wantBody)
			}
			if n := idleCount(u); n != 0 && resp.Close {
				t.Fatalf("a connection the engine closes was kept (%d idle)", n)
			}
		})
	}
}

// The fallback transport (net/http's) accepts the same invalid status
// codes; RoundTripBy refuses them there too.
func TestUpstreamFallbackInvalidStatus(t *testing.T) {
	for _, code := range []string{"000", "099", "600", "999"} {
		t.Run(code, func(t *testing.T) {
			url := rawServer(t, func(c net.Conn) {
				if readRawRequest(bufio.NewReader(c)) != nil {
					io.WriteString(c, "HTTP/1.1 "+code+" Odd\r\nContent-Length: 2\r\n\r\n{}")
				}
			})
			cfg := upstreamTestConfig()
			cfg.AllFallback = true
			tr := &http.Transport{}
			t.Cleanup(tr.CloseIdleConnections)
			u := New(cfg, tr)
			t.Cleanup(u.CloseIdleConnections)
			resp, err := u.RoundTripBy(postTo(t, context.Background(), url, "{}"), time.Now().Add(5*time.Second), nil)
			if err == nil {
				resp.Body.Close()
				t.Fatalf("status %d answered without an error", resp.StatusCode)
			}
			if !strings.Contains(err.Error(), "invalid status code") {
				t.Fatalf("err %v, want an invalid status code", err)
			}
		})
	}
}

func TestUpstreamIdleLimitsAndReaping(t *testing.T) {
	s, _ := countingServer(t, nil)
	cfg := upstreamTestConfig()
	cfg.MaxIdleConnsPerHost = 2
	cfg.IdleConnTimeout = 200 * time.Millisecond
	u := newTestUpstream(t, cfg)
	var resps []*http.Response
	for range 4 { // 4 at once: 4 connections
		resp, err := u.RoundTrip(postTo(t, context.Background(), s.URL, "{}"))
		if err != nil {
			t.Fatal(err)
		}
		resps = append(resps, resp)
	}
	for _, resp := range resps {
		readAll(t, resp)
	}
	if n := idleCount(u); n != 2 {
		t.Fatalf("%d idle, want max_idle_conns_per_host 2", n)
	}
	waitFor(t, "idle connections reaped", func() bool { return idleCount(u) == 0 })
}

func TestUpstreamDialError(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	u := newTestUpstream(t, upstreamTestConfig())
	_, err = u.RoundTrip(postTo(t, context.Background(), "http://"+addr, "{}"))
	if err == nil || !IsDialError(err) {
		t.Fatalf("err %v, want a dial error", err)
	}
}

// https endpoints go through the fallback transport.
func TestUpstreamHTTPSFallback(t *testing.T) {
	s := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "tls") }))
	t.Cleanup(s.Close)
	u := New(upstreamTestConfig(), s.Client().Transport)
	t.Cleanup(u.CloseIdleConnections)
	resp, err := u.RoundTrip(postTo(t, context.Background(), s.URL, "{}"))
	if err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, resp); got != "tls" {
		t.Fatalf("body %q", got)
	}
}

// Many concurrent requests share a bounded set of connections (race
// detector food).
func TestUpstreamConcurrent(t *testing.T) {
	s, conns := countingServer(t, nil)
	u := newTestUpstream(t, upstreamTestConfig())
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := range 50 {
				body := fmt.Sprintf(`{"w":%d,"i":%d}`, w, i)
				resp, err := u.RoundTrip(postTo(t, context.Background(), s.URL+"/p", body))
				if err != nil {
					t.Error(err)
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if !bytes.Contains(b, []byte(body)) {
					t.Errorf("answer %q lacks %q", b, body)
				}
			}
		})
	}
	wg.Wait()
	if n := conns.Load(); n > 8 {
		t.Fatalf("%d connections for 8 concurrent clients", n)
	}
}

func TestPeerClosedProbe(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	pair := func() (client, server net.Conn) {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		s, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close(); s.Close() })
		return c, s
	}
	c, srv := pair()
	if peerClosed(c) {
		t.Fatal("an open, quiet connection probed as closed")
	}
	srv.Close()
	waitFor(t, "the engine's close", func() bool { return peerClosed(c) })

	c, srv = pair()
	io.WriteString(srv, "x") // bytes nobody asked for: unusable
	waitFor(t, "the unsolicited byte", func() bool { return peerClosed(c) })
}

// An engine that answers 413 and closes without reading a large body: its
// answer is relayed, not the write error.
func TestUpstreamEarlyAnswerBeforeBodyRead(t *testing.T) {
	url := rawServer(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for { // the headers only
			line, err := br.ReadString('\n')
			if err != nil || line == "\r\n" {
				break
			}
		}
		io.WriteString(c, "HTTP/1.1 413 Request Entity Too Large\r\nContent-Type: application/json\r\nContent-Length: 15\r\nConnection: close\r\n\r\n{\"error\":\"big\"}")
		if tc, ok := c.(*net.TCPConn); ok {
			tc.CloseWrite()
		}
		time.Sleep(200 * time.Millisecond)
	})
	u := newTestUpstream(t, upstreamTestConfig())
	body := strings.Repeat("x", 64<<20) // more than the socket buffers hold
	resp, err := u.RoundTrip(postTo(t, context.Background(), url, body))
	if err != nil {
		t.Fatalf("err %v, want the engine's 413", err)
	}
	if got := readAll(t, resp); resp.StatusCode != 413 || got != `{"error":"big"}` {
		t.Fatalf("status %d body %q", resp.StatusCode, got)
	}
}

// The upstream client: RoundTripBy's deadline bounds the headers and then
// the body until moved; moved, the body waits again; cleared, it waits for
// ever (here: until the context ends).
func TestUpstreamRoundTripBy(t *testing.T) {
	hold := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/silent" {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			_, _ = io.WriteString(w, "a")
			_ = http.NewResponseController(w).Flush()
		}
		<-hold
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(hold) })             // first: the handlers return, then the server closes
	u := newTestUpstream(t, upstreamTestConfig()) // response_header_timeout 5 s: by comes first
	ctx := context.Background()

	if _, err := u.RoundTripBy(postTo(t, ctx, srv.URL+"/silent", "{}"), time.Now().Add(50*time.Millisecond), nil); !IsResponseTimeout(err) {
		t.Fatalf("silent engine: %v, want a timeout", err)
	}
	resp, err := u.RoundTripBy(postTo(t, ctx, srv.URL+"/headers", "{}"), time.Now().Add(time.Second), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var buf [64]byte
	if n, err := resp.Body.Read(buf[:]); n == 0 || err != nil {
		t.Fatalf("first read %d %v", n, err)
	}
	dl, ok := resp.Body.(ReadDeadliner)
	if !ok {
		t.Fatal("the body has no read deadline")
	}
	_ = dl.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := resp.Body.Read(buf[:]); !IsTimeout(err) {
		t.Fatalf("second read: %v, want a timeout", err)
	}
	_ = dl.SetReadDeadline(time.Time{}) // the connection is broken now: no effect, no panic
}

// waitFor waits until cond holds (polltest.Until: a minute at most).
var waitFor = polltest.Until
