package artifact

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
)

// readChunk is ReadVerified's read size (bytes): large enough that a read
// from the page cache runs at memory speed, small enough to notice a
// cancelled context within a few milliseconds at disk speed.
const readChunk = 1 << 20

// ReadVerified reads held blob d from disk as an engine's load does, every
// byte hashed, and copies it to w (nil: the bytes are only read and
// hashed). A blob whose bytes do not match its digest and size is deleted
// with the manifests naming it (integrity_failures_total{stage="read"}) and
// an error wrapping ErrIntegrity returned, so the next Acquire fetches it
// again. It returns the bytes read; it stops when ctx ends. A blob not held
// is an error wrapping ErrNotFound. Hold a lease on the blob's model while
// reading, so the budget cannot evict it meanwhile.
func (c *Cache) ReadVerified(ctx context.Context, d Digest, w io.Writer) (int64, error) {
	c.mu.Lock()
	size, ok := c.idx.Size(d)
	c.mu.Unlock()
	f, err := c.OpenBlob(d)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	if !ok { // evicted between the two looks: OpenBlob found the file by chance
		return 0, fmt.Errorf("%w: blob %s", ErrNotFound, d.Short())
	}
	h := sha256.New()
	buf := make([]byte, readChunk)
	var n int64
	for {
		if err := ctx.Err(); err != nil {
			return n, err
		}
		k, rerr := f.Read(buf)
		if k > 0 {
			n += int64(k)
			if n > size {
				break // longer than the index says: caught below
			}
			h.Write(buf[:k])
			if w != nil {
				if _, err := w.Write(buf[:k]); err != nil {
					return n, err
				}
			}
		}
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr != nil {
			return n, rerr
		}
	}
	if got := hex.EncodeToString(h.Sum(nil)); n != size || got != d.Hex() {
		c.m.integrity.WithLabelValues("read").Inc()
		c.discard(d)
		return n, fmt.Errorf("%w: %s read %d bytes hashing to sha256:%.12s, want %d bytes", ErrIntegrity, d.Short(), n, got, size)
	}
	return n, nil
}
