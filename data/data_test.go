package data

import (
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestFilesMatchProvenance checks that every embedded file is the unmodified
// public copy PROVENANCE.md names: its git blob id (SHA-1 of "blob <size>\0"
// and the contents) starts with the id given there, and its licence file is
// beside it.
func TestFilesMatchProvenance(t *testing.T) {
	prov, err := os.ReadFile("PROVENANCE.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile(`(?m)^\| ([a-z0-9_.]+) \|.*blob ([0-9a-f]{8})\).*\| ([A-Za-z0-9.-]+) \(([A-Za-z_-]+)\)`)
	rows := map[string][]string{}
	for _, m := range row.FindAllStringSubmatch(string(prov), -1) {
		rows[m[1]] = m[2:]
	}
	for _, name := range Names() {
		r, ok := rows[name]
		if !ok {
			t.Errorf("%s: no row in PROVENANCE.md", name)
			continue
		}
		b, err := ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		h := sha1.New()
		fmt.Fprintf(h, "blob %d\x00", len(b))
		h.Write(b)
		if got := hex.EncodeToString(h.Sum(nil)); !strings.HasPrefix(got, r[0]) {
			t.Errorf("%s: blob %s, PROVENANCE.md says %s", name, got, r[0])
		}
		if _, err := os.Stat(r[2]); err != nil {
			t.Errorf("%s: licence file: %v", name, err)
		}
	}
	if _, err := ReadFile("nope.txt"); err == nil {
		t.Error("ReadFile of a missing name succeeded")
	}
	if b, err := ReadPath(Embedded + Sonnet); err != nil || len(b) == 0 {
		t.Errorf("ReadPath(embedded sonnet): %d bytes, %v", len(b), err)
	}
}
