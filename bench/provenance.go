package bench

import (
	"bufio"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"net/url"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/infergate/infergate/data"
	"github.com/infergate/infergate/sim"
)

// Provenance says what produced a report, so that its reader can tell what
// was measured, on what, and run it again: the command line, the build, the
// host, the workload with its files' digests, the engine profile and the
// clock. `infergate bench` and `plan` record it in their JSON (key
// "provenance") and HTML reports.
type Provenance struct {
	// Command is the command line (os.Args), secret-looking values replaced
	// by Redacted (RedactArgs).
	Command []string `json:"command"`
	// Version is the infergate version, as `infergate version` prints it.
	Version string `json:"version"`
	// Revision, RevisionTime and Modified are the VCS revision the binary
	// was built from, its commit time and whether the tree had uncommitted
	// changes (debug.ReadBuildInfo: vcs.revision, vcs.time, vcs.modified);
	// empty when the build was not stamped (go run, go test).
	Revision     string `json:"vcs_revision,omitempty"`
	RevisionTime string `json:"vcs_time,omitempty"`
	Modified     bool   `json:"vcs_modified,omitempty"`
	// GoVersion is the Go toolchain that built the binary.
	GoVersion string `json:"go_version"`
	// Host is the machine that ran the command.
	Host Host `json:"host"`
	// Start is when the command started (UTC, RFC 3339); WallS is how long
	// it ran (s of wall time; 0 when not recorded).
	Start string  `json:"start"`
	WallS float64 `json:"wall_s,omitempty"`
	// Clock is "virtual" (a discrete-event simulation: no wall clock, no
	// lag) or "real".
	Clock string `json:"clock"`
	// TimeScale is, in real time, the engines' simulated seconds per wall
	// second by which latencies were scaled to engine time (the simulated
	// fleet's speedup, or --time-scale against a target); 0 in virtual time.
	TimeScale float64 `json:"time_scale,omitempty"`
	// Speedup is, in real time, the factor arrivals were compressed by.
	Speedup float64 `json:"speedup,omitempty"`
	// Target is the endpoint replayed against (--target, redacted); empty
	// for a simulated fleet.
	Target string `json:"target,omitempty"`
	// Engines is the simulated fleet's size (bench --compare; plan sweeps
	// sizes, one per row); 0 against a target.
	Engines int `json:"engines,omitempty"`
	// Workload is what was replayed; nil when not recorded.
	Workload *Workload `json:"workload,omitempty"`
	// Profile is the simulated engines' model; nil against a target.
	Profile *ProfileInfo `json:"profile,omitempty"`
}

// Host describes the machine a run ran on. Its name is left out: reports
// are shared, and host names can say more than they should.
type Host struct {
	OS   string `json:"os"`
	Arch string `json:"arch"`
	// CPUs is the logical CPUs usable by the process (runtime.NumCPU) and
	// GOMAXPROCS the Go scheduler's limit.
	CPUs       int `json:"cpus"`
	GOMAXPROCS int `json:"gomaxprocs"`
	// CPUModel is /proc/cpuinfo's first "model name" (empty elsewhere).
	CPUModel string `json:"cpu_model,omitempty"`
}

// Workload describes the requests a run replayed.
type Workload struct {
	// Kind is the workload kind (--workload: mooncake, azure,
	// shared-prefix, chat).
	Kind string `json:"kind"`
	// Files are the files the workload was read from, in the order read;
	// none for a generated workload.
	Files []SourceFile `json:"files,omitempty"`
	// Params are the kind's parameters (flag name without dashes → value).
	Params map[string]string `json:"params,omitempty"`
	// Records is the number of requests the workload has, and Replayed the
	// number replayed (the first Replayed, --requests), warm-up included.
	Records  int `json:"records"`
	Replayed int `json:"replayed"`
}

// SourceFile identifies a file a run read.
type SourceFile struct {
	// Path is the path as given, or data.Embedded + name for a file
	// embedded in the binary.
	Path string `json:"path"`
	// Bytes is the file's size.
	Bytes int64 `json:"bytes"`
	// SHA256 is the hex SHA-256 of its contents.
	SHA256 string `json:"sha256"`
	// GitBlob is its git blob id (`git hash-object`: SHA-1 of "blob <size>\0"
	// and the contents); data/PROVENANCE.md gives the embedded files'.
	GitBlob string `json:"git_blob"`
}

