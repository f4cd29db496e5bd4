// Package artifact is the node-local, content-addressed cache of model
// artifacts (issue 20): weights shards, tokenizer and config files and opaque
// container layers, stored as blobs keyed by their SHA-256 digest and named by
// per-model manifests, fetched from a remote origin (an OCI registry such as
// Ollama's, or a plain HTTP file server), a local path or a peer node's cache,
// verified, deduplicated, pinned while engines use them and evicted LRU within
// a byte budget. The on-disk layout is Ollama's model store, so an Ollama
// engine can load straight from the cache. See README.md.
package artifact

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	godigest "github.com/opencontainers/go-digest"
)

// Digest is a validated OCI content digest of the SHA-256 algorithm:
// "sha256:" followed by 64 lower-case hex digits (OCI image-spec
// descriptor.md, "Digests"; the only algorithm Ollama accepts either,
// ollama/ollama manifest/paths.go BlobsPath @v0.17.4). Only ParseDigest and
// DigestOf make one, so a Digest is always safe to use in a file name.
type Digest string

// ErrDigest reports a malformed digest.
var ErrDigest = errors.New("artifact: invalid digest")

const digestPrefix = "sha256:"

// ParseDigest validates s ("sha256:<64 hex>"; Ollama's file-name form
// "sha256-<64 hex>" is accepted too) and returns it in canonical form.
// Upper-case hex is rejected, as the OCI spec's encoded part for sha256 is
// [a-f0-9]{64}.
func ParseDigest(s string) (Digest, error) {
	if len(s) != len(digestPrefix)+64 || s[:6] != "sha256" || (s[6] != ':' && s[6] != '-') {
		return "", fmt.Errorf("%w: %.80q", ErrDigest, s)
	}
	for i := 7; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return "", fmt.Errorf("%w: %.80q", ErrDigest, s)
		}
	}
	if s[6] == '-' {
		return Digest(digestPrefix + s[7:]), nil
	}
	return Digest(s), nil
}

// DigestOf is the digest of b.
func DigestOf(b []byte) Digest {
	sum := sha256.Sum256(b)
	return Digest(digestPrefix + hex.EncodeToString(sum[:]))
}

// Hex is the digest's 64 hex digits.
func (d Digest) Hex() string { return string(d[len(digestPrefix):]) }

// FileName is the blob's file name in Ollama's layout, "sha256-<hex>"
// (a colon is not portable in file names).
func (d Digest) FileName() string { return "sha256-" + d.Hex() }

// String is the canonical form.
func (d Digest) String() string { return string(d) }

// Short is the first 12 hex digits, for logs.
func (d Digest) Short() string { return d.Hex()[:12] }

// ocidigest is d as the image-spec's digest type.
func (d Digest) ocidigest() godigest.Digest { return godigest.Digest(d) }
