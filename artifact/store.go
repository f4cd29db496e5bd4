package artifact

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// The cache's folder is an Ollama model store (OLLAMA_MODELS; ollama/ollama
// manifest/paths.go and types/model/name.go Filepath @v0.17.4):
//
//	<dir>/blobs/sha256-<hex>                           one verified blob
//	<dir>/manifests/<host>/<namespace>/<model>/<tag>   a manifest, as fetched
//	<dir>/partial/sha256-<hex>                         a download in progress
//
// so an Ollama server started with OLLAMA_MODELS=<dir> (and
// OLLAMA_NOPRUNE=1, so it leaves blobs alone) lists and loads every model the
// cache holds, and Link gives an engine its own store of hard links. A
// manifest is written only once every blob it names is present, and removed
// when one of them is evicted or found corrupt, so Ollama never sees a model
// with a missing blob. Partial downloads live outside blobs/, where Ollama
// does not look, and resume after a restart.

const (
	blobsDir     = "blobs"
	manifestsDir = "manifests"
	partialDir   = "partial"
)

// store is the folder's files; it keeps no state.
type store struct{ dir string }

func openStore(dir string) (*store, error) {
	for _, d := range []string{blobsDir, manifestsDir, partialDir} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, fmt.Errorf("artifact: %w", err)
		}
	}
	return &store{dir: dir}, nil
}

func (s *store) blobPath(d Digest) string    { return filepath.Join(s.dir, blobsDir, d.FileName()) }
func (s *store) partialPath(d Digest) string { return filepath.Join(s.dir, partialDir, d.FileName()) }
func (s *store) manifestPath(r Ref) string   { return filepath.Join(s.dir, manifestsDir, r.Path()) }

// foundBlob is a blob file found at start-up.
type foundBlob struct {
	digest Digest
	size   int64
	mtime  time.Time
}

// scanBlobs lists blobs/ (files named sha256-<hex>; others are left alone),
// most recently modified first: the cache touches a blob's mtime when an
// engine takes it, so mtime order is use order across restarts.
func (s *store) scanBlobs() ([]foundBlob, error) {
	ents, err := os.ReadDir(filepath.Join(s.dir, blobsDir))
	if err != nil {
		return nil, fmt.Errorf("artifact: %w", err)
	}
	var out []foundBlob
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		d, err := ParseDigest(e.Name())
		if err != nil {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue
		}
		out = append(out, foundBlob{digest: d, size: info.Size(), mtime: info.ModTime()})
	}
	slices.SortFunc(out, func(a, b foundBlob) int {
		return cmp.Or(b.mtime.Compare(a.mtime), strings.Compare(string(a.digest), string(b.digest)))
	})
	return out, nil
}

// foundManifest is a manifest file found at start-up.
type foundManifest struct {
	ref Ref
	m   *Manifest
}

// scanManifests reads manifests/<host>/<ns>/<model>/<tag>; files whose path
// is not a valid Ref or that do not parse are reported in bad (and left
// alone).
func (s *store) scanManifests() (found []foundManifest, bad []string, err error) {
	root := filepath.Join(s.dir, manifestsDir)
	err = filepath.WalkDir(root, func(p string, e fs.DirEntry, werr error) error {
		if werr != nil {
			return werr
		}
		rel, _ := filepath.Rel(root, p)
		depth := 0
		if rel != "." {
			depth = strings.Count(rel, string(filepath.Separator)) + 1
		}
		if e.IsDir() {
			if depth >= 4 {
				bad = append(bad, rel)
				return fs.SkipDir
			}
			return nil
		}
		parts := strings.Split(rel, string(filepath.Separator))
		if depth != 4 || !e.Type().IsRegular() {
			bad = append(bad, rel)
			return nil
		}
		r := Ref{Host: parts[0], Namespace: parts[1], Model: parts[2], Tag: parts[3]}
		if r.Validate() != nil {
			bad = append(bad, rel)
			return nil
		}
		raw, err := readBounded(p, MaxManifestBytes)
		if err != nil {
			bad = append(bad, rel)
			return nil
		}
		m, err := ParseManifest(raw)
		if err != nil {
			bad = append(bad, rel)
			return nil
		}
		found = append(found, foundManifest{ref: r, m: m})
		return nil
	})
	return found, bad, err
}

