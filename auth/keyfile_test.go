package auth

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

// Test keys.
const (
	keyAlice = "sk-alice-0123456789abcdef"
	keyBob   = "sk-bob-fedcba9876543210"
)

func TestHashKey(t *testing.T) {
	// printf %s test | sha256sum
	if got := HashKey("test"); got != "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08" {
		t.Fatalf("HashKey(test) = %s", got)
	}
}

func TestParseKeys(t *testing.T) {
	ha, hb := HashKey(keyAlice), HashKey(keyBob)
	bare := strings.TrimPrefix(hb, "sha256:")
	tests := []struct {
		name, in string
		semi     bool
		want     []Key
	}{
		{"yaml keys", "# tenants\nkeys:\n  - name: alice\n    hash: " + ha + "\n    models: [m, other]\n    requests_per_minute: 60\n    tokens_per_minute: 1000\n  - {name: bob, key: " + keyBob + "}\n", false,
			[]Key{{Name: "alice", Hash: ha, Models: []string{"m", "other"}, RequestsPerMinute: 60, TokensPerMinute: 1000}, {Name: "bob", Hash: hb}}},
		{"yaml list", "- name: alice\n  hash: " + ha + "\n", false, []Key{{Name: "alice", Hash: ha}}},
		{"lines", "# name hash options\n\nalice " + ha + " models=m,other rpm=60 tpm=1000  # trailing comment\nbob " + bare + "\n", false,
			[]Key{{Name: "alice", Hash: ha, Models: []string{"m", "other"}, RequestsPerMinute: 60, TokensPerMinute: 1000}, {Name: "bob", Hash: bare}}},
		{"plain and semicolons", "alice plain:" + keyAlice + " rpm=5; bob plain:" + keyBob, true,
			[]Key{{Name: "alice", Hash: ha, RequestsPerMinute: 5}, {Name: "bob", Hash: hb}}},
		{"rotation: one name, two keys", "alice " + ha + " rpm=5\nalice " + hb + " rpm=5\n", false,
			[]Key{{Name: "alice", Hash: ha, RequestsPerMinute: 5}, {Name: "alice", Hash: hb, RequestsPerMinute: 5}}},
		{"empty", "# nothing\n\n", false, nil},
		{"max_priority", "alice " + ha + " max_priority=-2\n", false, []Key{{Name: "alice", Hash: ha, MaxPriority: ptr(-2)}}},
		{"yaml max_priority", "keys:\n  - {name: alice, hash: " + ha + ", max_priority: 3}\n", false, []Key{{Name: "alice", Hash: ha, MaxPriority: ptr(3)}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseKeys([]byte(tc.in), tc.semi)
			if err != nil {
				t.Fatal(err)
			}
			gj, _ := json.Marshal(got)
			wj, _ := json.Marshal(tc.want)
			if len(got) != len(tc.want) || !bytes.Equal(gj, wj) {
				t.Fatalf("got %s\nwant %s", gj, wj)
			}
			for _, k := range got {
				if strings.Contains(k.Hash, keyAlice) || strings.Contains(k.Hash, keyBob) {
					t.Fatal("plaintext key kept")
				}
			}
		})
	}

	bad := []struct{ name, in, want string }{
		{"bad name", "al ice " + ha, "option"},
		{"name chars", "al/ice " + ha, "name"},
		{"short hash", "alice sha256:abcd", "hash"},
		{"not hex", "alice sha256:" + strings.Repeat("zz", 32), "hexadecimal"},
		{"duplicate key", "alice " + ha + "\nbob " + ha, "same key as alice"},
		{"same name, other grant", "alice " + ha + " rpm=5\nalice " + hb + " rpm=6", "listed again"},
		{"same name, other max_priority", "alice " + ha + " max_priority=1\nalice " + hb, "listed again"},
		{"max_priority not a number", "alice " + ha + " max_priority=high", "not an integer"},
		{"unknown option", "alice " + ha + " burst=5", "unknown option"},
		{"negative limit", "alice " + ha + " rpm=-1", "requests_per_minute"},
		{"not a number", "alice " + ha + " tpm=lots", "not an integer"},
		{"no hash", "alice", "want NAME HASH"},
		{"empty plain", "alice plain:", "empty"},
		{"yaml unknown field", "keys:\n  - {name: alice, hash: " + ha + ", rpm: 5}\n", "rpm"},
		{"yaml key and hash", "keys:\n  - {name: alice, hash: " + ha + ", key: x}\n", "not both"},
		{"yaml empty model", "keys:\n  - {name: alice, hash: " + ha + ", models: ['']}\n", "empty model"},
	}
	for _, tc := range bad {
		t.Run("invalid/"+tc.name, func(t *testing.T) {
			_, err := ParseKeys([]byte(tc.in), false)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
			if strings.Contains(err.Error(), keyAlice) {
				t.Fatal("error shows a key")
			}
		})
	}
}

func FuzzParseKeys(f *testing.F) {
	h := HashKey("k")
	for _, s := range []string{
		"keys:\n  - {name: a, hash: " + h + ", models: [m], requests_per_minute: 1, tokens_per_minute: 2}\n",
		"- name: a\n  key: secret\n",
		"a " + h + " models=m,n rpm=1 tpm=2 # c\n",
		"a plain:x; b plain:y",
		"[{name: a, hash: " + h + "}]",
		"{keys: []}",
	} {
		f.Add([]byte(s), false)
		f.Add([]byte(s), true)
	}
	f.Fuzz(func(t *testing.T, data []byte, semi bool) {
		keys, err := ParseKeys(data, semi)
		if err != nil {
			return
		}
		// What ParseKeys accepts, the keyring must accept.
		kr, _, err := Load(Config{Keys: keys}, nil)
		if err != nil {
			t.Fatalf("accepted keys rejected by Load: %v", err)
		}
		for _, k := range keys {
			if !validKeyName(k.Name) {
				t.Fatalf("accepted name %q", k.Name)
			}
			if _, err := parseHash(k.Hash); err != nil {
				t.Fatalf("accepted hash %q", k.Hash)
			}
			if k.RequestsPerMinute < 0 || k.TokensPerMinute < 0 {
				t.Fatalf("accepted negative limits %+v", k)
			}
		}
		if len(kr.byHash) != len(keys) {
			t.Fatalf("%d keys, %d hashes", len(keys), len(kr.byHash))
		}
	})
}

func ptr[T any](v T) *T { return &v }
