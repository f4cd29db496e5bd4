package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// Test keys and their hashes.
const (
	keyAlice = "sk-alice-0123456789abcdef"
	keyBob   = "sk-bob-fedcba9876543210"
)

// authConfig returns a two-model gateway config (models m and other, one
// engine each) with keys: alice (model m only), bob (all models).
func authConfig(t *testing.T, e, f *fakeEngine) Config {
	cfg := testConfig(sched.RoundRobin, e)
	cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: f.URL(), Model: "other", KVBlocks: 1000})
	if err := cfg.Auth.AddKeys("alice plain:"+keyAlice+" models=m; bob plain:"+keyBob, "test"); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// send issues method path with body and headers (name, value pairs) and
// returns the response with its body read.
func send(t *testing.T, c *http.Client, method, url, body string, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	_, _ = buf.ReadFrom(resp.Body)
	return resp, buf.Bytes()
}

func TestAuthentication(t *testing.T) {
	e, f := newFakeEngine(t, "e0"), newFakeEngine(t, "e1")
	_, url := startGateway(t, authConfig(t, e, f))
	c := testClient(t)

	refused := []struct {
		name    string
		hdr     []string
		missing bool
	}{
		{"no key", nil, true},
		{"wrong key", []string{"Authorization", "Bearer sk-nope"}, false},
		{"empty bearer", []string{"Authorization", "Bearer "}, true},
		{"basic scheme", []string{"Authorization", "Basic " + keyAlice}, true},
		{"key without scheme", []string{"Authorization", keyAlice}, true},
		{"hash instead of key", []string{"Authorization", "Bearer " + auth.HashKey(keyAlice)}, false},
		{"wrong x-api-key", []string{"X-Api-Key", "sk-nope"}, false},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			for _, path := range []string{pathChat, pathModels, "/v1/anything"} {
				method := http.MethodPost
				if path == pathModels {
					method = http.MethodGet
				}
				resp, body := send(t, c, method, url+path, chatBody, tc.hdr...)
				if resp.StatusCode != http.StatusUnauthorized {
					t.Fatalf("%s: status %d, want 401: %s", path, resp.StatusCode, body)
				}
				oe := decodeError(t, body)
				if oe.Type != "invalid_request_error" || codeStr(oe.Code) != codeInvalidAPIKey {
					t.Errorf("%s: error %+v", path, oe)
				}
				if tc.missing != strings.Contains(oe.Message, "didn't provide") {
					t.Errorf("%s: message %q", path, oe.Message)
				}
				if resp.Header.Get("WWW-Authenticate") == "" || resp.Header.Get("X-Request-Id") == "" {
					t.Errorf("%s: WWW-Authenticate %q, X-Request-Id %q", path, resp.Header.Get("WWW-Authenticate"), resp.Header.Get("X-Request-Id"))
				}
			}
		})
	}
	if n := e.requests.Load() + f.requests.Load(); n != 0 {
		t.Fatalf("engines saw %d unauthenticated requests", n)
	}

	for _, hdr := range [][]string{
		{"Authorization", "Bearer " + keyAlice},
		{"Authorization", "bearer   " + keyAlice + " "},
		{"X-Api-Key", keyAlice},
	} {
		resp, body := send(t, c, http.MethodPost, url+pathChat, chatBody, append(hdr, "Content-Type", "application/json")...)
		if resp.StatusCode != 200 {
			t.Fatalf("%v: status %d: %s", hdr, resp.StatusCode, body)
		}
		h, _ := e.last()
		for _, k := range []string{"Authorization", "X-Api-Key"} {
			if v := h.Get(k); v != "" {
				t.Errorf("%s reached the engine: %q", k, v)
			}
		}
	}

	// Probes and metrics stay open.
	for _, path := range []string{pathHealthz, pathReadyz, pathMetrics} {
		if resp, body := send(t, c, http.MethodGet, url+path, ""); resp.StatusCode != 200 {
			t.Errorf("GET %s without a key: %d %s", path, resp.StatusCode, body)
		}
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_auth_failures_total", `reason="missing"`); v < 1 {
		t.Errorf("auth_failures_total{missing} = %v", v)
	}
	if v := m.value("infergate_requests_total", `code="401"`); v < 1 {
		t.Errorf("requests_total{code=401} = %v", v)
	}
}

