package throttle

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// TestWriterPacesOnAClock: 1 MiB at 1 MiB/s on a test clock that only
// moves when the writer sleeps: four 256 KiB writes, each after sleeping
// until its bytes are due, the last at 1 s; the body arrives whole.
func TestWriterPacesOnAClock(t *testing.T) {
	t0 := time.Unix(0, 0)
	clock := t0
	var sleeps []time.Duration
	rec := httptest.NewRecorder()
	w := &Writer{ResponseWriter: rec, BytesPerSec: 1 << 20, T0: t0,
		Now:   func() time.Time { return clock },
		Sleep: func(d time.Duration) { sleeps = append(sleeps, d); clock = clock.Add(d) }}
	body := bytes.Repeat([]byte("x"), 1<<20)
	if n, err := w.ReadFrom(bytes.NewReader(body)); err != nil || n != int64(len(body)) {
		t.Fatalf("ReadFrom: %d, %v", n, err)
	}
	if !bytes.Equal(rec.Body.Bytes(), body) {
		t.Fatalf("body: %d bytes arrived", rec.Body.Len())
	}
	if len(sleeps) < 4 || clock.Sub(t0) != time.Second {
		t.Fatalf("%d sleeps, clock at %v: want ≥ 4 sleeps ending at 1s", len(sleeps), clock.Sub(t0))
	}
}

// TestHandler: a rate ≤ 0 serves the handler itself; a rate wraps every
// response (sendfile hidden: the body passes Write).
func TestHandler(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if _, ok := w.(*Writer); !ok {
			t.Errorf("response writer %T is not throttled", w)
		}
		_, _ = io.WriteString(w, "ok")
	})
	if Handler(h, 0) == nil {
		t.Fatal("nil handler")
	}
	srv := httptest.NewServer(Handler(h, 1e9))
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "ok" {
		t.Fatalf("body %q", b)
	}
}
