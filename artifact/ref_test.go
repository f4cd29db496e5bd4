package artifact

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseDigest(t *testing.T) {
	hex := strings.Repeat("ab", 32)
	for _, s := range []string{"sha256:" + hex, "sha256-" + hex} {
		d, err := ParseDigest(s)
		if err != nil || string(d) != "sha256:"+hex || d.FileName() != "sha256-"+hex {
			t.Errorf("%q: %q %v", s, d, err)
		}
	}
	for _, s := range []string{"", "sha256:", "sha256:" + strings.ToUpper(hex), "sha512:" + hex, "sha256:" + hex[:63] + "g",
		"sha256:../../../../etc/passwd" + hex[:36], "sha256/" + hex, "sha256:" + hex + "0"} {
		if _, err := ParseDigest(s); !errors.Is(err, ErrDigest) {
			t.Errorf("%q accepted", s)
		}
	}
	if d := DigestOf([]byte("{}")); d != "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a" {
		t.Errorf("DigestOf {} = %s", d)
	}
}

func TestParseRef(t *testing.T) {
	for in, want := range map[string]string{
		"tiny":                               "registry.ollama.ai/library/tiny:latest",
		"tiny:q4":                            "registry.ollama.ai/library/tiny:q4",
		"me/tiny":                            "registry.ollama.ai/me/tiny:latest",
		"127.0.0.1:8200/library/tiny:v1.2":   "127.0.0.1:8200/library/tiny:v1.2",
		"https://example.org/ns/llama3.2:1b": "example.org/ns/llama3.2:1b",
	} {
		r, err := ParseRef(in)
		if err != nil || r.String() != want {
			t.Errorf("%q: %v %v, want %s", in, r, err, want)
		}
	}
	for _, in := range []string{"", "../x", "a/../b", "..", ".hidden", "a/b/c/d", "ns.x/m", "m:../t", "m:", "/m", "m/",
		"a/b/..:t", "host/ns/m:t\x00", strings.Repeat("a", 81), "a b"} {
		if r, err := ParseRef(in); !errors.Is(err, ErrRef) {
			t.Errorf("%q accepted as %v", in, r)
		}
	}
	r, _ := ParseRef("tiny")
	if r.Path() != filepath.Join("registry.ollama.ai", "library", "tiny", "latest") || r.Repository() != "library/tiny" {
		t.Errorf("path %s repo %s", r.Path(), r.Repository())
	}
}