func TestModelAccess(t *testing.T) {
	e, f := newFakeEngine(t, "e0"), newFakeEngine(t, "e1")
	_, url := startGateway(t, authConfig(t, e, f))
	c := testClient(t)
	alice := []string{"Authorization", "Bearer " + keyAlice}
	bob := []string{"Authorization", "Bearer " + keyBob}
	other := `{"model":"other","messages":[{"role":"user","content":"x"}]}`
	missing := `{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}`

	// A model the key may not use reads exactly like one that does not
	// exist (OpenAI's 404 model_not_found), so keys cannot probe the list.
	for _, body := range []string{other, missing} {
		resp, b := send(t, c, http.MethodPost, url+pathChat, body, alice...)
		oe := decodeError(t, b)
		if resp.StatusCode != 404 || codeStr(oe.Code) != openai.CodeModelNotFound || str(oe.Param) != "model" ||
			!strings.Contains(oe.Message, "does not exist or you do not have access to it") {
			t.Errorf("alice %s: %d %+v", body, resp.StatusCode, oe)
		}
	}
	if f.requests.Load() != 0 {
		t.Fatal("a refused request reached the engine")
	}
	if resp, b := send(t, c, http.MethodPost, url+pathChat, other, bob...); resp.StatusCode != 200 {
		t.Fatalf("bob: %d %s", resp.StatusCode, b)
	}

	models := func(hdr []string) []string {
		resp, b := send(t, c, http.MethodGet, url+pathModels, "", hdr...)
		if resp.StatusCode != 200 {
			t.Fatalf("models: %d %s", resp.StatusCode, b)
		}
		var list openai.ModelList
		if err := json.Unmarshal(b, &list); err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, m := range list.Data {
			ids = append(ids, m.ID)
		}
		return ids
	}
	if got := models(alice); len(got) != 1 || got[0] != "m" {
		t.Errorf("alice sees models %v, want [m]", got)
	}
	if got := models(bob); len(got) != 2 {
		t.Errorf("bob sees models %v, want both", got)
	}

	// GET /v1/models/{model} (OpenAI's retrieve model), filtered alike.
	for _, tc := range []struct {
		hdr    []string
		model  string
		status int
	}{{alice, "m", 200}, {alice, "other", 404}, {bob, "other", 200}, {bob, "gpt-9", 404}, {bob, "org/m", 404}} {
		resp, b := send(t, c, http.MethodGet, url+pathModels+"/"+tc.model, "", tc.hdr...)
		if resp.StatusCode != tc.status {
			t.Errorf("GET /v1/models/%s as %s: %d %s, want %d", tc.model, tc.hdr[1][7:12], resp.StatusCode, b, tc.status)
			continue
		}
		if tc.status == 404 {
			if oe := decodeError(t, b); codeStr(oe.Code) != openai.CodeModelNotFound {
				t.Errorf("GET /v1/models/%s: %+v", tc.model, oe)
			}
			continue
		}
		var m openai.Model
		if err := json.Unmarshal(b, &m); err != nil || m.ID != tc.model || m.Object != openai.ObjectModel {
			t.Errorf("GET /v1/models/%s: %s %v", tc.model, b, err)
		}
	}
	if resp, _ := send(t, c, http.MethodPost, url+pathModels+"/m", "", bob...); resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /v1/models/m: %d, want 405", resp.StatusCode)
	}
}

func TestAuthFailsClosed(t *testing.T) {
	cfg := testConfig(sched.RoundRobin, newFakeEngine(t, "e0"))
	if err := cfg.Auth.AddKeys("  \n", "env"); err != nil {
		t.Fatal(err)
	}
	g, url := startGateway(t, cfg)
	if !g.AuthEnabled() {
		t.Fatal("an empty key list turned authentication off")
	}
	if resp, _ := send(t, testClient(t), http.MethodPost, url+pathChat, chatBody, "Authorization", "Bearer x"); resp.StatusCode != 401 {
		t.Fatalf("status %d, want 401", resp.StatusCode)
	}
}

