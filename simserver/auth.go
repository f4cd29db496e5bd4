package simserver

import (
	"crypto/sha256"
	"crypto/subtle"
	"net/http"
	"strings"
)

// EnvAPIKey is the environment variable vLLM reads its API key from when
// --api-key is not given (vllm/envs.py VLLM_API_KEY); `infergate sim` does
// the same.
const EnvAPIKey = "VLLM_API_KEY"

// unauthorizedBody is vLLM's answer to a request without a valid key:
// Starlette's JSONResponse({"error": "Unauthorized"}, status_code=401),
// compact JSON, Content-Type application/json, no WWW-Authenticate.
const unauthorizedBody = `{"error":"Unauthorized"}`

// apiKeyAuth is vLLM's AuthenticationMiddleware
// (vllm/entrypoints/openai/server_utils.py, added by api_server.py
// build_app when `args.api_key or [envs.VLLM_API_KEY]` holds a key; read
// at vllm-project/vllm commit 029329a8): the tokens are kept as SHA-256
// digests; a request is let through when its method is OPTIONS, or its path
// does not start with "/v1" (so /health and /metrics stay open, while every
// /v1 path, /v1/models included, is guarded: the check is a plain string
// prefix, "/v1x" included), or its Authorization header is "<scheme> <token>" with the scheme "bearer" in
// any case and the token, everything after the first space, one of the
// keys (compared digest to digest, constant-time, against every key).
// Otherwise it answers 401 unauthorizedBody. The simulator guards its P/D
// side channel (paths under /infergate/pd/) the same way.
type apiKeyAuth struct {
	next   http.Handler
	tokens [][sha256.Size]byte
}

// withAPIKeys wraps next in vLLM's API-key check; next itself when keys is
// empty (vLLM adds no middleware then).
func withAPIKeys(next http.Handler, keys []string) http.Handler {
	var tokens [][sha256.Size]byte
	for _, k := range keys {
		if k != "" { // vLLM drops empty keys: [key for key in ... if key]
			tokens = append(tokens, sha256.Sum256([]byte(k)))
		}
	}
	if len(tokens) == 0 {
		return next
	}
	return &apiKeyAuth{next: next, tokens: tokens}
}

func (a *apiKeyAuth) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodOptions || !guarded(r.URL.Path) || a.verify(r.Header) {
		a.next.ServeHTTP(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusUnauthorized)
	_, _ = w.Write([]byte(unauthorizedBody))
}

// guarded reports whether path needs a key: vLLM's "/v1" prefix, and the
// simulator's P/D side channel (pdchannel.go), which can release a hold.
func guarded(path string) bool {
	return strings.HasPrefix(path, "/v1") || strings.HasPrefix(path, pdPathPrefix)
}

// verify is vLLM's verify_token: the first Authorization header (Starlette's
// Headers.get), split at its first space (str.partition), scheme compared
// lower-cased with "bearer", the rest hashed and compared with every key.
func (a *apiKeyAuth) verify(h http.Header) bool {
	vs := h["Authorization"]
	if len(vs) == 0 || vs[0] == "" {
		return false
	}
	scheme, param, _ := strings.Cut(vs[0], " ")
	if strings.ToLower(scheme) != "bearer" {
		return false
	}
	sum := sha256.Sum256([]byte(param))
	match := 0
	for i := range a.tokens {
		match |= subtle.ConstantTimeCompare(sum[:], a.tokens[i][:])
	}
	return match == 1
}
