package measure

import (
	"bufio"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"runtime"
	"runtime/debug"
	"strings"
	"time"

	"github.com/infergate/infergate/data"
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

// String is "path (N bytes, sha256 X, git blob Y)".
func (f SourceFile) String() string {
	return fmt.Sprintf("%s (%d bytes, sha256 %s, git blob %s)", f.Path, f.Bytes, f.SHA256, f.GitBlob)
}
