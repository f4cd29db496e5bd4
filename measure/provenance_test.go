package measure

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/data"
)

func TestRedactArgs(t *testing.T) {
	for _, tc := range []struct{ in, want []string }{
		{[]string{"infergate", "bench", "--api-key", "abc", "--requests", "30"}, []string{"infergate", "bench", "--api-key", Redacted, "--requests", "30"}},
		{[]string{"x", "--token=abc", "-api_key=z", "--client-secret", "s", "--password=p", "--auth", "u:p"},
			[]string{"x", "--token=" + Redacted, "-api_key=" + Redacted, "--client-secret", Redacted, "--password=" + Redacted, "--auth", Redacted}},
		// Counts, files and variable names are not secrets.
		{[]string{"x", "--sp-output-tokens", "64", "--api-key-env", "MY_KEY", "--key-file", "/k", "--sp-system-tokens=2048"},
			[]string{"x", "--sp-output-tokens", "64", "--api-key-env", "MY_KEY", "--key-file", "/k", "--sp-system-tokens=2048"}},
		// A secret flag given last, or followed by a flag, redacts nothing more.
		{[]string{"x", "--token"}, []string{"x", "--token"}},
		{[]string{"x", "--api-key", "--requests", "3"}, []string{"x", "--api-key", "--requests", "3"}},
		// Values in credential formats, wherever they are.
		{[]string{"x", "sk-proj-abcdefghijklmnop", "--header=Authorization: Bearer abc.def", "hf_abcdefghijklmnopq", "AKIAABCDEFGHIJKLMNOP", "sk-short"},
			[]string{"x", Redacted, "--header=Authorization: Bearer " + Redacted, Redacted, Redacted, "sk-short"}},
		// URLs: the password and secret query parameters.
		{[]string{"x", "--target", "http://user:hunter2@gpu-1:8000/v1?api_key=s3&model=m&sig=zz"},
			[]string{"x", "--target", "http://user:" + Redacted + "@gpu-1:8000/v1?api_key=" + Redacted + "&model=m&sig=" + Redacted}},
		{[]string{"x", "--target=https://tok@h/v1"}, []string{"x", "--target=https://" + Redacted + "@h/v1"}},
		{[]string{"x", "OPENAI_API_KEY=sk-zzzzzzzzzzzz", "MODE=fast"}, []string{"x", "OPENAI_API_KEY=" + Redacted, "MODE=fast"}},
		{[]string{"infergate", "--trace", "data/t.jsonl", "--target", "http://127.0.0.1:8080"}, []string{"infergate", "--trace", "data/t.jsonl", "--target", "http://127.0.0.1:8080"}},
	} {
		got := RedactArgs(tc.in)
		if !slices.Equal(got, tc.want) {
			t.Errorf("RedactArgs(%q)\n got %q\nwant %q", tc.in, got, tc.want)
		}
	}
}

// TestProvenanceBuild: the VCS stamp and the dirty flag come from the
// build info; the command is redacted; the host is this one.
func TestProvenanceBuild(t *testing.T) {
	p := NewProvenance("v1.2.3 (abc, go1.x)", []string{"infergate", "bench", "--api-key", "secret-value"}, time.Date(2026, 1, 2, 3, 4, 5, 0, time.FixedZone("x", 3600)))
	if p.Start != "2026-01-02T02:04:05Z" || p.Version != "v1.2.3 (abc, go1.x)" || p.GoVersion == "" || p.Host.CPUs < 1 || p.Host.GOMAXPROCS < 1 {
		t.Errorf("provenance %+v", p)
	}
	if slices.Contains(p.Command, "secret-value") {
		t.Errorf("command not redacted: %q", p.Command)
	}
	p.setBuild(&debug.BuildInfo{GoVersion: "go1.99", Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"}, {Key: "vcs.time", Value: "2026-01-01T00:00:00Z"}, {Key: "vcs.modified", Value: "true"}}})
	if p.Revision != "0123456789abcdef0123456789abcdef01234567" || !p.Modified || p.GoVersion != "go1.99" || p.RevisionTime != "2026-01-01T00:00:00Z" {
		t.Errorf("build %+v", p)
	}
	dir := t.TempDir()
	cpu := filepath.Join(dir, "cpuinfo")
	if err := os.WriteFile(cpu, []byte("processor\t: 0\nmodel name\t: Test CPU @ 3GHz\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := cpuModel(cpu); got != "Test CPU @ 3GHz" {
		t.Errorf("cpuModel %q", got)
	}
	if cpuModel(filepath.Join(dir, "none")) != "" {
		t.Error("cpuModel of a missing file")
	}
}

// TestDescribeFile: an embedded file's git blob id is the one
// data/PROVENANCE.md gives, its SHA-256 that of its bytes; a file on disk
// the same; a missing one an error.
func TestDescribeFile(t *testing.T) {
	f, err := DescribeFile(data.Embedded + data.Mooncake)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := data.ReadFile(data.Mooncake)
	sum := sha256.Sum256(b)
	if !strings.HasPrefix(f.GitBlob, "5a371794") || f.SHA256 != hex.EncodeToString(sum[:]) || f.Bytes != int64(len(b)) || f.Path != data.Embedded+data.Mooncake {
		t.Errorf("embedded trace: %+v", f)
	}
	path := filepath.Join(t.TempDir(), "t.jsonl")
	if err := os.WriteFile(path, []byte("hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err = DescribeFile(path)
	// git hash-object of "hello\n" is ce013625030ba8dba906f756967f9e9ca394464a.
	if err != nil || f.GitBlob != "ce013625030ba8dba906f756967f9e9ca394464a" || f.SHA256 != "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03" {
		t.Errorf("file: %+v %v", f, err)
	}
	if _, err := DescribeFile(path + ".missing"); err == nil {
		t.Error("missing file described")
	}
}

func TestRedactText(t *testing.T) {
	in := `Post "http://ops:***@127.0.0.1:1/v1?api_key=sk-abcdefghijklmnop/v1/completions": dial tcp 127.0.0.1:1: connect: connection refused`
	got := RedactText(in)
	if strings.Contains(got, "sk-abcdefghijklmnop") || !strings.Contains(got, "connection refused") || !strings.Contains(got, "127.0.0.1:1/v1") {
		t.Errorf("RedactText: %s", got)
	}
	if plain := "stream ended without [DONE]"; RedactText(plain) != plain {
		t.Errorf("RedactText changed %q", plain)
	}
}
