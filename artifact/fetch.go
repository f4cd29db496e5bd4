package artifact

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"time"
)

// A flight is one blob's fetch, shared by every Acquire that wants the blob
// while it runs (the cache's singleflight). It runs on its own context and
// is cancelled when its last waiter leaves, or at Close.
type flight struct {
	done    chan struct{}
	err     error
	src     SourceKind         // the source that completed it
	fetched [3]int64           // bytes received by source kind (sourceIndex)
	waiters int                // under Cache.mu
	cancel  context.CancelFunc // cancels the fetch
	// abandoned: its last waiter left and cancelled it (under Cache.mu).
	// An acquire that joined it in between gets errAbandoned and starts
	// over.
	abandoned bool
}

func sourceIndex(k SourceKind) int {
	switch k {
	case SourcePeer:
		return 1
	case SourcePath:
		return 2
	}
	return 0
}

var sourceKinds = [3]SourceKind{SourceHTTP, SourcePeer, SourcePath}

// startFlightLocked starts fetching a reserved blob.
func (c *Cache) startFlightLocked(r Ref, b Blob, srcs []Source) *flight {
	ctx, cancel := context.WithCancel(c.ctx)
	f := &flight{done: make(chan struct{}), waiters: 1, cancel: cancel}
	c.flights[b.Digest] = f
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer cancel()
		start := time.Now()
		err := c.fetch(ctx, r, b, f, srcs)
		outcome := "ok"
		if err != nil {
			outcome = "error"
		} else {
			c.m.fetchTime.WithLabelValues(string(f.src)).Observe(time.Since(start).Seconds())
		}
		src := f.src
		if src == "" {
			src = SourceHTTP
		}
		c.m.fetches.WithLabelValues(string(src), outcome).Inc()
		c.mu.Lock()
		delete(c.flights, b.Digest)
		if err == nil {
			c.idx.Commit(b.Digest)
		} else {
			c.idx.Abort(b.Digest)
			c.trimPartialsLocked()
		}
		f.err = err
		c.mu.Unlock()
		close(f.done)
	}()
	return f
}

// wait waits for the flight or for ctx; a waiter that gives up leaves.
func (f *flight) wait(ctx context.Context, c *Cache) error {
	select {
	case <-f.done:
		c.mu.Lock()
		abandoned := f.abandoned
		c.mu.Unlock()
		if abandoned && f.err != nil && ctx.Err() == nil {
			return errAbandoned
		}
		return f.err
	case <-ctx.Done():
		f.leave(c)
		return ctx.Err()
	}
}

// errAbandoned reports a fetch joined just as its other waiters gave up on
// it; the acquire starts over (the reservation is gone by then).
var errAbandoned = errors.New("artifact: joined a fetch its other waiters abandoned")

// leave drops one waiter; the last one cancels the fetch.
func (f *flight) leave(c *Cache) {
	c.mu.Lock()
	defer c.mu.Unlock()
	f.waiters--
	if f.waiters == 0 {
		f.abandoned = true
		f.cancel()
	}
}

// localError is a failure to write the cache's own disk (ENOSPC, EDQUOT,
// EIO, a read-only file system): the fetch stops at once, trying no other
// attempt or source. Retried as a source's fault, a full disk had each of
// Attempts × sources download the blob again until the disk filled (10 GETs
// of a 5 MB blob into a 3 MiB tmpfs, with 5 attempts and 2 origins).
type localError struct{ err error }

func (e *localError) Error() string { return "artifact: writing the cache: " + e.err.Error() }
func (e *localError) Unwrap() error { return e.err }

// errStalled reports an attempt that received nothing for IdleTimeout.
var errStalled = errors.New("artifact: source stalled")

// errSlow reports an attempt that received less than MinRate × IdleTimeout
// bytes in an IdleTimeout.
var errSlow = errors.New("artifact: source too slow")

// fetch downloads one blob into partial/, resuming what a failed attempt
// (or an earlier process) left there, from each source in turn (peers, then
// origins), each tried up to Attempts times with jittered exponential
// back-off; then verifies its size and digest and renames it into blobs/.
// Bytes that fail the check are deleted and the next source tried.
func (c *Cache) fetch(ctx context.Context, r Ref, b Blob, f *flight, sources []Source) error {
	select {
	case c.sem <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-c.sem }()
	part := c.st.partialPath(b.Digest)
	file, err := c.openPartial(part)
	if err != nil {
		return err
	}
	defer file.Close()
	w := &partial{file: file, h: sha256.New()}
	if err := w.resume(b.Size); err != nil {
		return err
	}
	fc := c.cfg.Fetch
	if len(sources) == 0 {
		return fmt.Errorf("%w: blob %s: no source configured", ErrNotFound, b.Digest.Short())
	}
	var errs []error
	for _, s := range sources {
		backoff := fc.BackoffMin
		for attempt := 0; attempt < fc.Attempts; attempt++ {
			if attempt > 0 {
				c.m.retries.WithLabelValues(string(s.Kind())).Inc()
				if err := sleep(ctx, jitter(backoff)); err != nil {
					return errors.Join(append(errs, err)...)
				}
			}
			got, err := c.attempt(ctx, s, r, b, w)
			f.fetched[sourceIndex(s.Kind())] += got
			c.m.fetched.WithLabelValues(string(s.Kind())).Add(float64(got))
			if err == nil {
				f.src = s.Kind()
				return c.install(file, part, b.Digest)
			}
			c.log.Debug("artifact: fetch attempt failed", "digest", b.Digest.Short(), "source", s.String(), "attempt", attempt+1, "err", err)
			if errors.Is(err, ErrIntegrity) {
				c.m.integrity.WithLabelValues("fetch").Inc()
				c.log.Warn("artifact: source sent bad bytes; deleted", "digest", b.Digest.Short(), "source", s.String(), "err", err)
				if rerr := w.reset(); rerr != nil {
					return rerr
				}
				errs = append(errs, fmt.Errorf("%s: %w", s, err))
				break
			}
			if ctx.Err() != nil {
				return errors.Join(append(errs, ctx.Err())...)
			}
			var le *localError
			if errors.As(err, &le) {
				// No source, and no later attempt, can fix the cache's own
				// disk: each would download again until it fails.
				return fmt.Errorf("blob %s: %w", b.Digest.Short(), errors.Join(append(errs, err)...))
			}
			if !retryable(err) || attempt == fc.Attempts-1 {
				errs = append(errs, fmt.Errorf("%s: %w", s, err))
				break
			}
			var se *StatusError
			switch {
			case got > 0:
				backoff = fc.BackoffMin // progress: resume soon
			case errors.As(err, &se) && se.RetryAfter > 0:
				backoff = min(se.RetryAfter, fc.BackoffMax)
			default:
				backoff = min(2*backoff, fc.BackoffMax)
			}
		}
	}
	return fmt.Errorf("blob %s: %w", b.Digest.Short(), errors.Join(errs...))
}

