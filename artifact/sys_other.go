//go:build !linux

package artifact

import (
	"errors"
	"os"
)

func residentBytes(string) (int64, error) { return 0, nil }

// DropPageCache is Linux-only.
func DropPageCache(string) error { return errors.New("artifact: DropPageCache needs Linux") }

// lockDir takes no lock outside Linux.
func lockDir(string) (*os.File, error) { return nil, nil }

// openNoFollow is os.OpenFile outside Linux (links are followed).
func openNoFollow(p string, flag int, perm os.FileMode) (*os.File, error) {
	return os.OpenFile(p, flag, perm)
}