func TestKeysFile(t *testing.T) {
	e := newFakeEngine(t, "e0")
	dir := t.TempDir()
	path := filepath.Join(dir, "keys.yaml")
	if err := os.WriteFile(path, []byte("keys:\n  - {name: svc, hash: "+auth.HashKey(keyAlice)+"}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(sched.RoundRobin, e)
	cfg.Auth.KeysFile = path
	cfg.Auth.ProtectMetrics = true
	_, url := startGateway(t, cfg)
	c := testClient(t)
	if resp, b := send(t, c, http.MethodPost, url+pathChat, chatBody, "Authorization", "Bearer "+keyAlice); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if resp, _ := send(t, c, http.MethodGet, url+pathMetrics, ""); resp.StatusCode != 401 {
		t.Errorf("metrics without a key: %d, want 401 (protect_metrics)", resp.StatusCode)
	}
	if resp, _ := send(t, c, http.MethodGet, url+pathMetrics, "", "Authorization", "Bearer "+keyAlice); resp.StatusCode != 200 {
		t.Errorf("metrics with a key: %d", resp.StatusCode)
	}

	cfg.Auth.KeysFile = filepath.Join(dir, "missing.yaml")
	if _, err := New(context.Background(), cfg, nil); err == nil || !strings.Contains(err.Error(), "keys_file") {
		t.Errorf("missing keys file: %v", err)
	}
	_ = os.WriteFile(path, []byte("alice sha256:12"), 0o600)
	cfg.Auth.KeysFile = path
	if _, err := New(context.Background(), cfg, nil); err == nil || !strings.Contains(err.Error(), "hash") {
		t.Errorf("bad keys file: %v", err)
	}
}

// logCapture collects log records at every level.
type logCapture struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logCapture) Enabled(context.Context, slog.Level) bool { return true }
func (l *logCapture) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		l.buf.WriteString(" " + a.Key + "=" + a.Value.String())
		return true
	})
	l.buf.WriteByte('\n')
	return nil
}

// lines returns the captured records that contain sub, one per line.
func (l *logCapture) lines(sub string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, line := range strings.Split(l.buf.String(), "\n") {
		if strings.Contains(line, sub+" ") || strings.HasSuffix(line, sub) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}

func (l *logCapture) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logCapture) WithGroup(string) slog.Handler      { return l }

func TestKeysNeverLogged(t *testing.T) {
	lc := &logCapture{}
	prev := slog.Default()
	slog.SetDefault(slog.New(lc))
	t.Cleanup(func() { slog.SetDefault(prev) })

	e, f := newFakeEngine(t, "e0"), newFakeEngine(t, "e1")
	cfg := authConfig(t, e, f)
	cfg.Auth.Keys = append(cfg.Auth.Keys, auth.Key{Name: "ghost", Hash: auth.HashKey("sk-ghost"), Models: []string{"not-served"}})
	_, url := startGateway(t, cfg)
	c := testClient(t)
	send(t, c, http.MethodPost, url+pathChat, chatBody, "Authorization", "Bearer sk-wrong-secret")
	send(t, c, http.MethodPost, url+pathChat, chatBody, "Authorization", "Bearer "+keyAlice)
	e.mode.Store(int32(modeMidFail)) // provoke a warning that names the request
	send(t, c, http.MethodPost, url+pathChat, streamBody(false), "Authorization", "Bearer "+keyAlice)

	lc.mu.Lock()
	logs := lc.buf.String()
	lc.mu.Unlock()
	for _, secret := range []string{keyAlice, "sk-wrong-secret", "sk-ghost"} {
		if strings.Contains(logs, secret) {
			t.Errorf("log shows key %q:\n%s", secret, logs)
		}
	}
	if !strings.Contains(logs, "key=ghost") {
		t.Errorf("the warning about key ghost's model names the key: %s", logs)
	}
	if !strings.Contains(logs, "API key invalid") {
		t.Errorf("no debug record of the refused key: %s", logs)
	}
}
