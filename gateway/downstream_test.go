package gateway

import (
	"bufio"
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
)

// Tests of what crosses the gateway besides the body: the engine's
// response headers on the way down, the client's query string on the way
// up, and how an abandoned request is counted.

// hostileHeaders are response headers an engine must not set on the
// gateway's answer (dropDownstream), with a value each.
var hostileHeaders = map[string]string{
	AttemptsHeader:                "99",
	"X-Infergate-Endpoint":        "http://10.0.0.9:8000",
	"Set-Cookie":                  "session=engine; Path=/",
	"Location":                    "http://10.0.0.9:8000/internal",
	"Content-Location":            "/internal",
	"Refresh":                     "0; url=http://evil.example/",
	"Alt-Svc":                     `h3=":443"; ma=86400`,
	"Strict-Transport-Security":   "max-age=0",
	"Access-Control-Allow-Origin": "*",
	"X-Accel-Redirect":            "/protected/file",
	"X-Sendfile":                  "/etc/passwd",
	"Server":                      "uvicorn",
}

func TestEngineResponseHeadersFiltered(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(strconv.FormatBool(stream), func(t *testing.T) {
			failed := false
			var mu sync.Mutex
			e := newFuncEngine(t, func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				first := !failed
				failed = true
				mu.Unlock()
				if first { // the first attempt fails: the answer needs two
					http.Error(w, "busy", http.StatusServiceUnavailable)
					return
				}
				for k, v := range hostileHeaders {
					w.Header().Set(k, v)
				}
				w.Header().Set("X-Compute-Time", "0.25") // an engine's own information: kept
				if stream {
					sseStart(w)
					sseSend(w, tokenChunk+"data: [DONE]\n\n")
					return
				}
				okJSON(w, r)
			})
			// One engine as two endpoints: the first attempt fails over.
			cfg := resilienceConfig(sched.RoundRobin, e.URL(), strings.Replace(e.URL(), "127.0.0.1", "localhost", 1))
			_, url := startGateway(t, cfg)
			body := chatBody
			if stream {
				body = streamBody(false)
			}
			resp, b := post(t, testClient(t), url+pathChat, body)
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			for k := range hostileHeaders {
				if k == AttemptsHeader {
					continue
				}
				if v, ok := resp.Header[http.CanonicalHeaderKey(k)]; ok {
					t.Errorf("the engine's %s reached the client: %q", k, v)
				}
			}
			if got := resp.Header[AttemptsHeader]; len(got) != 1 || got[0] != "2" {
				t.Errorf("%s = %q, want the gateway's 2 alone", AttemptsHeader, got)
			}
			if resp.Header.Get("X-Compute-Time") != "0.25" {
				t.Errorf("the engine's X-Compute-Time was dropped: %v", resp.Header)
			}
			if stream && resp.Header.Get("X-Accel-Buffering") != "no" {
				t.Errorf("X-Accel-Buffering %q, want the gateway's no", resp.Header.Get("X-Accel-Buffering"))
			}
		})
	}
}

