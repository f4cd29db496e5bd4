// Package blob is the pure core of the node-local artifact cache (package
// artifact): content digests, the blobs a manifest names, the node's Index
// (byte budget, LRU over unpinned blobs, pins, reservations) and Locate,
// which says from which tier — this node, a peer, the remote origin — each
// blob of an engine's start-up is read. No I/O, no clock, no net/http: the
// simulator's virtual nodes run the same accounting as the live cache
// (artifact/README.md, "The seam to the simulator's start-up").
package blob

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
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
