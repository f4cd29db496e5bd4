package auth

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestKeysFileReadBounded: a keys file over the bound is refused after
// reading past the bound only. os.ReadFile read it whole first: a keys
// file replaced by a link to /dev/zero grew the process without end at a
// SIGHUP reload.
func TestKeysFileReadBounded(t *testing.T) {
	p := filepath.Join(t.TempDir(), "keys")
	if err := os.Symlink("/dev/zero", p); err != nil {
		t.Skip(err)
	}
	if _, err := os.Stat(p); err != nil {
		t.Skip(err)
	}
	_, _, err := Load(Config{KeysFile: p}, nil)
	if err == nil || !strings.Contains(err.Error(), "over the limit") {
		t.Fatalf("keys file of /dev/zero: %v", err)
	}
}
