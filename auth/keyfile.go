package auth

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

// HashKey returns the stored form of a plaintext key: "sha256:<hex>".
func HashKey(key string) string {
	sum := sha256.Sum256([]byte(key))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// parseHash decodes a Key.Hash.
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
func ParseKeys(data []byte, semicolons bool) ([]Key, error) {
	if len(data) > maxKeysFile {
		return nil, fmt.Errorf("keys: %d bytes, over the limit of %d", len(data), maxKeysFile)
	}
	var keys []Key
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

// yamlKey is one YAML entry: Key plus an optional plaintext key.
type yamlKey struct {
	Name              string   `yaml:"name"`
	Hash              string   `yaml:"hash"`
	Key               string   `yaml:"key"`
	Models            []string `yaml:"models"`
	RequestsPerMinute int      `yaml:"requests_per_minute"`
	TokensPerMinute   int      `yaml:"tokens_per_minute"`
	MaxPriority       *int     `yaml:"max_priority"`
}

func parseKeysYAML(data []byte) ([]Key, error) {
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
	keys := make([]Key, 0, len(list))
	for i, k := range list {
		at := fmt.Sprintf("keys[%d]", i)
		switch {
		case k.Key != "" && k.Hash != "":
			return nil, fmt.Errorf("%s (%s): give key or hash, not both", at, k.Name)
		case k.Key != "":
			k.Hash = HashKey(k.Key)
		}
		keys = append(keys, Key{Name: k.Name, Hash: k.Hash, Models: k.Models,
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

func parseKeysLines(data []byte, semicolons bool) ([]Key, error) {
	var keys []Key
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
			k := Key{Name: fields[0], Hash: fields[1]}
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
func validateKeys(keys []Key) error {
	var errs []error
	seen := map[[sha256.Size]byte]string{}
	byName := map[string]Key{}
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

// sameGrant reports whether two entries grant the same models, limits and
// priority cap (models compared as sets).
func sameGrant(a, b Key) bool {
	am, bm := slices.Clone(a.Models), slices.Clone(b.Models)
	slices.Sort(am)
	slices.Sort(bm)
	return slices.Equal(slices.Compact(am), slices.Compact(bm)) &&
		a.RequestsPerMinute == b.RequestsPerMinute && a.TokensPerMinute == b.TokensPerMinute &&
		(a.MaxPriority == nil) == (b.MaxPriority == nil) && (a.MaxPriority == nil || *a.MaxPriority == *b.MaxPriority)
}
