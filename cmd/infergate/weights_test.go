package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestSimWeightsThroughCache runs `infergate sim --weights` end to end: a
// model published in one cache folder (the origin, --artifact-from-dir),
// an engine whose start-up fetches it into the node's cache (modelled from
// the remote tier), then a second engine on the same node that reads it
// from the cache (a local tier, nothing fetched).
func TestSimWeightsThroughCache(t *testing.T) {
	origin, node := t.TempDir(), t.TempDir()
	w := filepath.Join(t.TempDir(), "model.gguf")
	if err := os.WriteFile(w, []byte(strings.Repeat("weights!", 40_000)), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := artifacts(t, "add", "--dir", origin, "acme/tiny:v1", w); err != nil {
		t.Fatalf("add: %v\n%s", err, out)
	}
	args := []string{"sim", "--listen", "127.0.0.1:0", "--time-scale", "1000", "--weights", "acme/tiny:v1",
		"--artifact-dir", node, "--artifact-from-dir", origin}
	cold := start(t, args...)
	cold.await(t, regexp.MustCompile(`engine ready.*source=(remote) .*fetched_bytes=320\d\d\d .*read_bytes=320\d\d\d`))
	cold.stop(t)

	warm := start(t, args...)
	warm.await(t, regexp.MustCompile(`engine ready.*source=(page_cache|nvme) .*fetched_bytes=0 .*read_bytes=320\d\d\d`))
	warm.stop(t)

	c := infergateCommand("sim", "--listen", "127.0.0.1:0", "--artifact-dir", node)
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	if out, err := c.CombinedOutput(); err == nil || !strings.Contains(string(out), "--artifact-dir needs --weights") {
		t.Fatalf("--artifact-dir without --weights: %v %s", err, out)
	}
}