// ProfileInfo is the engine profile of a simulated fleet: its name, its key
// numbers and where it came from.
type ProfileInfo struct {
	Name           string `json:"name"`
	Model          string `json:"model"`
	GPU            string `json:"gpu"`
	TensorParallel int    `json:"tensor_parallel"`
	// KVBlocks is each engine's KV capacity in blocks of BlockSize tokens.
	KVBlocks  int `json:"kv_blocks"`
	BlockSize int `json:"block_size"`
	// MaxModelLen is the longest sequence an engine accepts (tokens; 0: no
	// limit but KV capacity).
	MaxModelLen int `json:"max_model_len,omitempty"`
	// Source is the profile's file: data.Embedded + "sim/profiles/NAME.yaml"
	// for a built-in profile, else the --profile-file path; File is that
	// file's digest when it was read from disk.
	Source string      `json:"source"`
	File   *SourceFile `json:"file,omitempty"`
}

// NewProvenance starts a Provenance for a command run with args (os.Args)
// at start by a binary of version: the redacted command line, the build's
// VCS stamp and Go version, and the host. The caller fills in the run.
func NewProvenance(version string, args []string, start time.Time) *Provenance {
	p := &Provenance{Command: RedactArgs(args), Version: version, GoVersion: runtime.Version(),
		Start: start.UTC().Format(time.RFC3339), Host: currentHost()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		p.setBuild(bi)
	}
	return p
}

// setBuild copies bi's Go version and VCS stamp.
func (p *Provenance) setBuild(bi *debug.BuildInfo) {
	if bi.GoVersion != "" {
		p.GoVersion = bi.GoVersion
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			p.Revision = s.Value
		case "vcs.time":
			p.RevisionTime = s.Value
		case "vcs.modified":
			p.Modified = s.Value == "true"
		}
	}
}

func currentHost() Host {
	return Host{OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU(), GOMAXPROCS: runtime.GOMAXPROCS(0), CPUModel: cpuModel("/proc/cpuinfo")}
}

