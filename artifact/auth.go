package artifact

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// Registry token authentication: the distribution project's token flow
// (distribution/distribution docs/spec/auth/token.md), which OCI registries
// (Docker Hub, GHCR, Harbor, ...) use even for anonymous pulls. A request
// answered 401 with
//
//	WWW-Authenticate: Bearer realm="https://auth/token",service="reg",scope="repository:ns/model:pull"
//
// is retried once with "Authorization: Bearer <token>", the token fetched
// from realm?service=...&scope=... (anonymously, or with HTTP.Username and
// Password as basic credentials) and kept per scope until it expires
// (expires_in, 60 s by default). Ollama's own registry signs its token
// requests with the user's ed25519 key (ollama/ollama server/auth.go
// @v0.17.4), which this does not do: a registry that demands that answers
// the token request 401 and the fetch fails with its status.

// maxTokenBytes bounds a token answer.
const maxTokenBytes = 64 << 10

// tokens caches bearer tokens by scope.
type tokens struct {
	mu sync.Mutex
	by map[string]token
}

type token struct {
	value   string
	expires time.Time
}

func (t *tokens) get(scope string, now time.Time) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if tk, ok := t.by[scope]; ok && now.Before(tk.expires) {
		return tk.value
	}
	return ""
}

func (t *tokens) put(scope, value string, expires time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.by == nil {
		t.by = map[string]token{}
	}
	if len(t.by) > 1024 { // bounded: scopes are per repository
		clear(t.by)
	}
	t.by[scope] = token{value, expires}
}

// parseChallenge reads a Bearer challenge's parameters (RFC 6750 §3,
// auth-param = token "=" quoted-string); ok is false for another scheme.
func parseChallenge(h string) (params map[string]string, ok bool) {
	scheme, rest, _ := strings.Cut(strings.TrimSpace(h), " ")
	if !strings.EqualFold(scheme, "Bearer") || len(h) > 4096 {
		return nil, false
	}
	params = map[string]string{}
	for rest = strings.TrimSpace(rest); rest != ""; {
		k, v, found := strings.Cut(rest, "=")
		if !found {
			break
		}
		k = strings.ToLower(strings.TrimSpace(k))
		v = strings.TrimSpace(v)
		if strings.HasPrefix(v, `"`) {
			end := strings.IndexByte(v[1:], '"')
			if end < 0 {
				return nil, false
			}
			params[k], rest = v[1:1+end], v[2+end:]
		} else {
			val, after, _ := strings.Cut(v, ",")
			params[k], rest = strings.TrimSpace(val), after
		}
		rest = strings.TrimLeft(strings.TrimSpace(rest), ",")
		rest = strings.TrimSpace(rest)
	}
	return params, params["realm"] != ""
}

// fetchToken asks a challenge's realm for a token.
func (h *HTTP) fetchToken(ctx context.Context, params map[string]string) (string, time.Time, error) {
	realm, err := url.Parse(params["realm"])
	if err != nil || (realm.Scheme != "https" && realm.Scheme != "http") {
		return "", time.Time{}, fmt.Errorf("artifact: token realm %.100q", params["realm"])
	}
	q := realm.Query()
	if s := params["service"]; s != "" {
		q.Set("service", s)
	}
	if s := params["scope"]; s != "" {
		q.Set("scope", s)
	}
	realm.RawQuery = q.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, realm.String(), nil)
	if err != nil {
		return "", time.Time{}, err
	}
	if h.Username != "" || h.Password != "" {
		// Credentials never go in clear to a realm of an https registry.
		if realm.Scheme != "https" && h.Base.Scheme == "https" {
			return "", time.Time{}, fmt.Errorf("artifact: token realm %s is not https; credentials withheld", realm.Redacted())
		}
		req.SetBasicAuth(h.Username, h.Password)
	}
	resp, err := h.Client.Do(req)
	if err != nil {
		return "", time.Time{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		drain(resp)
		return "", time.Time{}, &StatusError{Status: resp.StatusCode, URL: realm.Redacted()}
	}
	var ans struct {
		Token       string `json:"token"`
		AccessToken string `json:"access_token"`
		ExpiresIn   int    `json:"expires_in"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxTokenBytes)).Decode(&ans); err != nil {
		return "", time.Time{}, fmt.Errorf("artifact: token answer: %w", err)
	}
	tok := ans.Token
	if tok == "" {
		tok = ans.AccessToken
	}
	if tok == "" {
		return "", time.Time{}, fmt.Errorf("artifact: token answer from %s has no token", realm.Host)
	}
	ttl := 60 * time.Second
	if ans.ExpiresIn > 0 {
		ttl = time.Duration(min(ans.ExpiresIn, 86400)) * time.Second
	}
	// Renew a little early.
	return tok, time.Now().Add(ttl * 9 / 10), nil
}
