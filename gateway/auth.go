package gateway

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/openai"
)

// AuthConfig is the YAML `auth:` section: API keys (package auth).
type AuthConfig = auth.Config

// principal is an authenticated client as the gateway serves it: the key's
// auth.Principal (name, model grant, priority cap, rate limits) and what
// the gateway keeps for it.
type principal struct {
	*auth.Principal
	// modelsBody is GET /v1/models for this principal (nil: the full list).
	modelsBody []byte
	// usage are the key's usage counters (keyusage.go).
	usage *keyUsage
}

// keyring is the configured keys (auth.Keyring) with the gateway's
// principal of each.
type keyring struct {
	ring       *auth.Keyring
	principals []*principal // ring.Principals(), in order
	of         map[*auth.Principal]*principal
}

// newKeyring wraps ring's principals.
func newKeyring(ring *auth.Keyring) *keyring {
	aps := ring.Principals()
	kr := &keyring{ring: ring, principals: make([]*principal, len(aps)), of: make(map[*auth.Principal]*principal, len(aps))}
	for i, ap := range aps {
		kr.principals[i] = &principal{Principal: ap}
		kr.of[ap] = kr.principals[i]
	}
	return kr
}

// lookup returns the principal of a presented key, or nil
// (auth.Keyring.Lookup: constant-time).
func (kr *keyring) lookup(key string) *principal {
	if ap := kr.ring.Lookup(key); ap != nil {
		return kr.of[ap]
	}
	return nil
}

// authRing is kr's auth.Keyring (nil when kr is: authentication off).
func (kr *keyring) authRing() *auth.Keyring {
	if kr == nil {
		return nil
	}
	return kr.ring
}

// Codes of authentication and authorization errors.
const (
	codeInvalidAPIKey     = "invalid_api_key"
	codeRateLimitExceeded = "rate_limit_exceeded"
)

// authFailure is a 401 as OpenAI answers it: type invalid_request_error,
// code invalid_api_key.
func authFailure(missing bool) *openai.Error {
	msg := "Incorrect API key provided."
	if missing {
		msg = "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
	}
	return &openai.Error{Message: msg, Type: "invalid_request_error", Code: codeInvalidAPIKey, Status: http.StatusUnauthorized}
}

// protectedPath reports whether path needs a key: the API (/v1/…, and
// vLLM's /tokenize and /detokenize) always, /metrics and the dashboard's
// state (which shows what /metrics shows) with auth.protect_metrics;
// /healthz, /readyz (probes) and the dashboard page (no data) never.
func (st *state) protectedPath(path string) bool {
	return strings.HasPrefix(path, "/v1/") || path == pathTokenize || path == pathDetokenize ||
		((path == pathMetrics || path == pathDashboardState) && st.cfg.Auth.ProtectMetrics)
}

// authenticate checks the request's key against st's keys when
// authentication is on and the path is protected. It returns the principal
// (nil when auth is off or the path open) and false after answering 401.
func (g *Gateway) authenticate(w http.ResponseWriter, r *http.Request, st *state) (*principal, bool) {
	if st.keys == nil || !st.protectedPath(r.URL.Path) {
		return nil, true
	}
	key := auth.PresentedKey(r.Header)
	var p *principal
	if key != "" {
		p = st.keys.lookup(key)
	}
	if p != nil {
		if ow := observedFor(w); ow != nil {
			ow.key = p
		}
		return p, true
	}
	reason := "invalid"
	if key == "" {
		reason = "missing"
	}
	g.authFailures.WithLabelValues(reason).Inc()
	slog.Debug("gateway: request refused: API key "+reason, "remote", r.RemoteAddr, "path", r.URL.Path)
	w.Header().Set("WWW-Authenticate", `Bearer realm="infergate"`)
	closeUnread(w, r)                              // refused before its body is read
	w.Header().Set("X-Request-Id", g.requestID(r)) // to match the client's report with the gateway's
	openai.WriteError(w, authFailure(key == ""))
	observedFor(w).failed(codeInvalidAPIKey) // the access line's error, on every path
	if proxiedPath(r.URL.Path) {
		g.count(w, g.unknown, http.StatusUnauthorized)
	}
	return nil, false
}

// modelNotAllowed is OpenAI's answer for a model the key may not use: the
// same 404 model_not_found as for a model that does not exist, so a key
// cannot probe which models the gateway serves.
func modelNotAllowed(model string) *openai.Error {
	return openai.NewError(http.StatusNotFound,
		fmt.Sprintf("The model `%s` does not exist or you do not have access to it.", model), "model", openai.CodeModelNotFound)
}

// initModelLists prepares GET /v1/models for every principal restricted to
// some models: the full list filtered to those models.
func (kr *keyring) initModelLists(full []byte) error {
	var list openai.ModelList
	if err := json.Unmarshal(full, &list); err != nil {
		return err
	}
	for _, p := range kr.principals {
		if p.Models == nil {
			continue
		}
		own := list
		own.Data = nil
		for _, m := range list.Data {
			if p.Models[m.ID] {
				own.Data = append(own.Data, m)
			}
		}
		if own.Data == nil {
			own.Data = []openai.Model{}
		}
		b, err := json.Marshal(own)
		if err != nil {
			return err
		}
		p.modelsBody = b
	}
	return nil
}

// modelsBodyFor is GET /v1/models as the principal sees it.
func (st *state) modelsBodyFor(p *principal) []byte {
	if p == nil || p.modelsBody == nil {
		return st.modelsBody
	}
	return p.modelsBody
}

// buildKeys loads cfg's API keys for a new state (nil keyring when
// authentication is off), prev's buckets kept by key name, each key given
// its usage counters (by name, from usage), and warns of what looks like a
// mistake (a model allowed that targets, the models and aliases served, do
// not have).
func buildKeys(cfg Config, prev *state, targets map[string][]*pool, modelsBody []byte, usage *keyUsageVecs) (*keyring, []auth.LimitChange, error) {
	if !cfg.Auth.Enabled() {
		return nil, nil, nil
	}
	var old *keyring
	if prev != nil {
		old = prev.keys
	}
	ring, changes, err := auth.Load(cfg.Auth, old.authRing())
	if err != nil {
		return nil, nil, err
	}
	kr := newKeyring(ring)
	if err := kr.initModelLists(modelsBody); err != nil {
		return nil, nil, fmt.Errorf("gateway: model lists: %w", err)
	}
	if len(kr.principals) == 0 {
		slog.Warn("gateway: authentication is on but no API key is configured: every API request will be refused")
	}
	for _, p := range kr.principals {
		p.usage = usage.of(p.Name)
		for m := range p.Models {
			if targets[m] == nil {
				slog.Warn("gateway: API key allows a model no endpoint serves", "key", p.Name, "model", m)
			}
		}
	}
	return kr, changes, nil
}

// AuthEnabled reports whether API keys are required.
func (g *Gateway) AuthEnabled() bool { return g.state.Load().keys != nil }
