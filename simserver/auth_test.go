package simserver

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestAPIKeyAuth holds the simulator's --api-key to vLLM's
// AuthenticationMiddleware (simserver/auth.go): which paths it guards, which
// Authorization values pass, and the 401's exact shape.
func TestAPIKeyAuth(t *testing.T) {
	_, ts := newTestServer(t, ServerConfig{APIKeys: []string{"k1", "", "k2 with space"}})
	do := func(method, path, auth string) (int, http.Header, string) {
		t.Helper()
		var body io.Reader
		if method == http.MethodPost {
			body = strings.NewReader(`{"model":"` + testModel + `","prompt":"hi","max_tokens":1}`)
		}
		req, _ := http.NewRequest(method, ts.URL+path, body)
		req.Header.Set("Content-Type", "application/json")
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, string(b)
	}
	for _, tc := range []struct {
		method, path, auth string
		ok                 bool
	}{
		{"GET", "/health", "", true},  // not under /v1
		{"GET", "/metrics", "", true}, // not under /v1
		{"GET", "/v1/models", "", false},
		{"GET", "/v1/models", "Bearer k1", true},
		{"GET", "/v1/models", "bearer k1", true}, // scheme compared lower-cased
		{"GET", "/v1/models", "BeArEr k1", true},
		{"GET", "/v1/models", "Bearer k2 with space", true}, // the token is everything after the first space
		{"GET", "/v1/models", "Bearer  k1", false},          // ... so a second space is part of it
		{"GET", "/v1/models", "Bearer", false},
		{"GET", "/v1/models", "Bearer ", false}, // the empty key was dropped
		{"GET", "/v1/models", "Basic k1", false},
		{"GET", "/v1/models", "k1", false},
		{"GET", "/v1/models", "Bearer k3", false},
		{"POST", "/v1/completions", "", false},
		{"POST", "/v1/completions", "Bearer k2 with space", true},
		{"POST", "/v1/chat/completions", "Bearer nope", false},
		{"GET", "/v1/nothing", "", false}, // guarded before routing: 401, not 404
		{"GET", "/v1x", "", false},        // a plain prefix test, as vLLM's
		{"OPTIONS", "/v1/models", "", true},
	} {
		code, h, body := do(tc.method, tc.path, tc.auth)
		if tc.ok != (code != http.StatusUnauthorized) {
			t.Errorf("%s %s %q: %d %s", tc.method, tc.path, tc.auth, code, body)
		}
		if code == http.StatusUnauthorized && (body != `{"error":"Unauthorized"}` || h.Get("Content-Type") != "application/json" ||
			h.Get("WWW-Authenticate") != "") {
			t.Errorf("%s %s: 401 %v %q, want vLLM's {\"error\":\"Unauthorized\"}", tc.method, tc.path, h, body)
		}
	}
	// No key, no check (vLLM adds no middleware; empty keys are dropped).
	_, open := newTestServer(t, ServerConfig{APIKeys: []string{""}})
	resp, err := http.Get(open.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("no keys: /v1/models %d", resp.StatusCode)
	}
}

// FuzzAPIKeyAuth: whatever the header and path, the check does not panic,
// and lets a /v1 request through only with a Bearer scheme and the key.
func FuzzAPIKeyAuth(f *testing.F) {
	const key = "sk-test"
	for _, s := range []string{"Bearer sk-test", "bearer sk-test", "Bearer  sk-test", "Bearer sk-test\x00", "Bearer", " ",
		"Bearer sk-tes", "Bearer sk-test, Bearer x", "Bearer \xff\xfe", "Ｂearer sk-test", strings.Repeat("Bearer ", 1000)} {
		f.Add(s, "/v1/models")
	}
	f.Add("", "/health")
	f.Add("", "/v1")
	f.Add("x", "/V1/models")
	f.Add("", "/infergate/pd/v1/release")
	f.Add("Bearer sk-test", "/infergate/pd/v1/read")
	h := withAPIKeys(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(299) }), []string{key})
	f.Fuzz(func(t *testing.T, auth, path string) {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.URL.Path = path
		r.Header["Authorization"] = []string{auth}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		passed := w.Code == 299
		// vLLM's /v1 prefix, and the simulator's P/D side channel.
		guarded := strings.HasPrefix(path, "/v1") || strings.HasPrefix(path, "/infergate/pd/")
		if !guarded && !passed {
			t.Fatalf("%q refused outside /v1 and /infergate/pd/", path)
		}
		if guarded && passed && (len(auth) != len("Bearer ")+len(key) || !strings.EqualFold(auth[:6], "bearer") || auth[6:] != " "+key) {
			t.Fatalf("%q let through with Authorization %q", path, auth)
		}
		if guarded && !passed && (w.Code != http.StatusUnauthorized || w.Body.String() != unauthorizedBody) {
			t.Fatalf("refusal %d %q", w.Code, w.Body.String())
		}
	})
}
