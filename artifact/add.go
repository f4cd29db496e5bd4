package artifact

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	godigest "github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go"
	v1 "github.com/opencontainers/image-spec/specs-go/v1"
)

// File is a local file to add to the cache as a layer of a model.
type File struct {
	Path string
	// MediaType of the layer ("application/octet-stream" if empty; e.g.
	// MediaTypeOllamaModel for GGUF weights).
	MediaType string
}

// ArtifactTypeModel is the artifactType of the manifests Add writes (an OCI
// image-spec v1.1 artifact manifest with the empty config, manifest.md
// "Guidelines for Artifact Usage").
const ArtifactTypeModel = "application/vnd.infergate.model.v1"

// Add puts local files into the cache as model r: each file a layer
// annotated with its base name (org.opencontainers.image.title, as ORAS
// does), the config the OCI empty descriptor, the manifest an OCI image
// manifest of artifactType ArtifactTypeModel. The files are copied through
// the fetch path (budget, verification, atomic install), so a cache can
// publish models to its peers and engines. It returns the manifest.
func (c *Cache) Add(ctx context.Context, r Ref, files []File) (*Manifest, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	src := &filesSource{paths: map[Digest]string{}}
	m := v1.Manifest{
		Versioned:    ocispec.Versioned{SchemaVersion: 2},
		MediaType:    v1.MediaTypeImageManifest,
		ArtifactType: ArtifactTypeModel,
		Config:       v1.DescriptorEmptyJSON,
		Layers:       []v1.Descriptor{},
	}
	src.data = map[Digest][]byte{Digest(v1.DescriptorEmptyJSON.Digest): v1.DescriptorEmptyJSON.Data}
	for _, f := range files {
		d, size, err := hashFile(f.Path)
		if err != nil {
			return nil, err
		}
		mt := f.MediaType
		if mt == "" {
			mt = "application/octet-stream"
		}
		src.paths[d] = f.Path
		m.Layers = append(m.Layers, v1.Descriptor{
			MediaType:   mt,
			Digest:      godigest.Digest(d),
			Size:        size,
			Annotations: map[string]string{v1.AnnotationTitle: filepath.Base(f.Path)},
		})
	}
	raw, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	if _, err := ParseManifest(raw); err != nil {
		return nil, err
	}
	src.manifest = raw
	l, err := c.acquire(ctx, r, AcquireOptions{}, []Source{src})
	if err != nil {
		return nil, err
	}
	l.Release()
	return l.Manifest, nil
}

// hashFile is a file's digest and size.
func hashFile(p string) (Digest, int64, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, err
	}
	return Digest("sha256:" + hex.EncodeToString(h.Sum(nil))), n, nil
}

// filesSource serves Add's manifest and files.
type filesSource struct {
	manifest []byte
	paths    map[Digest]string
	data     map[Digest][]byte
}

func (s *filesSource) String() string   { return "local files" }
func (s *filesSource) Kind() SourceKind { return SourcePath }

func (s *filesSource) Manifest(context.Context, Ref) ([]byte, error) { return s.manifest, nil }

func (s *filesSource) Blob(ctx context.Context, r Ref, d Digest, offset int64) (io.ReadCloser, int64, error) {
	if b, ok := s.data[d]; ok {
		rd := bytes.NewReader(b)
		if _, err := rd.Seek(offset, io.SeekStart); err != nil {
			return nil, 0, err
		}
		return io.NopCloser(rd), offset, nil
	}
	p, ok := s.paths[d]
	if !ok {
		return nil, 0, fmt.Errorf("%w: %s", ErrNotFound, d.Short())
	}
	return Dir{}.open(p, offset)
}
