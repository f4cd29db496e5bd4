package gateway

import (
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/infergate/infergate/openai"
)

// EnvAPIKeys is the environment variable `infergate serve` reads API keys
// from (the keys-file format, entries also separated by ';').
const EnvAPIKeys = "INFERGATE_API_KEYS"

// AuthConfig turns on API-key authentication (README "Security"). With
// neither KeysFile nor Keys the gateway is open.
type AuthConfig struct {
	// KeysFile is a keys file (YAML or one key per line; see ParseKeys),
	// read by New and again at every reload.
	KeysFile string `yaml:"keys_file"`
	// Keys are keys given inline (hashes only) or added from the
	// environment (AddKeys).
	Keys []APIKey `yaml:"keys"`
	// ProtectMetrics requires a valid key for GET /metrics too (any key;
	// Prometheus sends it with `authorization: {credentials: …}`).
	ProtectMetrics bool `yaml:"protect_metrics"`

	// fromEnv records that AddKeys was called, so an empty environment
	// value still turns authentication on (and refuses every request).
	fromEnv bool
}

// Enabled reports whether authentication is configured: a keys file, keys,
// or a (possibly empty) key list added with AddKeys. An enabled gateway with
// no keys refuses every API request (fail closed).
func (a AuthConfig) Enabled() bool { return a.KeysFile != "" || len(a.Keys) > 0 || a.fromEnv }

// AddKeys parses keys-file text (see ParseKeys; ';' also separates line
// entries) and appends its keys; source names it in errors. Plaintext keys
// are hashed here and not kept.
func (a *AuthConfig) AddKeys(text, source string) error {
	keys, err := ParseKeys([]byte(text), true)
	if err != nil {
		return fmt.Errorf("%s: %w", source, err)
	}
	a.Keys = append(a.Keys, keys...)
	a.fromEnv = true
	return nil
}

// APIKey is one client key: who it is, its hash, what it may use.
type APIKey struct {
	// Name identifies the key in logs, metrics and errors (1–64 characters
	// of [A-Za-z0-9._@-]); the key itself is never logged. Entries with the
	// same name (old and new key during a rotation) must have the same
	// models and limits, and share one set of rate limits.
	Name string `yaml:"name"`
	// Hash is "sha256:" and the lowercase hex SHA-256 of the key (a bare
	// 64-digit hex string is accepted too): `infergate keys hash`, or
	// `printf %s "$KEY" | sha256sum`.
	Hash string `yaml:"hash"`
	// Models are the models the key may use; empty means all.
	Models []string `yaml:"models"`
	// RequestsPerMinute limits the key's inference requests (0: no limit).
	RequestsPerMinute int `yaml:"requests_per_minute"`
	// TokensPerMinute limits the key's prompt + completion tokens (0: no
	// limit).
	TokensPerMinute int `yaml:"tokens_per_minute"`
	// MaxPriority caps the admission priority of the key's requests: an
	// X-Priority header above it is lowered to it (nil: no cap), so a
	// client cannot jump the queue beyond what its key was granted.
	MaxPriority *int `yaml:"max_priority"`
}

// HashKey returns the stored form of a plaintext key: "sha256:<hex>".
func HashKey(key string) string {
	sum := sha256.Sum256([]byte(key))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// parseHash decodes an APIKey.Hash.
func parseHash(s string) ([sha256.Size]byte, error) {
	var h [sha256.Size]byte
	hx := strings.TrimPrefix(s, "sha256:")
	if len(hx) != 2*sha256.Size {
		return h, fmt.Errorf("hash: want sha256:<64 hex digits>, got %d characters", len(s))
	}
	if _, err := hex.Decode(h[:], []byte(hx)); err != nil {
		return h, errors.New("hash: not hexadecimal")
	}
	return h, nil
}

// validKeyName: 1–64 characters of [A-Za-z0-9._@-] (safe in logs and as a
// label value).
func validKeyName(s string) bool {
	if len(s) == 0 || len(s) > 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-' || c == '@') {
			return false
		}
	}
	return true
}

// maxKeysFile bounds a keys file or environment value (bytes).
const maxKeysFile = 16 << 20