func TestEscapeQuery(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", ""},
		{"a=1&b=two", "a=1&b=two"},
		{"next=http://x/&a=@y;z=(1)!*'~", "next=http://x/&a=@y;z=(1)!*'~"},
		{"a=1%20x&b=%2F", "a=1%20x&b=%2F"},
		{"a b", "a%20b"},
		{"a=1 HTTP/1.1\r\nHost: evil", "a=1%20HTTP/1.1%0D%0AHost:%20evil"},
		{"c=%zz&d=%4", "c=%25zz&d=%254"},
		{`d="<x>"{}|\^` + "`", "d=%22%3Cx%3E%22%7B%7D%7C%5C%5E%60"},
		{"e=é#f", "e=%C3%A9%23f"},
	} {
		if got := escapeQuery(tc.in); got != tc.want {
			t.Errorf("escapeQuery(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// FuzzEscapeQuery: the result is a valid query (url.ParseRequestURI takes
// it, no byte outside RFC 3986's), escaping is idempotent, and it decodes
// to what the input decodes to wherever the input was valid.
func FuzzEscapeQuery(f *testing.F) {
	for _, s := range []string{"a b", "a=1&b=2", "%zz", "x=\r\nHost: evil", "é", "%", "a%2", "q=1%20%41"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		q := escapeQuery(raw)
		for i := range len(q) {
			if !queryByteOK(q, i) {
				t.Fatalf("escapeQuery(%q) = %q: byte %d %q left", raw, q, i, q[i])
			}
		}
		if again := escapeQuery(q); again != q {
			t.Fatalf("not idempotent: %q → %q → %q", raw, q, again)
		}
		if _, err := url.ParseRequestURI("/v1/completions?" + q); err != nil {
			t.Fatalf("%q → %q: %v", raw, q, err)
		}
		if want, err := url.QueryUnescape(raw); err == nil {
			if got, err := url.QueryUnescape(q); err != nil || got != want {
				t.Fatalf("%q decodes to %q, its escape %q to %q (%v)", raw, want, q, got, err)
			}
		}
	})
}

// h2Gateway serves cfg over TLS with HTTP/2, calling arrived (if set) as
// each request reaches the handler, and returns its URL and an HTTP/2
// client.
func h2Gateway(t *testing.T, cfg Config, arrived func()) (string, *http.Client) {
	t.Helper()
	certFile, keyFile, pool := selfSigned(t, t.TempDir(), "gw")
	cfg.TLS = TLSConfig{CertFile: certFile, KeyFile: keyFile}
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := g.Server()
	if arrived != nil {
		h := srv.Handler
		srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost {
				arrived()
			}
			h.ServeHTTP(w, r)
		})
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.ServeTLS(ln, "", "") }()
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, ForceAttemptHTTP2: true}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		srv.Close()
		g.Close()
	})
	return "https://" + ln.Addr().String(), &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

// TestQueryEscapedUpstream: a query string with bytes a request line
// cannot carry — spaces over HTTP/2, quotes, braces, non-ASCII over either
// — reaches the engine percent-encoded, on one request line.
func TestQueryEscapedUpstream(t *testing.T) {
	got := make(chan string, 4)
	eng := newServerNoCleanup(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			got <- r.RequestURI
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","choices":[]}`)
	}))
	defer eng.Close()
	cfg := resilienceConfig(sched.RoundRobin, eng.URL)
	body := `{"model":"m","prompt":"x"}`

	base, c := h2Gateway(t, cfg, nil)
	req, err := http.NewRequest(http.MethodPost, base+pathCompletions, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.URL.RawQuery = `a b&c=%zz&d="<x>"&e=é&ok=1%20x` // as an HTTP/2 client can send it
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.ProtoMajor != 2 {
		t.Fatalf("%s %d %s", resp.Proto, resp.StatusCode, b)
	}
	if uri, want := <-got, pathCompletions+"?a%20b&c=%25zz&d=%22%3Cx%3E%22&e=%C3%A9&ok=1%20x"; uri != want {
		t.Errorf("HTTP/2: the engine saw %q, want %q", uri, want)
	}

	_, url := startGateway(t, cfg)
	raw := "POST " + pathCompletions + "?q={\"k\":\"é\"} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
		"Content-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
	if resp, b := rawRequest(t, strings.TrimPrefix(url, "http://"), raw); resp.StatusCode != 200 {
		t.Fatalf("HTTP/1.1: %d %s", resp.StatusCode, b)
	}
	if uri, want := <-got, pathCompletions+"?q=%7B%22k%22:%22%C3%A9%22%7D"; uri != want {
		t.Errorf("HTTP/1.1: the engine saw %q, want %q", uri, want)
	}
}

