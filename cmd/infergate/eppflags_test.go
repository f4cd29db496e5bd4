package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestEPPRefusesNegativeBounds: a negative --max-streams or
// --max-buffered-bytes is refused before anything starts (it used to mean
// the default silently); 0 means the default.
func TestEPPRefusesNegativeBounds(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "epp.yaml")
	yaml := "listen: 127.0.0.1:0\nepp: {listen: \"127.0.0.1:0\", health_listen: \"127.0.0.1:0\"}\n" +
		"endpoints:\n  - {url: \"http://127.0.0.1:9\", model: m}\n"
	if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, flag := range []string{"--max-streams=-1", "--max-buffered-bytes=-5"} {
		_, err := runRoot(t, "", "epp", "-c", cfg, flag)
		if err == nil || !strings.Contains(err.Error(), "must be >= 0 (0: the default") {
			t.Errorf("%s: %v", flag, err)
		}
	}
}
