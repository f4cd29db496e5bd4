package auth

import (
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/infergate/infergate/internal/boundedfile"
)

// Principal is an authenticated client: one per key name, whatever the
// number of its keys (a rotation lists one name twice). Load sets its
// fields; they are read-only after.
type Principal struct {
	// Name is the key's configured name (Key.Name).
	Name string
	// Models are the models the key may use (nil: every model).
	Models map[string]bool
	// Limits are the key's rate-limit buckets (nil: no limit), kept by name
	// across reloads.
	Limits *Limits
	// CapPriority: the key's requests queue at most at MaxPriority.
	CapPriority bool
	MaxPriority int

	// rpm and tpm are the configured limits (Key.RequestsPerMinute,
	// Key.TokensPerMinute).
	rpm, tpm int
}

// Allows reports whether the principal may use model.
func (p *Principal) Allows(model string) bool { return p.Models == nil || p.Models[model] }

// Keyring holds the hashes of the configured keys and their principals.
// Plaintext keys are never stored.
type Keyring struct {
	byHash     map[[sha256.Size]byte]*keyEntry
	principals []*Principal
}

// keyEntry is one stored key hash and whose it is.
type keyEntry struct {
	hash [sha256.Size]byte
	p    *Principal
}

// Principals are the keyring's principals, in the order their names first
// appear in the configuration (Config.Keys, then the keys file). The slice
// is the keyring's own: not to be changed.
func (kr *Keyring) Principals() []*Principal { return kr.principals }

// LimitChange is a key whose limits a reload changes: applied to its
// buckets, which it keeps, when the reload commits (Apply).
type LimitChange struct {
	limits   *Limits
	rpm, tpm int
}

// Apply changes the key's per-minute limits at now, keeping what the key
// has used of them (Limits.setLimits).
func (c LimitChange) Apply(now time.Time) { c.limits.setLimits(c.rpm, c.tpm, now) }

// Load builds the keyring from the keys file and the inline/added keys.
// A key whose name prev (the keyring in force, nil at start) has keeps its
// rate-limit buckets, whatever its hashes: the bucket state survives a
// reload (starting it full again would let the key exceed its limit), and
// changes names the keys whose limits are to change. Load does not look at
// a.Enabled: a Config without keys gives an empty keyring, which refuses
// every key.
func Load(a Config, prev *Keyring) (kr *Keyring, changes []LimitChange, err error) {
	keys := slices.Clone(a.Keys)
	if a.KeysFile != "" {
		data, err := boundedfile.Read(a.KeysFile, maxKeysFile) // ParseKeys's bound, before a byte past it is read
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
	old := map[string]*Principal{}
	if prev != nil {
		for _, p := range prev.principals {
			old[p.Name] = p
		}
	}
	kr = &Keyring{byHash: make(map[[sha256.Size]byte]*keyEntry, len(keys))}
	byName := map[string]*Principal{}
	for _, k := range keys {
		h, _ := parseHash(k.Hash) // validated
		p := byName[k.Name]
		if p == nil {
			p = &Principal{Name: k.Name, rpm: k.RequestsPerMinute, tpm: k.TokensPerMinute}
			switch o := old[k.Name]; {
			case p.rpm <= 0 && p.tpm <= 0: // no limit
			case o != nil && o.Limits != nil:
				p.Limits = o.Limits
				if o.rpm != p.rpm || o.tpm != p.tpm {
					changes = append(changes, LimitChange{limits: p.Limits, rpm: p.rpm, tpm: p.tpm})
				}
			default:
				p.Limits = newLimits(p.rpm, p.tpm)
			}
			if k.MaxPriority != nil {
				p.CapPriority, p.MaxPriority = true, *k.MaxPriority
			}
			if len(k.Models) > 0 {
				p.Models = make(map[string]bool, len(k.Models))
				for _, m := range k.Models {
					p.Models[m] = true
				}
			}
			byName[k.Name] = p
			kr.principals = append(kr.principals, p)
		}
		kr.byHash[h] = &keyEntry{hash: h, p: p}
	}
	return kr, changes, nil
}

// Lookup returns the principal of a presented key, or nil. The presented
// key is hashed first, so the map lookup's timing can only depend on the
// hash of the guess, which tells an attacker nothing usable about any stored
// key (learning a stored hash does not yield a key: keys are high-entropy
// and SHA-256 has no known preimage attack); the final comparison is
// constant-time as well, so no byte-wise comparison of secrets happens
// anywhere on this path.
func (kr *Keyring) Lookup(key string) *Principal {
	h := sha256.Sum256([]byte(key))
	if e := kr.byHash[h]; e != nil && subtle.ConstantTimeCompare(e.hash[:], h[:]) == 1 {
		return e.p
	}
	return nil
}

// PresentedKey returns the API key request headers h carry:
// "Authorization: Bearer <key>" (scheme case-insensitive), else
// "x-api-key: <key>"; "" if none. h is read with canonical names, as
// net/http stores a server request's headers.
func PresentedKey(h http.Header) string {
	if v := h["Authorization"]; len(v) > 0 {
		scheme, tok, ok := strings.Cut(strings.TrimSpace(v[0]), " ")
		if ok && strings.EqualFold(scheme, "Bearer") {
			return strings.TrimSpace(tok)
		}
		return ""
	}
	if v := h["X-Api-Key"]; len(v) > 0 {
		return strings.TrimSpace(v[0])
	}
	return ""
}

// Changes names the keys added, removed and changed (hashes, models,
// limits or priority cap) between two keyrings (nil: authentication off,
// no keys), each list sorted by name.
func Changes(old, cur *Keyring) (added, removed, changed []string) {
	by := func(kr *Keyring) map[string]*Principal {
		m := map[string]*Principal{}
		if kr != nil {
			for _, p := range kr.principals {
				m[p.Name] = p
			}
		}
		return m
	}
	hashes := func(kr *Keyring, p *Principal) []string {
		var hs []string
		for _, e := range kr.byHash {
			if e.p == p {
				hs = append(hs, string(e.hash[:]))
			}
		}
		slices.Sort(hs)
		return hs
	}
	om, cm := by(old), by(cur)
	for _, name := range slices.Sorted(maps.Keys(cm)) {
		o, c := om[name], cm[name]
		switch {
		case o == nil:
			added = append(added, name)
		case !maps.Equal(o.Models, c.Models) || o.rpm != c.rpm || o.tpm != c.tpm ||
			o.CapPriority != c.CapPriority || o.MaxPriority != c.MaxPriority ||
			!slices.Equal(hashes(old, o), hashes(cur, c)):
			changed = append(changed, name)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(om)) {
		if cm[name] == nil {
			removed = append(removed, name)
		}
	}
	return added, removed, changed
}