// TestAbandonedBodyCounted499: a client that gives up before its body
// arrived — an HTTP/2 stream reset, an HTTP/1.1 connection closed short of
// its Content-Length — is a client that closed the request (499), not a
// bad request.
func TestAbandonedBodyCounted499(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := resilienceConfig(sched.RoundRobin, e.URL())

	arrived := make(chan struct{}, 1)
	base, c := h2Gateway(t, cfg, func() { arrived <- struct{}{} })
	pr, pw := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+pathChat, pr)
	req.ContentLength = 1000
	done := make(chan struct{})
	go func() {
		defer close(done)
		if resp, err := c.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	_, _ = pw.Write([]byte(`{"model":"m",`))
	<-arrived
	cancel() // RST_STREAM
	<-done
	pw.Close()
	waitFor(t, "the HTTP/2 request counted", func() bool {
		m := scrape(t, c, base)
		return m.value("infergate_requests_total", `code="499"`) == 1
	})

	_, url := startGateway(t, cfg)
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.WriteString(conn, "POST "+pathChat+" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":")
	_ = conn.(*net.TCPConn).CloseWrite()
	_, _ = bufio.NewReader(conn).ReadString('\n') // the server closes without an answer
	conn.Close()
	tc := testClient(t)
	waitFor(t, "the HTTP/1.1 request counted", func() bool {
		return scrape(t, tc, url).value("infergate_requests_total", `code="499"`) == 1
	})
	if v := scrape(t, tc, url).value("infergate_requests_total", `code="400"`); v != 0 {
		t.Errorf("requests_total{400} = %v", v)
	}
}

// TestHeaderTooLargeKeepsHTTP2Connection: over HTTP/2, a request whose
// headers are over max_header_bytes (but within what net/http reads, twice
// it) is answered the OpenAI-format 431 on its own stream, and the shared
// connection stays open for the requests after it. checkEdge set
// Connection: close for every protocol, which net/http's HTTP/2 server
// takes as a GOAWAY: one client's oversized header cost every other stream
// multiplexed on the connection (a proxy's, say) a new connection.
func TestHeaderTooLargeKeepsHTTP2Connection(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := resilienceConfig(sched.RoundRobin, e.URL())
	cfg.MaxHeaderBytes = 4096
	url, c := h2Gateway(t, cfg, nil)
	for i, big := range []bool{false, true, false, true, false} {
		reused := false
		trace := &httptrace.ClientTrace{GotConn: func(ci httptrace.GotConnInfo) { reused = ci.Reused }}
		req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), http.MethodPost, url+pathChat, strings.NewReader(chatBody))
		req.Header.Set("Content-Type", "application/json")
		if big {
			req.Header.Set("X-Big", strings.Repeat("a", 5000))
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		want := http.StatusOK
		if big {
			want = http.StatusRequestHeaderFieldsTooLarge
		}
		if resp.ProtoMajor != 2 || resp.StatusCode != want {
			t.Fatalf("request %d: HTTP/%d %d, want HTTP/2 %d; body %s", i, resp.ProtoMajor, resp.StatusCode, want, body)
		}
		if big && !strings.Contains(string(body), codeHeaderTooLarge) {
			t.Fatalf("request %d: body %s, want an OpenAI error %s", i, body, codeHeaderTooLarge)
		}
		if i > 0 && !reused {
			t.Errorf("request %d opened a new connection: the 431 before closed the shared one", i)
		}
	}
}

// TestRefusalKeepsHTTP2Connection: over HTTP/2, a request refused before
// its body is read (no key, unknown path) does not close the client's
// shared connection: net/http takes a handler's Connection: close as a
// GOAWAY, and every refused POST cost the other streams their connection.
func TestRefusalKeepsHTTP2Connection(t *testing.T) {
	e, f := newFakeEngine(t, "e0"), newFakeEngine(t, "e1")
	url, c := h2Gateway(t, authConfig(t, e, f), nil)
	for i, path := range []string{pathChat, pathChat, "/nowhere", pathChat, pathChat} {
		reused := false
		trace := &httptrace.ClientTrace{GotConn: func(ci httptrace.GotConnInfo) { reused = ci.Reused }}
		req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), http.MethodPost, url+path, strings.NewReader(chatBody))
		if path == "/nowhere" {
			req.Header.Set("Authorization", "Bearer "+keyAlice)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.ProtoMajor != 2 || resp.StatusCode/100 != 4 {
			t.Fatalf("request %d: HTTP/%d %d", i, resp.ProtoMajor, resp.StatusCode)
		}
		if i > 0 && !reused {
			t.Errorf("request %d (%s) opened a new connection: the refusal before closed the shared one", i, path)
		}
	}
}