// install makes a verified partial file the blob: fsync, rename, fsync the
// folder.
func (c *Cache) install(file *os.File, part string, d Digest) error {
	if err := file.Sync(); err != nil {
		return err
	}
	if err := os.Rename(part, c.st.blobPath(d)); err != nil {
		return err
	}
	return syncDir(filepath.Join(c.st.dir, blobsDir))
}

// partial is a download in progress: the file and the hash of its bytes.
type partial struct {
	file *os.File
	h    hash.Hash
	n    int64
}

// resume hashes what the file already holds (at most size bytes; a longer
// file starts over).
func (w *partial) resume(size int64) error {
	fi, err := w.file.Stat()
	if err != nil {
		return err
	}
	if fi.Size() > size {
		return w.reset()
	}
	n, err := io.Copy(w.h, io.NewSectionReader(w.file, 0, fi.Size()))
	if err != nil {
		return w.reset()
	}
	w.n = n
	_, err = w.file.Seek(n, io.SeekStart)
	return err
}

// reset empties the file.
func (w *partial) reset() error {
	w.h.Reset()
	w.n = 0
	if err := w.file.Truncate(0); err != nil {
		return err
	}
	_, err := w.file.Seek(0, io.SeekStart)
	return err
}

// copyBufSize is the size of a fetch's read buffer.
const copyBufSize = 1 << 20

// attempt asks one source for the rest of the blob and appends it; it
// returns the bytes received. nil means the blob is complete and verified.
func (c *Cache) attempt(ctx context.Context, s Source, r Ref, b Blob, w *partial) (int64, error) {
	if w.n == b.Size {
		return 0, w.verify(b)
	}
	actx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	idle := c.cfg.Fetch.IdleTimeout
	timer := time.AfterFunc(idle, func() { cancel(fmt.Errorf("%w: no byte in %v", errStalled, idle)) })
	defer timer.Stop()
	body, start, err := s.Blob(actx, r, b.Digest, w.n)
	if err != nil {
		return 0, causeOf(actx, err)
	}
	defer body.Close()
	if start != w.n {
		if err := w.reset(); err != nil {
			return 0, err
		}
	}
	buf := make([]byte, copyBufSize)
	var got int64
	// The rate floor: at least minBytes in every window of idle.
	minBytes := int64(float64(c.cfg.Fetch.MinRate) * idle.Seconds())
	winStart, winBytes := time.Now(), int64(0)
	for {
		n, rerr := body.Read(buf)
		if n > 0 && minBytes > 0 {
			// Checked as bytes arrive: a read that waits IdleTimeout
			// for nothing is a stall (the timer's), not this.
			winBytes += int64(n)
			if now := time.Now(); now.Sub(winStart) >= idle {
				if winBytes < minBytes {
					return got, fmt.Errorf("%w: %d bytes in %v, under %d B/s", errSlow, winBytes, now.Sub(winStart).Round(time.Millisecond), c.cfg.Fetch.MinRate)
				}
				winStart, winBytes = now, 0
			}
		}
		if n > 0 {
			timer.Reset(idle)
			got += int64(n)
			if w.n+int64(n) > b.Size {
				return got, fmt.Errorf("%w: %s: source sent more than %d bytes", ErrIntegrity, b.Digest.Short(), b.Size)
			}
			if _, err := w.file.Write(buf[:n]); err != nil {
				// The file and the hash may disagree now: start over.
				return got, &localError{errors.Join(err, w.reset())}
			}
			w.h.Write(buf[:n])
			w.n += int64(n)
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return got, causeOf(actx, rerr)
		}
	}
	if w.n < b.Size {
		return got, fmt.Errorf("artifact: %s: body ended at %d of %d bytes: %w", b.Digest.Short(), w.n, b.Size, io.ErrUnexpectedEOF)
	}
	return got, w.verify(b)
}

// verify checks the hash of a complete download.
func (w *partial) verify(b Blob) error {
	if got := hex.EncodeToString(w.h.Sum(nil)); got != b.Digest.Hex() {
		return fmt.Errorf("%w: %s: bytes hash to sha256:%s", ErrIntegrity, b.Digest.Short(), got[:12])
	}
	return nil
}

// causeOf prefers the reason a context was cancelled (a stall) over the
// read error it caused.
func causeOf(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); cause != nil && errors.Is(cause, errStalled) {
		return cause
	}
	return err
}

// jitter draws a wait uniformly from [d/2, d].
func jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

// sleep waits d or until ctx is done.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
