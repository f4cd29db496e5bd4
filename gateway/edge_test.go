package gateway

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// rawRequest writes a raw HTTP/1.1 request to addr and returns the response
// with its body read.
func rawRequest(t *testing.T, addr, raw string) (*http.Response, []byte) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.WriteString(conn, raw); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, body
}

func TestClientHeadersScrubbed(t *testing.T) {
	spoof := []string{
		"Authorization", "Bearer sk-1",
		"X-Api-Key", "sk-2",
		"Api-Key", "sk-3",
		"Cookie", "session=1",
		"X-Forwarded-For", "1.2.3.4",
		"X-Forwarded-Host", "evil.example",
		"X-Forwarded-Proto", "https",
		"X-Forwarded-Port", "443",
		"Forwarded", "for=1.2.3.4;proto=https",
		"X-Real-Ip", "1.2.3.4",
		"X-Infergate-Endpoint", "http://evil.example",
		"X-Infergate-Priority", "0",
		PriorityHeader, "5", // the gateway's own admission header (capped by a key's max_priority)
		"X-Session-Id", "conv-42",
		"X-Custom", "kept",
	}
	for _, trusted := range []bool{false, true} {
		t.Run(fmt.Sprintf("trusted=%v", trusted), func(t *testing.T) {
			e := newFakeEngine(t, "e0")
			cfg := testConfig(sched.RoundRobin, e)
			if trusted {
				cfg.TrustedProxies = []string{"127.0.0.0/8"}
			}
			_, url := startGateway(t, cfg)
			if resp, b := post(t, testClient(t), url+pathChat, chatBody, spoof...); resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			h, _ := e.last()
			for _, k := range []string{"Authorization", "X-Api-Key", "Api-Key", "Cookie", "X-Infergate-Endpoint", "X-Infergate-Priority", PriorityHeader} {
				if v, ok := h[k]; ok {
					t.Errorf("%s reached the engine: %q", k, v)
				}
			}
			if h.Get("X-Session-Id") != "conv-42" || h.Get("X-Custom") != "kept" {
				t.Errorf("end-to-end headers lost: %v", h)
			}
			if !trusted {
				for _, k := range []string{"X-Forwarded-Host", "X-Forwarded-Port", "Forwarded", "X-Real-Ip"} {
					if v, ok := h[k]; ok {
						t.Errorf("spoofed %s reached the engine: %q", k, v)
					}
				}
				if h.Get("X-Forwarded-For") != "127.0.0.1" || h.Get("X-Forwarded-Proto") != "http" {
					t.Errorf("X-Forwarded-For %q, -Proto %q: want the gateway's own", h.Get("X-Forwarded-For"), h.Get("X-Forwarded-Proto"))
				}
			} else if h.Get("X-Forwarded-For") != "1.2.3.4, 127.0.0.1" || h.Get("X-Forwarded-Proto") != "https" ||
				h.Get("X-Forwarded-Host") != "evil.example" || h.Get("Forwarded") == "" {
				t.Errorf("a trusted proxy's forwarding headers: %v", h)
			}
		})
	}
}

