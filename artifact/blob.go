package artifact

import "github.com/infergate/infergate/artifact/blob"

// The pure core lives in package blob (no I/O, no net/http, so the
// simulator can import it); these are its names here.
type (
	Digest     = blob.Digest
	Blob       = blob.Blob
	Tier       = blob.Tier
	Holder     = blob.Holder
	Placement  = blob.Placement
	Plan       = blob.Plan
	Index      = blob.Index
	IndexStats = blob.IndexStats
)

// Tiers (blob.Tier).
const (
	TierLocal  = blob.TierLocal
	TierPeer   = blob.TierPeer
	TierRemote = blob.TierRemote
)

// Errors of package blob.
var (
	ErrDigest  = blob.ErrDigest
	ErrNoSpace = blob.ErrNoSpace
)

// ParseDigest is blob.ParseDigest.
func ParseDigest(s string) (Digest, error) { return blob.ParseDigest(s) }

// DigestOf is blob.DigestOf.
func DigestOf(b []byte) Digest { return blob.DigestOf(b) }

// Locate is blob.Locate.
func Locate(blobs []Blob, local Holder, peers ...Holder) Plan {
	return blob.Locate(blobs, local, peers...)
}

// NewIndex is blob.NewIndex.
func NewIndex(budget int64) *Index { return blob.NewIndex(budget) }