// ParseKeys reads a keys file. Two formats:
//
// YAML, a list under "keys" (or a bare list):
//
//	keys:
//	  - name: team-a
//	    hash: sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//	    models: [meta-llama/Llama-3.1-8B-Instruct]
//	    requests_per_minute: 600
//	    tokens_per_minute: 200000
//
// or one key per line, blank lines and "#" comments ignored:
//
//	# name  hash  [models=a,b] [rpm=N] [tpm=N]
//	team-a sha256:9f86d08… models=meta-llama/Llama-3.1-8B-Instruct rpm=600 tpm=200000
//
// In either format a plaintext key may be given instead of the hash (YAML
// "key: …"; line "plain:…"); it is hashed at once. With semicolons, ';'
// also ends a line entry (for environment variables). The result is
// validated (names, hashes, limits, duplicates).
func ParseKeys(data []byte, semicolons bool) ([]APIKey, error) {
	if len(data) > maxKeysFile {
		return nil, fmt.Errorf("keys: %d bytes, over the limit of %d", len(data), maxKeysFile)
	}
	var keys []APIKey
	var err error
	if looksLikeYAML(data) {
		keys, err = parseKeysYAML(data)
	} else {
		keys, err = parseKeysLines(data, semicolons)
	}
	if err != nil {
		return nil, err
	}
	if err := validateKeys(keys); err != nil {
		return nil, err
	}
	return keys, nil
}

// looksLikeYAML reports whether the first significant line starts a YAML
// mapping with "keys:", a YAML list or a flow collection.
func looksLikeYAML(data []byte) bool {
	for line := range bytes.SplitSeq(data, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		return bytes.HasPrefix(line, []byte("keys:")) || bytes.HasPrefix(line, []byte("- ")) ||
			bytes.Equal(line, []byte("-")) || line[0] == '{' || line[0] == '['
	}
	return false
}

// yamlKey is one YAML entry: APIKey plus an optional plaintext key.
type yamlKey struct {
	Name              string   `yaml:"name"`
	Hash              string   `yaml:"hash"`
	Key               string   `yaml:"key"`
	Models            []string `yaml:"models"`
	RequestsPerMinute int      `yaml:"requests_per_minute"`
	TokensPerMinute   int      `yaml:"tokens_per_minute"`
	MaxPriority       *int     `yaml:"max_priority"`
}

func parseKeysYAML(data []byte) ([]APIKey, error) {
	var list []yamlKey
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var err error
	if firstLineIsList(data) {
		err = dec.Decode(&list)
	} else {
		var doc struct {
			Keys []yamlKey `yaml:"keys"`
		}
		err = dec.Decode(&doc)
		list = doc.Keys
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("keys: %w", err)
	}
	keys := make([]APIKey, 0, len(list))
	for i, k := range list {
		at := fmt.Sprintf("keys[%d]", i)
		switch {
		case k.Key != "" && k.Hash != "":
			return nil, fmt.Errorf("%s (%s): give key or hash, not both", at, k.Name)
		case k.Key != "":
			k.Hash = HashKey(k.Key)
		}
		keys = append(keys, APIKey{Name: k.Name, Hash: k.Hash, Models: k.Models,
			RequestsPerMinute: k.RequestsPerMinute, TokensPerMinute: k.TokensPerMinute, MaxPriority: k.MaxPriority})
	}
	return keys, nil
}

// firstLineIsList reports whether the first significant line is a list item.
func firstLineIsList(data []byte) bool {
	for line := range bytes.SplitSeq(data, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		return line[0] == '-' || line[0] == '['
	}
	return false
}

func parseKeysLines(data []byte, semicolons bool) ([]APIKey, error) {
	var keys []APIKey
	for n, line := range strings.Split(string(data), "\n") {
		entries := []string{line}
		if semicolons {
			entries = strings.Split(line, ";")
		}
		for _, e := range entries {
			if i := strings.IndexByte(e, '#'); i >= 0 {
				e = e[:i]
			}
			fields := strings.Fields(e)
			if len(fields) == 0 {
				continue
			}
			at := fmt.Sprintf("line %d", n+1)
			if len(fields) < 2 {
				return nil, fmt.Errorf("keys %s: want NAME HASH [models=a,b] [rpm=N] [tpm=N] [max_priority=N]", at)
			}
			k := APIKey{Name: fields[0], Hash: fields[1]}
			if plain, ok := strings.CutPrefix(fields[1], "plain:"); ok {
				if plain == "" {
					return nil, fmt.Errorf("keys %s (%s): empty plain: key", at, k.Name)
				}
				k.Hash = HashKey(plain)
			}
			for _, opt := range fields[2:] {
				name, val, ok := strings.Cut(opt, "=")
				if !ok {
					return nil, fmt.Errorf("keys %s (%s): option %q: want name=value", at, k.Name, opt)
				}
				switch name {
				case "models":
					for m := range strings.SplitSeq(val, ",") {
						if m != "" {
							k.Models = append(k.Models, m)
						}
					}
				case "rpm", "tpm":
					v, err := strconv.Atoi(val)
					if err != nil {
						return nil, fmt.Errorf("keys %s (%s): %s=%q: not an integer", at, k.Name, name, val)
					}
					if name == "rpm" {
						k.RequestsPerMinute = v
					} else {
						k.TokensPerMinute = v
					}
				case "max_priority":
					v, err := strconv.Atoi(val)
					if err != nil {
						return nil, fmt.Errorf("keys %s (%s): %s=%q: not an integer", at, k.Name, name, val)
					}
					k.MaxPriority = &v
				default:
					return nil, fmt.Errorf("keys %s (%s): unknown option %q (want models, rpm, tpm, max_priority)", at, k.Name, name)
				}
			}
			keys = append(keys, k)
		}
	}
	return keys, nil
}

