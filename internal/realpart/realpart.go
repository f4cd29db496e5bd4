// Package realpart holds the conventions of the tests that need a real part
// built or installed outside the repository (Ollama, Helm, kube-apiserver
// and etcd, redis-server, Prometheus, Chromium): where the heavy builds are
// cached, and how a test without its part ends — skipped, or failed when
// INFERGATE_E2E_REQUIRE=1 (.ci/run sets it, so CI never passes by skipping).
package realpart

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// Environment variables read by this package.
const (
	EnvRequire = "INFERGATE_E2E_REQUIRE" // "1": fail instead of skip when a part is missing
	EnvCache   = "INFERGATE_CACHE"       // cache root (default $HOME/.cache/infergate)
)

// Required reports whether a missing part fails the test (EnvRequire=1).
func Required() bool { return os.Getenv(EnvRequire) == "1" }

// SkipShort skips t in -short mode unless parts are required; what names
// the test's part ("the kube-apiserver test").
func SkipShort(t testing.TB, what string) {
	t.Helper()
	if testing.Short() && !Required() {
		t.Skipf("skipping %s in -short mode", what)
	}
}

// Missing ends t for want of a part: err says which and how to get it.
// It fails t when parts are required, else skips it.
func Missing(t testing.TB, err error) {
	t.Helper()
	if Required() {
		t.Fatalf("%v (%s=1, so this is a failure)", err, EnvRequire)
	}
	t.Skipf("skipping: %v", err)
}

// CacheDir is a build's folder in the cache, keyed by version:
// ${INFERGATE_CACHE:-$HOME/.cache/infergate}/name/version, as the scripts in
// scripts/ fill it.
func CacheDir(name, version string) string {
	root := os.Getenv(EnvCache)
	if root == "" {
		home, err := os.UserHomeDir()
		if err != nil || home == "" {
			home = "/root"
		}
		root = filepath.Join(home, ".cache", "infergate")
	}
	return filepath.Join(root, name, version)
}

// Executable returns nil if p is a regular file with an execute bit.
func Executable(p string) error {
	st, err := os.Stat(p)
	if err != nil {
		return err
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return fmt.Errorf("%s is not an executable file", p)
	}
	return nil
}
