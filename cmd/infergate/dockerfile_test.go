package main

import (
	"bufio"
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/infergate/infergate/internal/childproc"
)

// dockerfile returns the repository's Dockerfile instructions, one string
// per instruction (continuation lines joined, comments dropped).
func dockerfile(t *testing.T) []string {
	t.Helper()
	f, err := os.Open(filepath.Join("..", "..", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []string
	var cur strings.Builder
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		cont := strings.HasSuffix(line, "\\")
		cur.WriteString(strings.TrimSuffix(line, "\\"))
		if cont {
			cur.WriteByte(' ')
			continue
		}
		out = append(out, cur.String())
		cur.Reset()
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestDockerfile checks the container recipe without a Docker engine (none
// runs on these machines): the final stage is the empty base and runs as a
// non-root user, and the build stage's go build line, run here as written
// (environment, flags, package), gives a static binary (no ELF interpreter,
// no shared libraries) that reports the version passed at link time.
func TestDockerfile(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	if testing.Short() {
		t.Skip("builds the binary; skipped with -short")
	}
	ins := dockerfile(t)
	var froms, users []string
	var build string
	for _, in := range ins {
		kw, rest, _ := strings.Cut(in, " ")
		switch strings.ToUpper(kw) {
		case "FROM":
			froms = append(froms, rest)
		case "USER":
			users = append(users, strings.TrimSpace(rest))
		case "RUN":
			if strings.Contains(rest, "go build") {
				build = rest
			}
		}
	}
	if len(froms) < 2 || strings.Fields(froms[len(froms)-1])[0] != "scratch" {
		t.Errorf("final stage %v: want FROM scratch after a build stage", froms)
	}
	if len(users) == 0 {
		t.Fatal("no USER: the image would run as root")
	}
	if u := users[len(users)-1]; u == "0" || strings.HasPrefix(u, "0:") || strings.HasPrefix(u, "root") {
		t.Errorf("USER %s is root", u)
	}
	m := regexp.MustCompile(`^((?:[A-Z_]+=\S+ )*)go build (.*) -o (\S+) (\./\S+)$`).FindStringSubmatch(strings.TrimSpace(build))
	if m == nil {
		t.Fatalf("build stage RUN %q: want ENV=... go build FLAGS -o OUT ./PKG", build)
	}
	env := strings.Fields(m[1])
	if !strings.Contains(m[1], "CGO_ENABLED=0") {
		t.Errorf("build line %q: without CGO_ENABLED=0 the binary is not static", build)
	}
	const version = "v0.0.0-dockerfile-test"
	flags := strings.ReplaceAll(m[2], "${VERSION}", version)
	args := []string{"build"}
	// The flags as the shell splits them: -ldflags takes one quoted word.
	for _, f := range regexp.MustCompile(`"[^"]*"|\S+`).FindAllString(flags, -1) {
		args = append(args, strings.Trim(f, `"`))
	}
	bin := filepath.Join(t.TempDir(), "infergate")
	args = append(args, "-o", bin, m[4])
	c := exec.Command("go", args...)
	c.SysProcAttr = childproc.Attr()
	c.Dir = filepath.Join("..", "..")
	c.Env = append(os.Environ(), env...)
	if out, err := c.CombinedOutput(); err != nil {
		t.Fatalf("go %v: %v\n%s", args, err, out)
	}
	ef, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer ef.Close()
	for _, p := range ef.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("binary has an ELF interpreter: not static, it will not start on the empty base")
		}
	}
	if libs, _ := ef.ImportedLibraries(); len(libs) > 0 {
		t.Errorf("binary needs shared libraries %v", libs)
	}
	out, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), version) {
		t.Errorf("infergate version: %v %q, want %s", err, out, version)
	}
}
