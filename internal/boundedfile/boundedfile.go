// Package boundedfile reads a configuration file whole, within a size
// bound: os.ReadFile reads until EOF whatever the file is, so a config or
// keys file replaced by a link to /dev/zero (or a multi-GB file) grew the
// process without bound, at start or at a SIGHUP reload, before any check
// of its size ran.
package boundedfile

import (
	"fmt"
	"io"
	"os"
)

// Read returns path's contents, or an error when it holds more than limit
// bytes (at most limit+1 bytes are read).
func Read(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%s: over the limit of %d bytes", path, limit)
	}
	return data, nil
}
