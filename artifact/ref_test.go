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

// FuzzParseRef: names and digests from anywhere (URL paths, manifests,
// command lines) never panic, and what is accepted stays inside the folder:
// a relative path of four parts, none "." or "..", that parses back to the
// same Ref. Seeds in testdata/fuzz/FuzzParseRef.
func FuzzParseRef(f *testing.F) {
	for _, s := range []string{"tiny", "library/tiny:latest", "127.0.0.1:8200/ns/m:t", "../../etc/passwd", "a/b/c/d",
		"https://h/n/m:t", "sha256:" + strings.Repeat("0", 64), "sha256-" + strings.Repeat("f", 64), "m:..", "h:1/./m"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if d, err := ParseDigest(s); err == nil {
			if strings.ContainsAny(d.FileName(), `/\\.`) || len(d.FileName()) != 71 {
				t.Fatalf("digest %q makes file name %q", s, d.FileName())
			}
		}
		r, err := ParseRef(s)
		if err != nil {
			return
		}
		p := r.Path()
		parts := strings.Split(p, string(filepath.Separator))
		if filepath.IsAbs(p) || len(parts) != 4 || filepath.Clean(p) != p {
			t.Fatalf("%q → path %q", s, p)
		}
		for _, q := range parts {
			if q == "." || q == ".." || q == "" {
				t.Fatalf("%q → path %q", s, p)
			}
		}
		if r2, err := ParseRef(r.String()); err != nil || r2 != r {
			t.Fatalf("%q → %v → %v %v", s, r, r2, err)
		}
	})
}
