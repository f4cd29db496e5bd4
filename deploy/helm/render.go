// Package helm renders infergate's Helm chart (deploy/helm/infergate) with a
// real Helm binary, the one scripts/helm.sh builds from the Go module proxy
// into the cache, so that tests can lint it, read what it renders and apply
// the manifests to a test API server.
//
// Shapes: Template returns the rendered manifests as one YAML document per
// string ("# Source: infergate/templates/<file>" comment first, as helm
// prints it), in helm's order; empty documents are dropped.
package helm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/internal/realpart"
)

// Version is the Helm release scripts/helm.sh builds by default
// (helm.sh/helm/v3; its go.mod asks for go 1.26.0, which the project's
// Go 1.26.8 satisfies). It must match the script's HELM_VERSION default.
const Version = "v3.22.0"

// Environment variables read by this package.
const (
	EnvHelm    = "INFERGATE_HELM"    // path to a helm binary to use instead of the cached build
	EnvCache   = realpart.EnvCache   // cache root (default $HOME/.cache/infergate)
	EnvRequire = realpart.EnvRequire // "1": fail instead of skip when helm is missing
)

// DefaultTimeout bounds one helm run (a template of this chart takes well
// under a second; the bound is for a wedged process).
const DefaultTimeout = 2 * time.Minute

// ErrNoHelm reports that no helm binary is available.
var ErrNoHelm = errors.New("helm: binary not available")

// CachedPath is where scripts/helm.sh build puts the binary:
// ${INFERGATE_CACHE:-$HOME/.cache/infergate}/helm/<Version>/helm.
func CachedPath() string {
	return filepath.Join(realpart.CacheDir("helm", Version), "helm")
}

// Binary returns the helm binary: $INFERGATE_HELM if set, else the cached
// build. The error wraps ErrNoHelm and says how to get one.
func Binary() (string, error) {
	if p := os.Getenv(EnvHelm); p != "" {
		if err := realpart.Executable(p); err != nil {
			return "", fmt.Errorf("%w: %s=%s: %v", ErrNoHelm, EnvHelm, p, err)
		}
		return p, nil
	}
	p := CachedPath()
	if err := realpart.Executable(p); err != nil {
		return "", fmt.Errorf("%w: %s not built; run scripts/helm.sh build (about 4 CPU-minutes cold), or set %s=/path/to/helm",
			ErrNoHelm, p, EnvHelm)
	}
	return p, nil
}

// Require returns the helm binary, or skips the test with the reason (fails
// it instead when INFERGATE_E2E_REQUIRE=1).
func Require(t testing.TB) string {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		realpart.Missing(t, err)
	}
	return bin
}

// ChartDir returns the chart's directory, deploy/helm/infergate, found next
// to this package's source.
func ChartDir() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("helm: cannot locate the chart (no caller information)")
	}
	dir := filepath.Join(filepath.Dir(file), "infergate")
	if _, err := os.Stat(filepath.Join(dir, "Chart.yaml")); err != nil {
		return "", fmt.Errorf("helm: chart not found: %w", err)
	}
	return dir, nil
}

// Options are one rendering of the chart.
type Options struct {
	// Release is the release name (default "infergate").
	Release string
	// Namespace is the release namespace (default "default").
	Namespace string
	// Values are values files' contents (YAML), applied in order after the
	// chart's values.yaml, as helm's -f.
	Values []string
	// Set are helm --set assignments ("replicas=3").
	Set []string
	// IncludeCRDs adds the chart's crds/ files to Template's documents
	// (helm template --include-crds; CRDs first), for applying the whole
	// rendering to an API server that lacks them.
	IncludeCRDs bool

	// chart replaces ChartDir (tests render a modified copy).
	chart string
}

func (o Options) args(cmd, chart, valuesDir string) ([]string, error) {
	release, ns := o.Release, o.Namespace
	if release == "" {
		release = "infergate"
	}
	if ns == "" {
		ns = "default"
	}
	args := []string{cmd}
	switch cmd {
	case "template":
		args = append(args, release)
		if o.IncludeCRDs {
			args = append(args, "--include-crds")
		}
	case "lint":
		args = append(args, "--strict")
	}
	args = append(args, chart, "--namespace", ns)
	for i, v := range o.Values {
		p := filepath.Join(valuesDir, fmt.Sprintf("values-%d.yaml", i))
		if err := os.WriteFile(p, []byte(v), 0o600); err != nil {
			return nil, err
		}
		args = append(args, "-f", p)
	}
	for _, s := range o.Set {
		args = append(args, "--set", s)
	}
	return args, nil
}

// run runs bin with the arguments of cmd under DefaultTimeout, with a
// private HOME-free Helm environment (its cache, config and data
// directories in a temporary folder: nothing is read from or written to
// the user's Helm setup). It returns stdout; stderr is in the error.
func run(ctx context.Context, bin, cmd string, o Options) (string, error) {
	chart := o.chart
	if chart == "" {
		dir, err := ChartDir()
		if err != nil {
			return "", err
		}
		chart = dir
	}
	tmp, err := os.MkdirTemp("", "infergate-helm-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	args, err := o.args(cmd, chart, tmp)
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, DefaultTimeout)
	defer cancel()
	c := exec.CommandContext(ctx, bin, args...)
	c.Env = append(os.Environ(),
		"HELM_CACHE_HOME="+filepath.Join(tmp, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(tmp, "config"),
		"HELM_DATA_HOME="+filepath.Join(tmp, "data"),
		"KUBECONFIG="+filepath.Join(tmp, "no-kubeconfig"),
	)
	var stdout, stderr bytes.Buffer
	c.Stdout, c.Stderr = &stdout, &stderr
	if err := c.Run(); err != nil {
		return stdout.String(), fmt.Errorf("helm %s: %w: %s%s", strings.Join(args, " "), err, stderr.String(), stdout.String())
	}
	return stdout.String(), nil
}

// Template renders the chart (helm template) and returns its documents.
func Template(ctx context.Context, bin string, o Options) ([]string, error) {
	out, err := run(ctx, bin, "template", o)
	if err != nil {
		return nil, err
	}
	return SplitDocuments(out), nil
}

// Lint runs helm lint --strict on the chart (warnings fail it) and returns
// its report.
func Lint(ctx context.Context, bin string, o Options) (string, error) {
	return run(ctx, bin, "lint", o)
}

// SplitDocuments splits a multi-document YAML stream at its "---" lines and
// drops the documents that hold only comments and blank lines.
func SplitDocuments(s string) []string {
	var docs []string
	var cur strings.Builder
	flush := func() {
		d := cur.String()
		cur.Reset()
		for _, line := range strings.Split(d, "\n") {
			if t := strings.TrimSpace(line); t != "" && !strings.HasPrefix(t, "#") {
				docs = append(docs, d)
				return
			}
		}
	}
	for _, line := range strings.SplitAfter(s, "\n") {
		if strings.TrimRight(line, " \r\n") == "---" {
			flush()
			continue
		}
		cur.WriteString(line)
	}
	flush()
	return docs
}