// maxKeyLimit bounds requests_per_minute and tokens_per_minute (1e12: far
// above any real limit, small enough for exact float64 bucket arithmetic).
const maxKeyLimit = 1_000_000_000_000

// validateKeys checks names, hashes and limits, that no hash appears twice
// and that entries sharing a name agree.
func validateKeys(keys []APIKey) error {
	var errs []error
	seen := map[[sha256.Size]byte]string{}
	byName := map[string]APIKey{}
	for i, k := range keys {
		at := fmt.Sprintf("keys[%d]", i)
		if !validKeyName(k.Name) {
			errs = append(errs, fmt.Errorf("%s: name %q: want 1-64 characters of [A-Za-z0-9._@-]", at, k.Name))
			continue
		}
		at += " (" + k.Name + ")"
		h, err := parseHash(k.Hash)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", at, err))
			continue
		}
		if other, dup := seen[h]; dup {
			errs = append(errs, fmt.Errorf("%s: same key as %s", at, other))
		}
		seen[h] = k.Name
		if k.RequestsPerMinute < 0 || k.RequestsPerMinute > maxKeyLimit || k.TokensPerMinute < 0 || k.TokensPerMinute > maxKeyLimit {
			errs = append(errs, fmt.Errorf("%s: requests_per_minute and tokens_per_minute must be 0 (no limit) to %d", at, maxKeyLimit))
		}
		for _, m := range k.Models {
			if m == "" {
				errs = append(errs, fmt.Errorf("%s: empty model name", at))
			}
		}
		if prev, ok := byName[k.Name]; ok && !sameGrant(prev, k) {
			errs = append(errs, fmt.Errorf("%s: listed again with different models, limits or max_priority (entries sharing a name share them)", at))
		}
		byName[k.Name] = k
	}
	return errors.Join(errs...)
}

func sameGrant(a, b APIKey) bool {
	am, bm := slices.Clone(a.Models), slices.Clone(b.Models)
	slices.Sort(am)
	slices.Sort(bm)
	return slices.Equal(slices.Compact(am), slices.Compact(bm)) &&
		a.RequestsPerMinute == b.RequestsPerMinute && a.TokensPerMinute == b.TokensPerMinute &&
		(a.MaxPriority == nil) == (b.MaxPriority == nil) && (a.MaxPriority == nil || *a.MaxPriority == *b.MaxPriority)
}

// principal is an authenticated client: one per key name.
type principal struct {
	name   string
	models map[string]bool // nil: every model
	// limits are the key's buckets (nil: no limit), kept by name across
	// reloads; rpm and tpm are the configured limits.
	limits   *keyLimits
	rpm, tpm int
	// capPriority: the key's requests queue at most at maxPriority.
	capPriority bool
	maxPriority int
	// modelsBody is GET /v1/models for this principal (nil: the full list).
	modelsBody []byte
	// usage are the key's usage counters (keyusage.go).
	usage *keyUsage
}

// allows reports whether the principal may use model.
func (p *principal) allows(model string) bool { return p.models == nil || p.models[model] }

// keyring holds the hashes of the configured keys. Plaintext keys are never
// stored.
type keyring struct {
	byHash     map[[sha256.Size]byte]*keyEntry
	principals []*principal
}

// keyEntry is one stored key hash and whose it is.
type keyEntry struct {
	hash [sha256.Size]byte
	p    *principal
}

// limitChange is a key whose limits a reload changes: applied to its
// buckets, which it keeps, when the reload commits (keyLimits.setLimits).
type limitChange struct {
	kl       *keyLimits
	rpm, tpm int
}

