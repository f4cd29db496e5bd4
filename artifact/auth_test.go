package artifact

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

func TestParseChallenge(t *testing.T) {
	p, ok := parseChallenge(`Bearer realm="https://auth.example/token",service="registry.example",scope="repository:library/tiny:pull"`)
	if !ok || p["realm"] != "https://auth.example/token" || p["service"] != "registry.example" || p["scope"] != "repository:library/tiny:pull" {
		t.Fatalf("%v %v", p, ok)
	}
	if p, ok := parseChallenge(`bearer realm=https://a/t, service=s`); !ok || p["service"] != "s" || p["realm"] != "https://a/t" {
		t.Fatalf("unquoted: %v %v", p, ok)
	}
	for _, h := range []string{"", `Basic realm="x"`, `Bearer realm="unterminated`, `Bearer service="s"`, "Bearer " + strings.Repeat("a=b,", 2000)} {
		if _, ok := parseChallenge(h); ok {
			t.Errorf("%q accepted", h)
		}
	}
}

// TestRegistryTokenAuth: a registry that answers 401 with a Bearer
// challenge is pulled from with a token fetched once from its realm.
func TestRegistryTokenAuth(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {40_000}})
	a, _ := servedCache(t, o)
	var tokenGets atomic.Int32
	reg := NewServer(a, ServerConfig{})
	var srv *httptest.Server
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/token" {
			tokenGets.Add(1)
			if r.URL.Query().Get("scope") != "repository:library/tiny:pull" || r.URL.Query().Get("service") != "test" {
				http.Error(w, "bad scope", 400)
				return
			}
			fmt.Fprint(w, `{"token":"t1","expires_in":300}`)
			return
		}
		if r.Header.Get("Authorization") != "Bearer t1" {
			w.Header().Set("WWW-Authenticate", `Bearer realm="`+srv.URL+`/token",service="test",scope="repository:library/tiny:pull"`)
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		reg.ServeHTTP(w, r)
	}))
	defer srv.Close()
	src, _ := NewHTTP(srv.URL, LayoutRegistry, false)
	c := openCache(t, Config{Origins: []Source{src}})
	if _, err := c.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{}); err != nil {
		t.Fatal(err)
	}
	checkHeld(t, c, o, o.models[tinyRef])
	if n := tokenGets.Load(); n != 1 {
		t.Errorf("%d token requests for one scope, want 1", n)
	}
	// A realm that refuses: the fetch fails with its status, no retry storm.
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/token" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		w.Header().Set("WWW-Authenticate", `Bearer realm="http://`+r.Host+`/token"`)
		w.WriteHeader(http.StatusUnauthorized)
	}))
	defer bad.Close()
	src2, _ := NewHTTP(bad.URL, LayoutRegistry, false)
	c2 := openCache(t, Config{Origins: []Source{src2}})
	_, err := c2.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{})
	var se *StatusError
	if err == nil || !strings.Contains(err.Error(), "401") {
		t.Fatalf("want a 401, got %v (%T)", err, se)
	}
}