// TestUpstreamTargetFixed: nothing a client sends — model name, Host
// header, absolute-form request target, path tricks, query string — changes
// which host the gateway connects to or the path it requests there.
func TestUpstreamTargetFixed(t *testing.T) {
	var evilHits atomic.Int64
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		evilHits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"pwned":true}`)
	}))
	defer evil.Close()
	evilHost := strings.TrimPrefix(evil.URL, "http://")

	var mu sync.Mutex
	var seen []string // engine request targets
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Host+" "+r.RequestURI)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","choices":[]}`)
	}))
	defer eng.Close()
	engHost := strings.TrimPrefix(eng.URL, "http://")

	cfg := testConfig(sched.RoundRobin)
	cfg.HealthCheckPath = healthCheckOff
	cfg.ScrapeInterval = -1
	cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000}}
	for _, m := range []string{"../../evil", "http://" + evilHost + "/", "m/../../x", "m?x=1", "@" + evilHost, "m#frag", "//" + evilHost} {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: eng.URL, Model: m, KVBlocks: 1000})
	}
	_, url := startGateway(t, cfg)
	addr := strings.TrimPrefix(url, "http://")

	req := func(target, host, model string) string {
		body := `{"model":` + strconv.Quote(model) + `,"prompt":"x"}`
		return "POST " + target + " HTTP/1.1\r\nHost: " + host + "\r\nContent-Type: application/json\r\n" +
			"Content-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
	}
	served := []struct {
		name, target, host, model, wantURI string
	}{
		{"hostile Host header", pathCompletions, evilHost, "m", pathCompletions},
		{"absolute-form target", "http://" + evilHost + pathCompletions, evilHost, "m", pathCompletions},
		{"model with dots and slashes", pathCompletions, "x", "../../evil", pathCompletions},
		{"model that is a URL", pathCompletions, "x", "http://" + evilHost + "/", pathCompletions},
		{"model with a query", pathCompletions, "x", "m?x=1", pathCompletions},
		{"model with userinfo", pathCompletions, "x", "@" + evilHost, pathCompletions},
		{"model with a fragment", pathCompletions, "x", "m#frag", pathCompletions},
		{"model scheme-relative", pathCompletions, "x", "//" + evilHost, pathCompletions},
		{"encoded slash: the canonical path is sent", "/v1%2Fcompletions", "x", "m", pathCompletions},
		{"query passes as a query", pathCompletions + "?next=http://" + evilHost + "/&a=@" + evilHost, "x", "m",
			pathCompletions + "?next=http://" + evilHost + "/&a=@" + evilHost},
	}
	for _, tc := range served {
		mu.Lock()
		seen = nil
		mu.Unlock()
		resp, b := rawRequest(t, addr, req(tc.target, tc.host, tc.model))
		if resp.StatusCode != 200 {
			t.Errorf("%s: %d %s", tc.name, resp.StatusCode, b)
			continue
		}
		mu.Lock()
		got := append([]string(nil), seen...)
		mu.Unlock()
		if len(got) != 1 || got[0] != engHost+" "+tc.wantURI {
			t.Errorf("%s: engine saw %q, want %q", tc.name, got, engHost+" "+tc.wantURI)
		}
	}
	refused := []struct{ name, target string }{
		{"dot segments", pathCompletions + "/../../admin"},
		{"double slash", "/" + pathCompletions},
		{"trailing slash", pathCompletions + "/"},
		{"unknown model", ""},
	}
	for _, tc := range refused {
		target, model := tc.target, "m"
		if target == "" {
			target, model = pathCompletions, "http://"+evilHost
		}
		resp, b := rawRequest(t, addr, req(target, evilHost, model))
		if resp.StatusCode != 404 {
			t.Errorf("%s: %d %s, want 404", tc.name, resp.StatusCode, b)
		}
	}
	if n := evilHits.Load(); n != 0 {
		t.Fatalf("the hostile host got %d requests", n)
	}
}

