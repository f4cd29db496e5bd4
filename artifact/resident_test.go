//go:build linux

package artifact

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// TestResidentBytesBoundedMemory: residentBytes of a 64 GiB (sparse) blob
// allocates a fixed amount, not a byte per page (the attack: 64 concurrent
// GET /v1/artifacts on a cache holding a 512 GiB blob took infergate
// artifacts serve from 74 MB to 8.36 GB RSS, 128 MiB of mincore vector per
// request), and still counts the pages it wrote.
func TestResidentBytesBoundedMemory(t *testing.T) {
	p := filepath.Join(t.TempDir(), "sparse")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	const size = 64 << 30
	if err := f.Truncate(size); err != nil {
		t.Skipf("no sparse file of %d bytes here: %v", size, err)
	}
	// Two pages written far apart: resident until the kernel reclaims them.
	page := int64(os.Getpagesize())
	for _, off := range []int64{0, size - page} {
		if _, err := f.WriteAt(make([]byte, page), off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()

	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	n, err := residentBytes(p)
	runtime.ReadMemStats(&after)
	if err != nil {
		t.Fatal(err)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 1<<20 {
		t.Errorf("residentBytes of a %d-byte file allocated %d bytes, want under 1 MiB", size, alloc)
	}
	if n < 0 || n > 2*page {
		t.Errorf("resident %d bytes, want at most the %d written", n, 2*page)
	}
}

// TestResidentPages checks the word-at-a-time count against a byte loop,
// with mincore's reserved bits set.
func TestResidentPages(t *testing.T) {
	for n := range 40 {
		vec := make([]byte, n)
		want := int64(0)
		for i := range vec {
			vec[i] = byte(i*37) &^ 1
			if i%3 == 0 || i%7 == 0 {
				vec[i] |= 1
				want++
			}
		}
		if got := residentPages(vec); got != want {
			t.Errorf("len %d: %d resident pages, want %d", n, got, want)
		}
	}
}

// TestResidentBytesCountsWholeFile: a file over several mincore windows,
// every page freshly written (resident), is counted to its size.
func TestResidentBytesCountsWholeFile(t *testing.T) {
	page := os.Getpagesize()
	size := 2*residencyWindow*page + 3*page + 100
	p := filepath.Join(t.TempDir(), "full")
	if err := os.WriteFile(p, make([]byte, size), 0o644); err != nil {
		t.Fatal(err)
	}
	n, err := residentBytes(p)
	if err != nil {
		t.Fatal(err)
	}
	// The kernel may reclaim a page between the write and the count;
	// almost all stay.
	if n > int64(size) || n < int64(size)/2 {
		t.Errorf("resident %d of %d bytes", n, size)
	}
}
