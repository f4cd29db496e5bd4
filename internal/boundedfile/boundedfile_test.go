package boundedfile

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestReadBounded: a file over the limit is refused after limit+1 bytes
// are read, not read whole; /dev/zero (endless) is refused too.
func TestReadBounded(t *testing.T) {
	dir := t.TempDir()
	small := filepath.Join(dir, "small")
	if err := os.WriteFile(small, []byte("abc"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := Read(small, 3); err != nil || string(b) != "abc" {
		t.Fatalf("at the limit: %q %v", b, err)
	}
	if _, err := Read(small, 2); err == nil || !strings.Contains(err.Error(), "over the limit of 2 bytes") {
		t.Fatalf("over the limit: %v", err)
	}
	big := filepath.Join(dir, "big") // sparse: 256 MiB on no disk
	if err := os.WriteFile(big, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(big, 256<<20); err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := Read(big, 1<<20)
	runtime.ReadMemStats(&after)
	if err == nil {
		t.Fatal("a 256 MiB file read within a 1 MiB limit")
	}
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 16<<20 {
		t.Fatalf("%d MiB allocated to refuse a file over 1 MiB", grew>>20)
	}
	if _, err := os.Stat("/dev/zero"); err == nil {
		if _, err := Read("/dev/zero", 1<<20); err == nil {
			t.Fatal("/dev/zero read within a limit")
		}
	}
	if _, err := Read(filepath.Join(dir, "missing"), 1); !os.IsNotExist(err) {
		t.Fatalf("missing file: %v", err)
	}
}
