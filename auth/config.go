// Package auth is the gateway's client API keys: their configuration and
// file formats (Config, Key, ParseKeys), the keyring that authenticates a
// presented key in constant time (Keyring, Principal), and each key's
// rate limits as token buckets (Limits). It knows nothing of serving:
// package gateway answers the 401s and 429s and counts the keys' usage
// (README.md).
package auth

import "fmt"

// EnvAPIKeys is the environment variable `infergate serve` reads API keys
// from (the keys-file format, entries also separated by ';').
const EnvAPIKeys = "INFERGATE_API_KEYS"

// Config turns on API-key authentication (gateway README "Security"): the
// gateway's YAML `auth:` section. With neither KeysFile nor Keys the
// gateway is open.
type Config struct {
	// KeysFile is a keys file (YAML or one key per line; see ParseKeys),
	// read by Load, so at start and again at every reload.
	KeysFile string `yaml:"keys_file"`
	// Keys are keys given inline (hashes only) or added from the
	// environment (AddKeys).
	Keys []Key `yaml:"keys"`
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
func (a Config) Enabled() bool { return a.KeysFile != "" || len(a.Keys) > 0 || a.fromEnv }

// AddKeys parses keys-file text (see ParseKeys; ';' also separates line
// entries) and appends its keys; source names it in errors. Plaintext keys
// are hashed here and not kept.
func (a *Config) AddKeys(text, source string) error {
	keys, err := ParseKeys([]byte(text), true)
	if err != nil {
		return fmt.Errorf("%s: %w", source, err)
	}
	a.Keys = append(a.Keys, keys...)
	a.fromEnv = true
	return nil
}

// Key is one client key: who it is, its hash, what it may use.
type Key struct {
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
