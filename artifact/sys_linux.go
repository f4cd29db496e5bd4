package artifact

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// residentBytes is how many bytes of the file at p the host page cache holds:
// mmap it read-only and ask mincore(2) which pages are resident (pages ×
// page size, the last one counted whole, capped at the file's size). It
// reads no data, and its memory is one residencyWindow-page vector whatever
// the file's size: mincore is asked window by window, not for the whole file
// at once (a whole-file vector is a byte per page, 128 MiB for a 512 GiB
// blob, and GET /v1/artifacts asks for every blob of every model).
func residentBytes(p string) (int64, error) {
	f, err := os.Open(p)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || st.Size() == 0 {
		return 0, err
	}
	size := st.Size()
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0, err
	}
	defer unix.Munmap(mem)
	page := int64(os.Getpagesize())
	var vec [residencyWindow]byte
	var pages int64
	for off := int64(0); off < size; off += residencyWindow * page {
		span := min(size-off, residencyWindow*page)
		n := (span + page - 1) / page
		// x/sys/unix has no Mincore wrapper: mincore(addr, length, vec).
		if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[off])), uintptr(span), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
			return 0, e
		}
		pages += residentPages(vec[:n])
	}
	return min(pages*page, size), nil
}

// residencyWindow is how many pages one mincore call covers (64 MiB of a
// file with 4 KiB pages): the vector residentBytes keeps on its stack.
const residencyWindow = 16 << 10

// residentPages counts the entries of a mincore vector whose low bit (the
// page is resident; the other bits are reserved) is set, eight at a time.
func residentPages(vec []byte) int64 {
	var n int
	for len(vec) >= 8 {
		n += bits.OnesCount64(binary.LittleEndian.Uint64(vec) & 0x0101010101010101)
		vec = vec[8:]
	}
	for _, v := range vec {
		n += int(v & 1)
	}
	return int64(n)
}

// DropPageCache asks the kernel to drop the file at p from the page cache
// (posix_fadvise POSIX_FADV_DONTNEED after an fdatasync, so no page is dirty):
// the next read comes from the disk. It needs no privilege and touches no
// other file, unlike writing /proc/sys/vm/drop_caches; the kernel may keep
// pages another process has mapped.
func DropPageCache(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		return err
	}
	return unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
}

// lockDir takes an exclusive, non-blocking flock on <dir>/.lock; closing the
// file releases it (and so does the process's exit).
func lockDir(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("artifact: %s is in use by another process (flock: %w)", dir, err)
	}
	return f, nil
}

// openNoFollow opens p of the cache's folder as os.OpenFile does, but never
// through a symbolic link (O_NOFOLLOW): a link planted in blobs/ or partial/
// by another user of the folder would have had the cache serve the file it
// names to any client (a held blob's name linked to /etc/shadow), or write a
// download into it and truncate it (a partial's name linked to any file the
// cache's user may write). With O_CREATE, a link in p's place is removed and
// a file made there; otherwise the open fails with an error wrapping
// os.ErrNotExist, as for a missing file.
func openNoFollow(p string, flag int, perm os.FileMode) (*os.File, error) {
	f, err := os.OpenFile(p, flag|unix.O_NOFOLLOW, perm)
	if err == nil || !errors.Is(err, unix.ELOOP) {
		return f, err
	}
	if flag&os.O_CREATE == 0 {
		return nil, fmt.Errorf("%w: %s is a symbolic link", os.ErrNotExist, p)
	}
	if rerr := os.Remove(p); rerr != nil {
		return nil, rerr
	}
	return os.OpenFile(p, flag|unix.O_NOFOLLOW, perm)
}
