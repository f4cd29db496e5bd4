package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// artifacts runs `infergate artifacts args...` to completion.
func artifacts(t *testing.T, args ...string) (string, error) {
	t.Helper()
	c := infergateCommand(append([]string{"artifacts"}, args...)...)
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	out, err := c.CombinedOutput()
	return string(out), err
}

// TestArtifactsCommands: add files to one cache, serve it, prefetch from it
// as a peer into another, list, locate, find a corrupt blob, prefetch a
// manifest file from a folder origin.
func TestArtifactsCommands(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	a, b, c := t.TempDir(), t.TempDir(), t.TempDir()
	files := t.TempDir()
	w := filepath.Join(files, "model.gguf")
	if err := os.WriteFile(w, []byte(strings.Repeat("weights!", 40_000)), 0o644); err != nil {
		t.Fatal(err)
	}
	tok := filepath.Join(files, "tokenizer.json")
	if err := os.WriteFile(tok, []byte(`{"model":{"type":"BPE"}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := artifacts(t, "add", "--dir", a, "acme/tiny:v1", w, tok)
	if err != nil || !strings.Contains(out, "registry.ollama.ai/acme/tiny:v1: manifest sha256:") {
		t.Fatalf("add: %v\n%s", err, out)
	}

	srv := start(t, "artifacts", "serve", "--dir", a, "--listen", "127.0.0.1:0")
	url := srv.await(t, regexp.MustCompile(`artifacts serving.* url=(http://\S+)`))

	out, err = artifacts(t, "prefetch", "--dir", b, "--peer", url, "acme/tiny:v1")
	if err != nil || !regexp.MustCompile(`3 blobs, 312\.5 KiB \(0 B already cached\); fetched 312\.5 KiB from peer`).MatchString(out) {
		t.Fatalf("prefetch from peer: %v\n%s", err, out)
	}
	out, err = artifacts(t, "prefetch", "--dir", b, "--offline", "acme/tiny:v1")
	if err != nil || !strings.Contains(out, "(312.5 KiB already cached); fetched nothing") {
		t.Fatalf("prefetch again: %v\n%s", err, out)
	}
	out, err = artifacts(t, "ls", "--dir", b, "--json")
	var ls struct {
		Models []struct {
			Model string
			Size  int64
			Blobs int
		}
	}
	if err != nil || json.Unmarshal([]byte(out), &ls) != nil || len(ls.Models) != 1 || ls.Models[0].Model != "registry.ollama.ai/acme/tiny:v1" || ls.Models[0].Blobs != 3 {
		t.Fatalf("ls: %v\n%s", err, out)
	}
	out, err = artifacts(t, "locate", "--dir", b, "acme/tiny:v1")
	if err != nil || !strings.Contains(out, "local 312.5 KiB") || !strings.Contains(out, "remote 0 B") {
		t.Fatalf("locate: %v\n%s", err, out)
	}
	srv.stop(t)

	// Damage the weights in b: verify deletes them and fails.
	blobs, _ := filepath.Glob(filepath.Join(b, "blobs", "sha256-*"))
	for _, p := range blobs {
		if st, _ := os.Stat(p); st.Size() == 320_000 {
			os.WriteFile(p, []byte(strings.Repeat("weights?", 40_000)), 0o644)
		}
	}
	out, err = artifacts(t, "verify", "--dir", b)
	if err == nil || !strings.Contains(out, "1 bad and deleted") {
		t.Fatalf("verify: %v\n%s", err, out)
	}

	// A manifest file, blobs from a folder origin.
	raw, err := os.ReadFile(filepath.Join(a, "manifests", "registry.ollama.ai", "acme", "tiny", "v1"))
	if err != nil {
		t.Fatal(err)
	}
	mf := filepath.Join(files, "tiny.json")
	os.WriteFile(mf, raw, 0o644)
	out, err = artifacts(t, "prefetch", "--dir", c, "--from-dir", a, mf)
	if err != nil || !strings.Contains(out, "registry.ollama.ai/local/tiny:latest: 3 blobs") || !strings.Contains(out, "from path") {
		t.Fatalf("prefetch manifest file: %v\n%s", err, out)
	}

	for _, bad := range [][]string{
		{"prefetch", "--dir", c, "../etc/passwd"},
		{"prefetch", "--dir", c, "--from", "ftp://x", "tiny"},
		{"prefetch", "--dir", c, "--budget", "lots", "tiny"},
		{"prefetch", "--dir", c, "nothere"},
	} {
		if out, err := artifacts(t, bad...); err == nil {
			t.Errorf("%v succeeded:\n%s", bad, out)
		}
	}
}