// loadKeys builds the keyring from the keys file and the inline/added keys.
// A key whose name prev (the keyring in force, nil at start) has keeps its
// rate-limit buckets, whatever its hashes: the bucket state survives a
// reload (starting it full again would let the key exceed its limit), and
// changes names the keys whose limits are to change.
func loadKeys(a AuthConfig, prev *keyring) (kr *keyring, changes []limitChange, err error) {
	keys := slices.Clone(a.Keys)
	if a.KeysFile != "" {
		data, err := os.ReadFile(a.KeysFile)
		if err != nil {
			return nil, nil, fmt.Errorf("auth.keys_file: %w", err)
		}
		fk, err := ParseKeys(data, false)
		if err != nil {
			return nil, nil, fmt.Errorf("auth.keys_file %s: %w", a.KeysFile, err)
		}
		keys = append(keys, fk...)
	}
	if err := validateKeys(keys); err != nil {
		return nil, nil, fmt.Errorf("auth: %w", err)
	}
	old := map[string]*principal{}
	if prev != nil {
		for _, p := range prev.principals {
			old[p.name] = p
		}
	}
	kr = &keyring{byHash: make(map[[sha256.Size]byte]*keyEntry, len(keys))}
	byName := map[string]*principal{}
	for _, k := range keys {
		h, _ := parseHash(k.Hash) // validated
		p := byName[k.Name]
		if p == nil {
			p = &principal{name: k.Name, rpm: k.RequestsPerMinute, tpm: k.TokensPerMinute}
			switch o := old[k.Name]; {
			case p.rpm <= 0 && p.tpm <= 0: // no limit
			case o != nil && o.limits != nil:
				p.limits = o.limits
				if o.rpm != p.rpm || o.tpm != p.tpm {
					changes = append(changes, limitChange{kl: p.limits, rpm: p.rpm, tpm: p.tpm})
				}
			default:
				p.limits = newKeyLimits(p.rpm, p.tpm)
			}
			if k.MaxPriority != nil {
				p.capPriority, p.maxPriority = true, *k.MaxPriority
			}
			if len(k.Models) > 0 {
				p.models = make(map[string]bool, len(k.Models))
				for _, m := range k.Models {
					p.models[m] = true
				}
			}
			byName[k.Name] = p
			kr.principals = append(kr.principals, p)
		}
		kr.byHash[h] = &keyEntry{hash: h, p: p}
	}
	return kr, changes, nil
}

// lookup returns the principal of a presented key, or nil. The presented
// key is hashed first, so the map lookup's timing can only depend on the
// hash of the guess, which tells an attacker nothing usable about any stored
// key (learning a stored hash does not yield a key: keys are high-entropy
// and SHA-256 has no known preimage attack); the final comparison is
// constant-time as well, so no byte-wise comparison of secrets happens
// anywhere on this path.
func (kr *keyring) lookup(key string) *principal {
	h := sha256.Sum256([]byte(key))
	if e := kr.byHash[h]; e != nil && subtle.ConstantTimeCompare(e.hash[:], h[:]) == 1 {
		return e.p
	}
	return nil
}

// presentedKey returns the API key a request carries: "Authorization:
// Bearer <key>" (scheme case-insensitive), else "x-api-key: <key>"; "" if
// none.
func presentedKey(r *http.Request) string {
	if v := r.Header["Authorization"]; len(v) > 0 {
		scheme, tok, ok := strings.Cut(strings.TrimSpace(v[0]), " ")
		if ok && strings.EqualFold(scheme, "Bearer") {
			return strings.TrimSpace(tok)
		}
		return ""
	}
	if v := r.Header["X-Api-Key"]; len(v) > 0 {
		return strings.TrimSpace(v[0])
	}
	return ""
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
	key := presentedKey(r)
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
		if p.models == nil {
			continue
		}
		own := list
		own.Data = nil
		for _, m := range list.Data {
			if p.models[m.ID] {
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
func buildKeys(cfg Config, prev *state, targets map[string][]*pool, modelsBody []byte, usage *keyUsageVecs) (*keyring, []limitChange, error) {
	if !cfg.Auth.Enabled() {
		return nil, nil, nil
	}
	var old *keyring
	if prev != nil {
		old = prev.keys
	}
	kr, changes, err := loadKeys(cfg.Auth, old)
	if err != nil {
		return nil, nil, err
	}
	if err := kr.initModelLists(modelsBody); err != nil {
		return nil, nil, fmt.Errorf("gateway: model lists: %w", err)
	}
	if len(kr.principals) == 0 {
		slog.Warn("gateway: authentication is on but no API key is configured: every API request will be refused")
	}
	for _, p := range kr.principals {
		p.usage = usage.of(p.name)
		for m := range p.models {
			if targets[m] == nil {
				slog.Warn("gateway: API key allows a model no endpoint serves", "key", p.name, "model", m)
			}
		}
	}
	return kr, changes, nil
}

// AuthEnabled reports whether API keys are required.
func (g *Gateway) AuthEnabled() bool { return g.state.Load().keys != nil }
