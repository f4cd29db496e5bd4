package gateway

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLoadConfigBounded: a configuration file over MaxConfigBytes is
// refused after reading past the bound only; os.ReadFile read a link to
// /dev/zero without end (at start, or at a SIGHUP reload).
func TestLoadConfigBounded(t *testing.T) {
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.Symlink("/dev/zero", p); err != nil {
		t.Skip(err)
	}
	if _, err := os.Stat(p); err != nil {
		t.Skip(err)
	}
	if _, err := LoadConfig(p); err == nil || !strings.Contains(err.Error(), "over the limit") {
		t.Fatalf("config of /dev/zero: %v", err)
	}
}
