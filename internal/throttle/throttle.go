// Package throttle limits an HTTP response's bandwidth: the origin of a
// benchmark that models a remote object store or a registry at a given
// rate (artifact's and simserver's start-up benchmarks).
package throttle

import (
	"io"
	"net/http"
	"time"
)

// chunk is the most bytes written between two checks of the rate: small
// enough that a reader sees a steady stream, large enough that a sleep is
// rarely shorter than the timer's resolution at a few hundred MB/s.
const chunk = 256 << 10

// Handler serves h with every response body limited to bytesPerSec
// bytes/s, counted from the request's arrival; bytesPerSec ≤ 0 serves h
// as it is.
func Handler(h http.Handler, bytesPerSec float64) http.Handler {
	if bytesPerSec <= 0 {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(&Writer{ResponseWriter: w, BytesPerSec: bytesPerSec, T0: time.Now()}, r)
	})
}

// Writer limits the bytes written through it to BytesPerSec bytes/s from
// T0, sleeping before each write of at most 256 KiB that would run ahead
// of that rate. Now and Sleep default to the time package's (a test's
// clock may replace them).
type Writer struct {
	http.ResponseWriter
	BytesPerSec float64
	T0          time.Time
	Now         func() time.Time
	Sleep       func(time.Duration)
	sent        int64
}

// Write writes p in chunks, each once the rate allows it.
func (t *Writer) Write(p []byte) (int, error) {
	now, sleep := t.Now, t.Sleep
	if now == nil {
		now = time.Now
	}
	if sleep == nil {
		sleep = time.Sleep
	}
	var n int
	for len(p) > 0 {
		k := min(len(p), chunk)
		due := time.Duration(float64(t.sent+int64(k)) / t.BytesPerSec * float64(time.Second))
		if ahead := due - now().Sub(t.T0); ahead > 0 {
			sleep(ahead)
		}
		w, err := t.ResponseWriter.Write(p[:k])
		n += w
		t.sent += int64(w)
		if err != nil {
			return n, err
		}
		p = p[k:]
	}
	return n, nil
}

// ReadFrom hides the response's io.ReaderFrom (sendfile, which
// http.FileServer would use), so every byte passes Write.
func (t *Writer) ReadFrom(r io.Reader) (int64, error) { return io.Copy(struct{ io.Writer }{t}, r) }