// cpuModel is the first "model name" of a /proc/cpuinfo file (its first
// 64 KiB), "" when there is none.
func cpuModel(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(io.LimitReader(f, 64<<10))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// DescribeFile reads path (a file, or data.Embedded + name) and returns its
// size and digests.
func DescribeFile(path string) (SourceFile, error) {
	var f fs.File
	var err error
	if name, ok := strings.CutPrefix(path, data.Embedded); ok {
		f, err = data.Open(name)
	} else {
		f, err = os.Open(path)
	}
	if err != nil {
		return SourceFile{}, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return SourceFile{}, err
	}
	sum, blob := sha256.New(), sha1.New()
	fmt.Fprintf(blob, "blob %d\x00", st.Size())
	n, err := io.Copy(io.MultiWriter(sum, blob), f)
	if err != nil {
		return SourceFile{}, fmt.Errorf("%s: %w", path, err)
	}
	if n != st.Size() {
		return SourceFile{}, fmt.Errorf("%s: read %d bytes, its size is %d (changed while read?)", path, n, st.Size())
	}
	return SourceFile{Path: path, Bytes: n, SHA256: hex.EncodeToString(sum.Sum(nil)), GitBlob: hex.EncodeToString(blob.Sum(nil))}, nil
}

// NewProfileInfo describes the profile of engines configured by cfg (its
// defaults applied: KV blocks and block size as the engines use them),
// read from file ("" for the built-in profile of that name; then Source is
// data.Embedded + "sim/profiles/NAME.yaml" and File nil).
func NewProfileInfo(cfg sim.Config, file string) (*ProfileInfo, error) {
	cfg = cfg.WithDefaults()
	p := cfg.Profile
	pi := &ProfileInfo{Name: p.Name, Model: p.Model, GPU: p.GPU, TensorParallel: p.TensorParallel,
		KVBlocks: cfg.NumBlocks, BlockSize: cfg.BlockSize, MaxModelLen: p.MaxModelLen,
		Source: data.Embedded + "sim/profiles/" + p.Name + ".yaml"}
	if file != "" {
		sf, err := DescribeFile(file)
		if err != nil {
			return nil, err
		}
		pi.Source, pi.File = file, &sf
	}
	return pi, nil
}

// Redacted replaces a secret-looking value in a recorded command line.
const Redacted = "REDACTED"

// secretWords mark a flag, URL query parameter or NAME=VALUE name as
// carrying a secret when one of its words (split at '-', '_' and '.',
// lower case) is one of them: "api-key", "access_token", "apiKey" do,
// "sp-output-tokens" does not.
var secretWords = []string{"key", "apikey", "token", "secret", "password", "passwd", "pwd", "credential", "credentials",
	"auth", "authorization", "bearer", "cookie", "signature", "sig"}

// notSecretSuffixes mark a secret-looking flag whose value only says where
// the secret is (an environment variable's name, a file).
var notSecretSuffixes = []string{"-env", "_env", "-file", "_file", "-path", "_path", "-dir", "_dir"}

// secretPrefixes start well-known credential formats: OpenAI and
// Anthropic-style keys, Hugging Face, GitHub, GitLab and Slack tokens, AWS
// access key ids.
var secretPrefixes = []string{"sk-", "sk_", "hf_", "ghp_", "gho_", "ghs_", "ghu_", "github_pat_", "glpat-", "xoxb-", "xoxp-", "xoxa-", "AKIA", "ASIA"}

// RedactArgs returns a copy of a command line with secret-looking values
// replaced by Redacted:
//
//   - the value of a flag whose name says it holds a secret (a word key,
//     token, secret, password, credential, auth, ...: --api-key X,
//     --token=X; not --sp-output-tokens), unless the name ends in -env,
//     -file, -path or -dir;
//   - the value of a NAME=VALUE argument whose name does;
//   - a value in a well-known credential format (sk-..., hf_..., ghp_...,
//     AKIA...) or carrying an HTTP credential ("Bearer ...", "Basic ...");
//   - a URL's password and its secret-looking query parameters.
//
// It errs toward redacting: a boolean flag with such a name takes the next
// argument with it. args[0], the program, is kept.
func RedactArgs(args []string) []string {
	out := make([]string, len(args))
	redactNext := false
	for i, a := range args {
		switch {
		case i == 0:
			out[i] = a
		case redactNext && !strings.HasPrefix(a, "-"):
			out[i] = Redacted
			redactNext = false
		default:
			redactNext = false
			out[i] = redactArg(a, &redactNext)
		}
	}
	return out
}

// redactArg redacts one argument; for a secret-named flag without a value
// it sets *next so that the following argument is redacted.
func redactArg(a string, next *bool) string {
	if strings.HasPrefix(a, "-") && a != "-" && a != "--" {
		name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if secretName(name) {
			if !hasVal {
				*next = true
				return a
			}
			return a[:len(a)-len(val)] + Redacted
		}
		if hasVal {
			return a[:len(a)-len(val)] + RedactValue(val)
		}
		return a
	}
	if name, _, ok := strings.Cut(a, "="); ok && !strings.ContainsAny(name, " /:") && secretName(name) {
		return name + "=" + Redacted
	}
	return RedactValue(a)
}

// secretName reports whether a flag, parameter or variable name says it
// holds a secret.
func secretName(name string) bool {
	n := strings.ToLower(name)
	for _, s := range notSecretSuffixes {
		if strings.HasSuffix(n, s) {
			return false
		}
	}
	for w := range strings.FieldsFuncSeq(n, func(r rune) bool { return r == '-' || r == '_' || r == '.' }) {
		if slices.Contains(secretWords, w) {
			return true
		}
	}
	return false
}

// RedactValue redacts a value that is itself a credential (see RedactArgs),
// or a URL carrying one.
func RedactValue(v string) string {
	for _, p := range secretPrefixes {
		if strings.HasPrefix(v, p) && len(v) > len(p)+8 {
			return Redacted
		}
	}
	lv := strings.ToLower(v)
	for _, scheme := range []string{"bearer ", "basic ", "token "} {
		if i := strings.Index(lv, scheme); i >= 0 {
			return v[:i+len(scheme)] + Redacted
		}
	}
	if strings.Contains(v, "://") {
		if u, err := url.Parse(v); err == nil && u.Host != "" {
			changed := false
			if u.User != nil {
				if _, ok := u.User.Password(); ok {
					u.User = url.UserPassword(u.User.Username(), Redacted)
				} else {
					u.User = url.User(Redacted)
				}
				changed = true
			}
			if q := u.Query(); len(q) > 0 {
				for k := range q {
					if secretName(k) {
						q.Set(k, Redacted)
						changed = true
					}
				}
				if changed {
					u.RawQuery = q.Encode()
				}
			}
			if changed {
				return u.String()
			}
		}
	}
	return v
}

// RedactText redacts every URL and credential-looking word of a message
// (RedactValue), such as an HTTP client's error naming the URL it failed
// on; words are separated by spaces and may be quoted.
func RedactText(msg string) string {
	words := strings.Split(msg, " ")
	changed := false
	for i, w := range words {
		core := strings.TrimRight(strings.TrimLeft(w, `"'(<`), `"'):,;>`)
		if core == "" {
			continue
		}
		if r := RedactValue(core); r != core {
			words[i] = strings.Replace(w, core, r, 1)
			changed = true
		}
	}
	if !changed {
		return msg
	}
	return strings.Join(words, " ")
}

// ShellQuote joins args into one line a POSIX shell reads back as args:
// each argument that needs it in single quotes.
func ShellQuote(args []string) string {
	out := make([]string, len(args))
	for i, a := range args {
		if a != "" && strings.Trim(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=+./:,@%^") == "" {
			out[i] = a
		} else {
			out[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
	}
	return strings.Join(out, " ")
}

// ClockText says in words what clock the run ran on and how latencies
// were scaled.
func (p *Provenance) ClockText() string {
	switch {
	case p.Clock == "virtual":
		return "virtual time (discrete-event simulation: no wall clock, no lag)"
	case p.Target != "":
		return fmt.Sprintf("real time: arrivals ÷ %g, latencies × %g (the target's time scale) to engine time", p.Speedup, p.TimeScale)
	}
	return fmt.Sprintf("real time: simulated engines at %g× (latencies × %g to engine time), arrivals ÷ %g", p.TimeScale, p.TimeScale, p.Speedup)
}

// Facts are p as a report's key-value rows: command, version, revision, Go,
// host, start, clock, target or fleet, workload and its files, profile.
func (p *Provenance) Facts() []Fact {
	fs := []Fact{{Key: "command", Field: "command", Value: ShellQuote(p.Command), Mono: true},
		{Key: "infergate", Field: "version", Value: p.Version}}
	if p.Revision != "" {
		v := p.Revision
		if p.Modified {
			v += " (modified: uncommitted changes)"
		}
		if p.RevisionTime != "" {
			v += ", committed " + p.RevisionTime
		}
		fs = append(fs, Fact{Key: "revision", Field: "revision", Value: v, Mono: true})
	} else {
		fs = append(fs, Fact{Key: "revision", Field: "revision", Value: "not stamped (built by go run or go test)"})
	}
	h := p.Host
	host := fmt.Sprintf("%s/%s, %d CPUs, GOMAXPROCS %d", h.OS, h.Arch, h.CPUs, h.GOMAXPROCS)
	if h.CPUModel != "" {
		host += ", " + h.CPUModel
	}
	fs = append(fs, Fact{Key: "Go", Field: "go", Value: p.GoVersion}, Fact{Key: "host", Field: "host", Value: host})
	start := p.Start
	if p.WallS > 0 {
		start += fmt.Sprintf(" (ran %s of wall time)", time.Duration(p.WallS*float64(time.Second)).Round(100*time.Millisecond))
	}
	fs = append(fs, Fact{Key: "started", Field: "start", Value: start}, Fact{Key: "clock", Field: "clock", Value: p.ClockText()})
	if p.Target != "" {
		fs = append(fs, Fact{Key: "target", Field: "target", Value: p.Target, Mono: true})
	} else if p.Engines > 0 {
		fs = append(fs, Fact{Key: "fleet", Field: "fleet", Value: fmt.Sprintf("%d simulated engines", p.Engines)})
	}
	if w := p.Workload; w != nil {
		v := fmt.Sprintf("%s: %d of %d requests replayed", w.Kind, w.Replayed, w.Records)
		if len(w.Params) > 0 {
			keys := slices.Sorted(maps.Keys(w.Params))
			kv := make([]string, len(keys))
			for i, k := range keys {
				kv[i] = k + "=" + w.Params[k]
			}
			v += " (" + strings.Join(kv, ", ") + ")"
		}
		fs = append(fs, Fact{Key: "workload", Field: "workload", Value: v})
		for _, f := range w.Files {
			fs = append(fs, Fact{Key: "trace", Field: "trace", Mono: true, Value: f.String()})
		}
	}
	if pr := p.Profile; pr != nil {
		v := fmt.Sprintf("%s: %s on %d × %s; KV %d blocks × %d tokens = %d tokens per engine",
			pr.Name, pr.Model, pr.TensorParallel, pr.GPU, pr.KVBlocks, pr.BlockSize, pr.KVBlocks*pr.BlockSize)
		if pr.MaxModelLen > 0 {
			v += fmt.Sprintf(", max model length %d", pr.MaxModelLen)
		}
		fs = append(fs, Fact{Key: "profile", Field: "profile", Value: v})
		src := pr.Source
		if pr.File != nil {
			src = pr.File.String()
		}
		fs = append(fs, Fact{Key: "profile file", Field: "profile-source", Value: src, Mono: true})
	}
	return fs
}

// String is "path (N bytes, sha256 X, git blob Y)".
func (f SourceFile) String() string {
	return fmt.Sprintf("%s (%d bytes, sha256 %s, git blob %s)", f.Path, f.Bytes, f.SHA256, f.GitBlob)
}
