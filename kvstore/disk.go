package kvstore

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// The disk tier: one file per entry, <DiskDir>/<hex of SHA-256(key), 32
// digits>.kvb, holding
//
//	magic "IGKV" | version 1 | key length (uint16 LE) | key |
//	token count (uint32 LE) | token ids (uint32 LE each) |
//	payload length (uint64 LE) | payload
//
// The store keeps the rest of the metadata in memory, so a file only needs
// what it would otherwise hold there. Files are not recovered across
// restarts: New removes every *.kvb file in the directory (and nothing else).

const (
	diskMagic   = "IGKV"
	diskVersion = 1
	diskExt     = ".kvb"
)

type disk struct{ dir string }

func openDisk(dir string) (*disk, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("kvstore: disk tier: %w", err)
	}
	d := &disk{dir: dir}
	if err := d.wipe(); err != nil {
		return nil, err
	}
	return d, nil
}

// wipe removes the tier's files.
func (d *disk) wipe() error {
	ents, err := os.ReadDir(d.dir)
	if err != nil {
		return fmt.Errorf("kvstore: disk tier: %w", err)
	}
	var errs []error
	for _, e := range ents {
		if e.Type().IsRegular() && strings.HasSuffix(e.Name(), diskExt) {
			if err := os.Remove(filepath.Join(d.dir, e.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

func (d *disk) path(key string) string {
	h := sha256.Sum256([]byte(key))
	return filepath.Join(d.dir, hex.EncodeToString(h[:16])+diskExt)
}

func (d *disk) write(key string, m *Meta, data []byte) error {
	hdr := make([]byte, 0, 4+1+2+len(key)+4+4*len(m.TokenIDs)+8)
	hdr = append(hdr, diskMagic...)
	hdr = append(hdr, diskVersion)
	hdr = binary.LittleEndian.AppendUint16(hdr, uint16(len(key)))
	hdr = append(hdr, key...)
	hdr = binary.LittleEndian.AppendUint32(hdr, uint32(len(m.TokenIDs)))
	for _, t := range m.TokenIDs {
		hdr = binary.LittleEndian.AppendUint32(hdr, t)
	}
	hdr = binary.LittleEndian.AppendUint64(hdr, uint64(len(data)))
	f, err := os.OpenFile(d.path(key), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(hdr)
	if err == nil && len(data) > 0 {
		_, err = f.Write(data)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(d.path(key))
	}
	return err
}

// read reads key's file back: ntok token ids and, for an entry with bytes,
// m.Size bytes. Anything else in the file (another key, other lengths, a
// short file) is an error.
func (d *disk) read(key string, m *Meta, ntok int) ([]uint32, []byte, error) {
	f, err := os.Open(d.path(key))
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	plen := int64(0)
	if m.HasData {
		plen = m.Size
	}
	hlen := 4 + 1 + 2 + len(key) + 4 + 4*ntok + 8
	st, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	if st.Size() != int64(hlen)+plen {
		return nil, nil, fmt.Errorf("kvstore: disk file %s: %d bytes, want %d", f.Name(), st.Size(), int64(hlen)+plen)
	}
	hdr := make([]byte, hlen)
	if _, err := io.ReadFull(f, hdr); err != nil {
		return nil, nil, err
	}
	want := make([]byte, 0, 7+len(key))
	want = append(want, diskMagic...)
	want = append(want, diskVersion)
	want = binary.LittleEndian.AppendUint16(want, uint16(len(key)))
	want = append(want, key...)
	if string(hdr[:len(want)]) != string(want) {
		return nil, nil, fmt.Errorf("kvstore: disk file %s: not this entry's", f.Name())
	}
	p := hdr[len(want):]
	if int(binary.LittleEndian.Uint32(p)) != ntok {
		return nil, nil, fmt.Errorf("kvstore: disk file %s: token count differs", f.Name())
	}
	p = p[4:]
	var tok []uint32
	if ntok > 0 {
		tok = make([]uint32, ntok)
		for i := range tok {
			tok[i] = binary.LittleEndian.Uint32(p[4*i:])
		}
	}
	p = p[4*ntok:]
	if int64(binary.LittleEndian.Uint64(p)) != plen {
		return nil, nil, fmt.Errorf("kvstore: disk file %s: payload length differs", f.Name())
	}
	var data []byte
	if m.HasData {
		data = make([]byte, plen)
		if _, err := io.ReadFull(f, data); err != nil {
			return nil, nil, err
		}
	}
	return tok, data, nil
}

func (d *disk) remove(key string) { _ = os.Remove(d.path(key)) }
