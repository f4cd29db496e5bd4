package bench

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/infergate/infergate/measure"
)

func TestProgress(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "progress"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if isTerminal(f) || isTerminal(&bytes.Buffer{}) || isTerminal(nil) {
		t.Fatal("a file, a buffer or nil taken for a terminal")
	}

	// Not a terminal: no bar, one line at the end, safe for concurrent use.
	var buf bytes.Buffer
	p := newProgress(&buf, 10, "")
	if p.bar != nil {
		t.Fatal("bar on a non-terminal")
	}
	var wg sync.WaitGroup
	for i := range 10 {
		wg.Go(func() { p.done(i%5 == 0) })
	}
	wg.Wait()
	p.finish([]measure.Record{{ArrivalMs: 1000, E2EMs: 1000}}, 4)
	if got, want := buf.String(), "replay: 1 requests, 2 errors, 2.0 s engine time (0.5 s wall)\n"; got != want {
		t.Errorf("progress line %q, want %q", got, want)
	}

	// No writer: nothing, and no panic.
	q := newProgress(nil, 3, "x")
	q.done(true)
	q.finish(nil, 1)

	if s := buf.String(); strings.Count(s, "\n") != 1 {
		t.Errorf("extra output %q", s)
	}
}
