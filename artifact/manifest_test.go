package artifact

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
)

// ollamaManifest is the shape `ollama create` writes (a tiny model made by
// e2e.WriteModelDir, digests shortened to fit the test).
func ollamaManifest(model, template, params, config Digest, modelSize int64) []byte {
	return fmt.Appendf(nil, `{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",`+
		`"config":{"mediaType":"application/vnd.docker.container.image.v1+json","digest":%q,"size":450},`+
		`"layers":[{"mediaType":"application/vnd.ollama.image.model","digest":%q,"size":%d},`+
		`{"mediaType":"application/vnd.ollama.image.template","digest":%q,"size":152},`+
		`{"mediaType":"application/vnd.ollama.image.params","digest":%q,"size":78,"from":"x"}]}`, config, model, modelSize, template, params)
}

func TestParseManifest(t *testing.T) {
	raw := ollamaManifest(dg(1), dg(2), dg(3), dg(4), 16_600_000)
	m, err := ParseManifest(raw)
	if err != nil {
		t.Fatal(err)
	}
	if m.Digest != DigestOf(raw) || !bytes.Equal(m.Raw, raw) || m.MediaType() != MediaTypeDockerManifest {
		t.Fatalf("manifest %+v", m)
	}
	bl := m.Blobs()
	if len(bl) != 4 || bl[0].Digest != dg(4) || bl[1].MediaType != MediaTypeOllamaModel || m.Size() != 450+16_600_000+152+78 {
		t.Fatalf("blobs %+v size %d", bl, m.Size())
	}
	// A digest twice is one blob.
	dup := ollamaManifest(dg(1), dg(1), dg(3), dg(4), 10)
	if m, err := ParseManifest(dup); err != nil || len(m.Blobs()) != 3 {
		t.Fatalf("dup: %v", err)
	}
}

func TestParseManifestHostile(t *testing.T) {
	deep := `{"schemaVersion":2,"config":{"digest":"` + string(dg(1)) + `","size":1},"layers":[],"annotations":{"a":` +
		strings.Repeat("[", 1000) + strings.Repeat("]", 1000) + `}}`
	many := `{"schemaVersion":2,"config":{"digest":"` + string(dg(1)) + `","size":1},"layers":[` +
		strings.Repeat(`{"digest":"`+string(dg(2))+`","size":1},`, MaxManifestBlobs+1) + `{"digest":"` + string(dg(2)) + `","size":1}]}`
	for name, raw := range map[string]string{
		"huge":         `{"schemaVersion":2,"x":"` + strings.Repeat("a", MaxManifestBytes) + `"}`,
		"deep":         deep,
		"many layers":  many,
		"bad digest":   strings.Replace(string(ollamaManifest(dg(1), dg(2), dg(3), dg(4), 1)), string(dg(2)), "sha256:../../etc/passwd", 1),
		"no config":    `{"schemaVersion":2,"layers":[]}`,
		"negative":     string(ollamaManifest(dg(1), dg(2), dg(3), dg(4), -5)),
		"too big blob": string(ollamaManifest(dg(1), dg(2), dg(3), dg(4), MaxBlobBytes+1)),
		"index":        `{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}`,
		"schema 1":     `{"schemaVersion":1,"config":{"digest":"` + string(dg(1)) + `","size":1}}`,
		"not json":     `{"schemaVersion":2,`,
		"array":        `[1,2,3]`,
	} {
		if _, err := ParseManifest([]byte(raw)); !errors.Is(err, ErrManifest) {
			t.Errorf("%s: accepted (%v)", name, err)
		}
	}
}

// FuzzParseManifest: no input panics or allocates without bound, and an
// accepted manifest has valid, in-range descriptors and the digest of its
// bytes. Seeds in testdata/fuzz/FuzzParseManifest.
func FuzzParseManifest(f *testing.F) {
	f.Add(ollamaManifest(dg(1), dg(2), dg(3), dg(4), 16_600_000))
	f.Add([]byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","artifactType":"application/vnd.infergate.model.v1",` +
		`"config":{"mediaType":"application/vnd.oci.empty.v1+json","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2,"data":"e30="},` +
		`"layers":[{"mediaType":"application/octet-stream","digest":"` + string(dg(5)) + `","size":3,"annotations":{"org.opencontainers.image.title":"a.gguf"}}]}`))
	f.Add([]byte(`{"schemaVersion":2,"layers":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		m, err := ParseManifest(raw)
		if err != nil {
			if m != nil {
				t.Fatal("manifest with an error")
			}
			return
		}
		if m.Digest != DigestOf(raw) || len(raw) > MaxManifestBytes {
			t.Fatal("digest or bound")
		}
		var n int64
		for _, b := range m.Blobs() {
			if _, err := ParseDigest(string(b.Digest)); err != nil || b.Size < 0 || b.Size > MaxBlobBytes {
				t.Fatalf("blob %+v", b)
			}
			n += b.Size
		}
		if n != m.Size() || len(m.Blobs()) > MaxManifestBlobs+1 {
			t.Fatal("size or count")
		}
		if !json.Valid(raw) {
			t.Fatal("accepted invalid JSON")
		}
	})
}
