package artifact

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"

	godigest "github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Media types the cache reads.
const (
	// MediaTypeDockerManifest is Docker's image manifest v2 schema 2, the
	// media type Ollama writes and its registry serves (ollama/ollama
	// manifest/manifest.go WriteManifest @v0.17.4); its JSON shape is the
	// OCI image manifest's.
	MediaTypeDockerManifest = "application/vnd.docker.distribution.manifest.v2+json"
	// MediaTypeOllamaModel is an Ollama model's GGUF weights layer.
	MediaTypeOllamaModel = "application/vnd.ollama.image.model"
)

// Bounds of ParseManifest.
const (
	// MaxManifestBytes is the largest manifest read: 4 MiB, the size the OCI
	// distribution spec asks registries to accept at least (spec.md,
	// "Pushing Manifests").
	MaxManifestBytes = 4 << 20
	// MaxManifestBlobs bounds config + layers: an Ollama model imported
	// from safetensors has a layer per tensor (thousands for a large model).
	MaxManifestBlobs = 16384
	// MaxManifestDepth bounds JSON nesting; a manifest needs 4 levels.
	MaxManifestDepth = 32
	// MaxBlobBytes bounds a descriptor's declared size (4 TiB).
	MaxBlobBytes = 4 << 40
)

// ErrManifest reports a manifest the cache cannot use.
var ErrManifest = errors.New("artifact: invalid manifest")

// Manifest is a parsed image manifest: the bytes as fetched (their digest
// names the manifest; they are never re-encoded, so fields the cache does not
// know, such as Ollama's per-layer "from" and "name", survive) and the OCI
// view of them (image-spec v1.1.1 specs-go/v1 Manifest).
type Manifest struct {
	Raw    []byte
	Digest Digest
	OCI    ocispec.Manifest
}

// ParseManifest reads an OCI image manifest or a Docker v2 schema 2 manifest
// (an image index, which names other manifests, is refused) within the
// package's bounds: at most MaxManifestBytes, nesting at most
// MaxManifestDepth, at most MaxManifestBlobs descriptors, every descriptor
// with a valid sha256 digest and a size in [0, MaxBlobBytes]. It allocates in
// proportion to len(raw) and never panics (FuzzParseManifest).
func ParseManifest(raw []byte) (*Manifest, error) {
	if len(raw) > MaxManifestBytes {
		return nil, fmt.Errorf("%w: %d bytes, over %d", ErrManifest, len(raw), MaxManifestBytes)
	}
	if d := jsonDepth(raw); d > MaxManifestDepth {
		return nil, fmt.Errorf("%w: nesting deeper than %d", ErrManifest, MaxManifestDepth)
	}
	// Count descriptors before decoding them: a cheap upper bound on the
	// layers array (every descriptor is an object with a "digest" key).
	if n := bytes.Count(raw, []byte(`"digest"`)); n > MaxManifestBlobs+1 {
		return nil, fmt.Errorf("%w: %d descriptors, over %d", ErrManifest, n, MaxManifestBlobs)
	}
	var m Manifest
	if err := json.Unmarshal(raw, &m.OCI); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrManifest, err)
	}
	switch m.OCI.MediaType {
	case ocispec.MediaTypeImageManifest, MediaTypeDockerManifest, "":
	default:
		return nil, fmt.Errorf("%w: media type %.100q (an image manifest is needed)", ErrManifest, m.OCI.MediaType)
	}
	if m.OCI.SchemaVersion != 2 {
		return nil, fmt.Errorf("%w: schemaVersion %d, want 2", ErrManifest, m.OCI.SchemaVersion)
	}
	if len(m.OCI.Layers) > MaxManifestBlobs {
		return nil, fmt.Errorf("%w: %d layers, over %d", ErrManifest, len(m.OCI.Layers), MaxManifestBlobs)
	}
	if err := checkDescriptor(&m.OCI.Config, "config"); err != nil {
		return nil, err
	}
	for i := range m.OCI.Layers {
		if err := checkDescriptor(&m.OCI.Layers[i], fmt.Sprintf("layer %d", i)); err != nil {
			return nil, err
		}
	}
	m.Raw = raw
	m.Digest = DigestOf(raw)
	return &m, nil
}

func checkDescriptor(d *ocispec.Descriptor, what string) error {
	dg, err := ParseDigest(string(d.Digest))
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrManifest, what, err)
	}
	d.Digest = godigest.Digest(dg)
	if d.Size < 0 || d.Size > MaxBlobBytes {
		return fmt.Errorf("%w: %s: size %d out of [0, %d]", ErrManifest, what, d.Size, int64(MaxBlobBytes))
	}
	return nil
}

// Blobs lists the manifest's config and layers, each digest once, config
// first, then layers in order.
func (m *Manifest) Blobs() []Blob {
	out := make([]Blob, 0, 1+len(m.OCI.Layers))
	seen := make(map[Digest]bool, 1+len(m.OCI.Layers))
	add := func(d ocispec.Descriptor) {
		dg := Digest(d.Digest)
		if seen[dg] {
			return
		}
		seen[dg] = true
		out = append(out, Blob{Digest: dg, Size: d.Size, MediaType: d.MediaType})
	}
	add(m.OCI.Config)
	for _, l := range m.OCI.Layers {
		add(l)
	}
	return out
}

// Size is the sum of the manifest's distinct blob sizes (bytes).
func (m *Manifest) Size() int64 {
	var n int64
	for _, b := range m.Blobs() {
		n += b.Size
	}
	return n
}

// MediaType is the media type to serve the manifest with.
func (m *Manifest) MediaType() string {
	if m.OCI.MediaType != "" {
		return m.OCI.MediaType
	}
	return ocispec.MediaTypeImageManifest
}

// jsonDepth returns the deepest nesting of objects and arrays in b, stopping
// early once it passes MaxManifestDepth; strings are skipped with their
// escapes. Malformed JSON is left to the decoder.
func jsonDepth(b []byte) int {
	depth, deepest := 0, 0
	inStr, esc := false, false
	for _, c := range b {
		if inStr {
			switch {
			case esc:
				esc = false
			case c == '\\':
				esc = true
			case c == '"':
				inStr = false
			}
			continue
		}
		switch c {
		case '"':
			inStr = true
		case '{', '[':
			depth++
			if depth > deepest {
				deepest = depth
				if deepest > MaxManifestDepth {
					return deepest
				}
			}
		case '}', ']':
			depth--
		}
	}
	return deepest
}
