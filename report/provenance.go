package report

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/infergate/infergate/measure"
)

// ProvenanceFacts are p as a report's key-value rows: command, version, revision, Go,
// host, start, clock, target or fleet, workload and its files, profile.
func ProvenanceFacts(p *measure.Provenance) []Fact {
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