// TestHostileEngine: malformed or hostile engine answers end in a bounded,
// reported failure — no crash, no unbounded buffering, no request left in
// flight.
func TestHostileEngine(t *testing.T) {
	huge := strings.Repeat("x", openai.MaxEventBytes+10)
	tests := []struct {
		name   string
		stream bool
		serve  func(w http.ResponseWriter, r *http.Request)
		// check inspects the client's view (status, body, read error).
		check func(t *testing.T, status int, body []byte, err error)
	}{
		{"SSE line over the limit", true, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\ndata: "+huge+"\n\n")
		}, func(t *testing.T, status int, body []byte, _ error) {
			if status != 200 || !bytes.Contains(body, []byte(`"code":"upstream_error"`)) || !bytes.HasSuffix(body, []byte("data: [DONE]\n\n")) {
				t.Errorf("%d %.300s", status, body)
			}
		}},
		{"SSE data lines summing over the limit", true, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			line := "data: " + strings.Repeat("y", 64<<10) + "\n"
			for range 20 {
				_, _ = io.WriteString(w, line)
			}
			_, _ = io.WriteString(w, "\n")
		}, func(t *testing.T, status int, body []byte, _ error) {
			if !bytes.Contains(body, []byte(`"code":"upstream_error"`)) || len(body) > 4096 {
				t.Errorf("%d %d bytes %.300s", status, len(body), body)
			}
		}},
		// No event of a stream is a completion chunk: not a 200 with
		// garbage or [DONE] alone, but an error (retried elsewhere).
		{"binary and non-JSON events", true, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: \xff\xfe\x00garbage\n\n: comment\nevent: x\nid: 1\nretry: 5\n\ndata: {\"choices\":\"nope\"}\n\ndata: [DONE]\n\n")
		}, wantUpstreamError(http.StatusBadGateway, "without a completion chunk")},
		{"non-SSE garbage, then [DONE]", true, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "<html>\n<body>502 Bad Gateway</body>\n</html>\n\ndata: [DONE]\n\n")
		}, wantUpstreamError(http.StatusBadGateway, "without a completion chunk")},
		{"binary events before a completion chunk", true, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: \xff\xfe\x00garbage\n\ndata: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\ndata: [DONE]\n\n")
		}, func(t *testing.T, status int, body []byte, _ error) {
			if status != 200 || !bytes.HasSuffix(body, []byte("data: [DONE]\n\n")) || !bytes.Contains(body, []byte("garbage")) {
				t.Errorf("%d %q", status, body)
			}
		}},
		{"stream answered as JSON", true, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"x","choices":[{"index":0,"text":"hi"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
		}, func(t *testing.T, status int, body []byte, _ error) {
			if status != 200 || !bytes.Contains(body, []byte(`"text":"hi"`)) {
				t.Errorf("%d %s", status, body)
			}
		}},
		{"stream answered as text/html", true, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/html")
			_, _ = io.WriteString(w, "<html>proxy login</html>")
		}, wantUpstreamError(http.StatusBadGateway, `Content-Type "text/html"`)},
		{"stream answered without a Content-Type", true, func(w http.ResponseWriter, r *http.Request) {
			w.Header()["Content-Type"] = nil
			_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"hi\"}]}\n\n")
		}, wantUpstreamError(http.StatusBadGateway, "not text/event-stream")},
		{"error event before any output", true, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, `data: {"error":{"object":"error","message":"engine died","type":"BadRequestError","param":null,"code":400}}`+"\n\ndata: [DONE]\n\n")
		}, wantUpstreamError(http.StatusBadGateway, "before its first token: engine died")},
		{"TGI-style error event before any output", true, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, `data: {"error":"Request failed during generation: Server error: CUDA out of memory","error_type":"generation"}`+"\n\n")
		}, wantUpstreamError(http.StatusBadGateway, "CUDA out of memory")},
		{"huge response headers", false, func(w http.ResponseWriter, r *http.Request) {
			for i := range 40 {
				w.Header().Set("X-Junk-"+strconv.Itoa(i), strings.Repeat("j", 32<<10))
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{}`)
		}, func(t *testing.T, status int, body []byte, _ error) {
			if status != 502 || !bytes.Contains(body, []byte(openai.CodeUpstream)) {
				t.Errorf("%d %.300s", status, body)
			}
		}},
		{"error status with an HTML body", false, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/html")
			w.WriteHeader(http.StatusTooManyRequests)
			_, _ = io.WriteString(w, strings.Repeat("<p>busy</p>", 200000))
		}, func(t *testing.T, status int, body []byte, _ error) {
			if status != 502 || len(body) > 2048 {
				t.Errorf("%d %d bytes", status, len(body))
			}
		}},
		{"not HTTP at all", false, func(w http.ResponseWriter, r *http.Request) {
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				_, _ = io.WriteString(conn, "SSH-2.0-OpenSSH_9.6\r\n\r\n")
				_ = conn.Close()
			}
		}, func(t *testing.T, status int, body []byte, _ error) {
			if status != 502 {
				t.Errorf("%d %s", status, body)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := newServerNoCleanup(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == pathCompletions {
					_, _ = io.Copy(io.Discard, r.Body)
					tc.serve(w, r)
				}
			}))
			defer eng.Close()
			cfg := testConfig(sched.RoundRobin)
			cfg.HealthCheckPath = healthCheckOff
			cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000}}
			g, url := startGateway(t, cfg)
			body := fmt.Sprintf(`{"model":"m","prompt":"x","stream":%v}`, tc.stream)
			resp, err := testClient(t).Post(url+pathCompletions, "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			b, rerr := io.ReadAll(resp.Body)
			resp.Body.Close()
			tc.check(t, resp.StatusCode, b, rerr)
			waitFor(t, "in flight back to 0", func() bool { return g.state.Load().endpoints[0].ledger.InFlight() == 0 })
		})
	}
}

// wantUpstreamError checks for an OpenAI error of status whose message
// contains msg.
func wantUpstreamError(status int, msg string) func(t *testing.T, got int, body []byte, _ error) {
	return func(t *testing.T, got int, body []byte, _ error) {
		t.Helper()
		var er openai.ErrorResponse
		if got != status || json.Unmarshal(body, &er) != nil || er.Error == nil || !strings.Contains(er.Error.Message, msg) {
			t.Errorf("%d %s; want %d with %q", got, body, status, msg)
		}
	}
}

// TestEndlessEngineBodies: an engine that never ends its answer (a body or
// a stream of keep-alive comments) is relayed with bounded memory until the
// client leaves, and then the upstream request is canceled.
func TestEndlessEngineBodies(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			canceled := make(chan struct{}, 1)
			eng := newServerNoCleanup(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != pathCompletions {
					return
				}
				chunk := strings.Repeat("z", 16<<10)
				if stream {
					w.Header().Set("Content-Type", "text/event-stream")
					chunk = ": keep-alive " + chunk + "\n"
				} else {
					w.Header().Set("Content-Type", "application/json")
				}
				rc := http.NewResponseController(w)
				for r.Context().Err() == nil {
					if _, err := io.WriteString(w, chunk); err != nil {
						break
					}
					_ = rc.Flush()
				}
				canceled <- struct{}{}
			}))
			defer eng.Close()
			cfg := testConfig(sched.RoundRobin)
			cfg.HealthCheckPath = healthCheckOff
			cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000}}
			g, url := startGateway(t, cfg)

			ctx, cancel := contextWithCancel(t)
			body := fmt.Sprintf(`{"model":"m","prompt":"x","stream":%v}`, stream)
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+pathCompletions, strings.NewReader(body))
			c := testClient(t)
			if !stream {
				// The client reads 8 MiB, past the 4 MiB usage capture.
				resp, err := c.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				if n, err := io.CopyN(io.Discard, resp.Body, 8<<20); err != nil {
					t.Fatalf("read %d: %v", n, err)
				}
				cancel()
				resp.Body.Close()
			} else {
				// Comments are not events: the gateway reads them (and
				// sends no status line until a first event) while the
				// client waits; then the client gives up.
				done := make(chan struct{})
				go func() {
					defer close(done)
					if resp, err := c.Do(req); err == nil {
						resp.Body.Close()
					}
				}()
				time.Sleep(300 * time.Millisecond)
				cancel()
				<-done
			}
			select {
			case <-canceled:
			case <-time.After(10 * time.Second):
				t.Fatal("the endless upstream answer was not canceled")
			}
			waitFor(t, "in flight back to 0", func() bool { return g.state.Load().endpoints[0].ledger.InFlight() == 0 })
			x := g.getExchange()
			defer g.putExchange(x)
			if cap(x.capture) > maxUsageScan+(64<<10) {
				t.Errorf("usage capture grew to %d bytes", cap(x.capture))
			}
		})
	}
}

// selfSigned writes a self-signed ECDSA certificate for 127.0.0.1 and
// returns the cert and key paths and a pool trusting it.
func selfSigned(t *testing.T, dir, name string) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, name+".pem"), filepath.Join(dir, name+"-key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool = x509.NewCertPool()
	pool.AddCert(cert)
	return certFile, keyFile, pool
}

func TestTLSTermination(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile, pool := selfSigned(t, dir, "gw")
	e := newFakeEngine(t, "e0")
	cfg := testConfig(sched.RoundRobin, e)
	cfg.TLS = TLSConfig{CertFile: certFile, KeyFile: keyFile}
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if !g.TLSEnabled() {
		t.Fatal("TLS not enabled")
	}
	srv := g.Server()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.ServeTLS(ln, "", "") }()
	defer srv.Close()
	url := "https://" + ln.Addr().String()

	for _, h2 := range []bool{false, true} {
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, ForceAttemptHTTP2: h2}
		c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
		resp, body := post(t, c, url+pathChat, streamBody(false))
		tr.CloseIdleConnections()
		if resp.StatusCode != 200 || !bytes.HasSuffix(body, []byte("data: [DONE]\n\n")) {
			t.Fatalf("h2=%v: %d %s", h2, resp.StatusCode, body)
		}
		if h2 != (resp.ProtoMajor == 2) {
			t.Errorf("h2=%v: protocol %s", h2, resp.Proto)
		}
		if h, _ := e.last(); h.Get("X-Forwarded-Proto") != "https" {
			t.Errorf("X-Forwarded-Proto %q, want https", h.Get("X-Forwarded-Proto"))
		}
	}

	// TLS 1.1 is refused; plain HTTP gets no answer.
	old := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MaxVersion: tls.VersionTLS11}}
	if _, err := (&http.Client{Transport: old, Timeout: 5 * time.Second}).Get(url + pathHealthz); err == nil {
		t.Error("a TLS 1.1 client was served")
	}
	if resp, err := testClient(t).Get("http://" + ln.Addr().String() + pathHealthz); err == nil && resp.StatusCode == 200 {
		t.Error("plain HTTP served on the TLS listener")
	}

	// A missing certificate fails New, not the first handshake.
	cfg.TLS.CertFile = filepath.Join(dir, "missing.pem")
	if _, err := New(context.Background(), cfg, nil); err == nil || !strings.Contains(err.Error(), "cert_file") {
		t.Errorf("missing cert: %v", err)
	}
}

func TestCertReload(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile, _ := selfSigned(t, dir, "one")
	cl := &certLoader{certFile: certFile, keyFile: keyFile}
	if err := cl.load(time.Now()); err != nil {
		t.Fatal(err)
	}
	first, _ := cl.get(nil)
	c2, k2, _ := selfSigned(t, dir, "two")
	for _, mv := range [][2]string{{c2, certFile}, {k2, keyFile}} {
		data, _ := os.ReadFile(mv[0])
		if err := os.WriteFile(mv[1], data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	later := time.Now().Add(time.Second)
	_ = os.Chtimes(certFile, later, later)
	second, _ := cl.get(nil)
	if second == first {
		t.Fatal("the renewed certificate was not loaded")
	}
	if leaf, _ := x509.ParseCertificate(second.Certificate[0]); leaf.Subject.CommonName != "two" {
		t.Fatalf("serving %q", leaf.Subject.CommonName)
	}
	// A broken renewal keeps the previous pair.
	_ = os.WriteFile(certFile, []byte("garbage"), 0o600)
	_ = os.Chtimes(certFile, later.Add(time.Second), later.Add(time.Second))
	if third, _ := cl.get(nil); third != second {
		t.Fatal("a broken certificate replaced a good one")
	}
}

// TestEventsNotHeld: the relay may coalesce events that arrive together
// into one write, but never holds an event while it waits for the engine.
func TestEventsNotHeld(t *testing.T) {
	got := make(chan struct{})
	eng := newServerNoCleanup(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != pathCompletions {
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for i := range 3 {
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"text\":\"t%d\"}]}\n\n", i)
			_ = rc.Flush()
			select { // the next event only after the client saw this one
			case <-got:
			case <-time.After(5 * time.Second):
				return
			}
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer eng.Close()
	cfg := testConfig(sched.RoundRobin)
	cfg.HealthCheckPath = healthCheckOff
	cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000}}
	_, url := startGateway(t, cfg)
	resp, err := testClient(t).Post(url+pathCompletions, "application/json", strings.NewReader(`{"model":"m","prompt":"x","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	for i := range 3 {
		line, err := br.ReadString('\n')
		if err != nil || !strings.Contains(line, fmt.Sprintf("t%d", i)) {
			t.Fatalf("event %d: %q %v", i, line, err)
		}
		_, _ = br.ReadString('\n') // blank line
		got <- struct{}{}
	}
	rest, _ := io.ReadAll(br)
	if !bytes.HasSuffix(rest, []byte("data: [DONE]\n\n")) {
		t.Fatalf("end of stream %q", rest)
	}
}
