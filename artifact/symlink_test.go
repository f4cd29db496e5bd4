//go:build linux

package artifact

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// TestSymlinksInFolderNotFollowed: the cache opens no file of its folder
// through a symbolic link. A held blob replaced by a link to another file is
// not served (it is forgotten, the link deleted); a link planted at a
// download's partial name is replaced by the download, and the file it
// named is untouched. (The attack, live against infergate artifacts serve:
// a blob's name linked to a file outside the folder was served to any
// client; a partial's name linked to a file had the fetch truncate it and
// write the blob into it.)
func TestSymlinksInFolderNotFollowed(t *testing.T) {
	const other = "registry.ollama.ai/library/other:latest"
	o := newOrigin(t, map[string][]int{tinyRef: {50_000}, other: {60_000}})
	c := openCache(t, Config{Origins: []Source{o.source(t)}})
	if _, err := c.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{}); err != nil {
		t.Fatal(err)
	}
	victim := filepath.Join(t.TempDir(), "victim")
	const precious = "precious data\n"
	if err := os.WriteFile(victim, []byte(precious), 0o644); err != nil {
		t.Fatal(err)
	}

	// A held blob swapped for a link.
	held := o.biggest(tinyRef)
	p := c.BlobPath(held.Digest)
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, p); err != nil {
		t.Fatal(err)
	}
	if f, err := c.OpenBlob(held.Digest); err == nil || !errors.Is(err, ErrNotFound) {
		if f != nil {
			f.Close()
		}
		t.Fatalf("OpenBlob of a blob that is a symbolic link: %v, want ErrNotFound", err)
	}
	if c.Has(held.Digest) {
		t.Error("the linked blob is still held")
	}
	if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the link is still there: %v", err)
	}

	// A partial download's name linked to the victim.
	next := o.biggest(other)
	if err := os.Symlink(victim, filepath.Join(c.Dir(), partialDir, next.Digest.FileName())); err != nil {
		t.Fatal(err)
	}
	l, err := c.Acquire(testCtx(t), mustRef(t, other), AcquireOptions{})
	if err != nil {
		t.Fatalf("acquire with a link at the partial's name: %v", err)
	}
	defer l.Release()
	checkHeld(t, c, o, l.Manifest)
	if fi, err := os.Lstat(c.BlobPath(next.Digest)); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("the blob is not a regular file: %v %v", fi, err)
	}
	if b, err := os.ReadFile(victim); err != nil || string(b) != precious {
		t.Errorf("the linked file now holds %d bytes (%v), want its %d", len(b), err, len(precious))
	}
}