// readBounded reads a file of at most limit bytes.
func readBounded(p string, limit int64) ([]byte, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("artifact: %s is over %d bytes", p, limit)
	}
	return b, nil
}

// writeManifest writes a manifest atomically.
func (s *store) writeManifest(r Ref, raw []byte) error {
	p := s.manifestPath(r)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	return writeFileAtomic(p, raw)
}

// removeManifest deletes a manifest and the folders it leaves empty.
func (s *store) removeManifest(r Ref) error {
	p := s.manifestPath(r)
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	root := filepath.Join(s.dir, manifestsDir)
	for d := filepath.Dir(p); d != root && strings.HasPrefix(d, root); d = filepath.Dir(d) {
		if os.Remove(d) != nil { // not empty
			break
		}
	}
	return nil
}

// writeFileAtomic writes b to p through a temporary file in p's folder:
// write, fsync, rename, fsync the folder. A crash leaves the old file or the
// new one, never a torn one.
func writeFileAtomic(p string, b []byte) error {
	dir := filepath.Dir(p)
	f, err := os.CreateTemp(dir, ".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, p)
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	return syncDir(dir)
}

// syncDir fsyncs a folder, making a rename in it durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}

// ErrIntegrity reports bytes whose digest or size is not the one expected.
var ErrIntegrity = errors.New("artifact: integrity check failed")

// verifyFile hashes the file at p and checks its size and digest.
func verifyFile(p string, d Digest, size int64) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return err
	}
	if n != size {
		return fmt.Errorf("%w: %s is %d bytes, want %d", ErrIntegrity, d.Short(), n, size)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != d.Hex() {
		return fmt.Errorf("%w: %s hashes to sha256:%s", ErrIntegrity, d.Short(), got[:12])
	}
	return nil
}

// partialMaxAge is how long a partial download is kept for a resume.
const partialMaxAge = 24 * time.Hour

// prunePartials removes partial downloads untouched for partialMaxAge (a
// model nobody asked for again) and files in partial/ that are not named
// for a digest; it returns how many.
func (s *store) prunePartials(now time.Time) int {
	dir := filepath.Join(s.dir, partialDir)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	n := 0
	for _, e := range ents {
		info, err := e.Info()
		if err != nil {
			continue
		}
		if _, derr := ParseDigest(e.Name()); derr == nil && e.Type().IsRegular() && now.Sub(info.ModTime()) < partialMaxAge {
			continue
		}
		if os.RemoveAll(filepath.Join(dir, e.Name())) == nil {
			n++
		}
	}
	return n
}

// trimPartials deletes partial downloads, least recently written first,
// until those left hold at most limit bytes; skip names the digests being
// fetched (their files are open, and their bytes are counted in their
// reservations). It returns how many files and bytes it deleted.
func (s *store) trimPartials(limit int64, skip func(Digest) bool) (files int, bytes int64) {
	dir := filepath.Join(s.dir, partialDir)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, 0
	}
	type part struct {
		name  string
		size  int64
		mtime time.Time
	}
	var parts []part
	var total int64
	for _, e := range ents {
		d, err := ParseDigest(e.Name())
		if err != nil || !e.Type().IsRegular() || skip(d) {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue
		}
		parts = append(parts, part{e.Name(), info.Size(), info.ModTime()})
		total += info.Size()
	}
	if total <= limit {
		return 0, 0
	}
	slices.SortFunc(parts, func(a, b part) int {
		return cmp.Or(a.mtime.Compare(b.mtime), strings.Compare(a.name, b.name))
	})
	for _, p := range parts {
		if total <= limit {
			break
		}
		if os.Remove(filepath.Join(dir, p.name)) == nil {
			total -= p.size
			files++
			bytes += p.size
		}
	}
	return files, bytes
}
