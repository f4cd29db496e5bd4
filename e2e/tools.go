package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/infergate/infergate/internal/childproc"
	"github.com/infergate/infergate/internal/realpart"
)

// Real tools the dashboard tests drive (Debian packages: apt-get install
// prometheus chromium), and the infergate binary itself.
const (
	EnvPrometheus = "INFERGATE_PROMETHEUS" // path to a prometheus binary (default: prometheus in PATH)
	EnvChromium   = "INFERGATE_CHROMIUM"   // path to a chromium binary (default: chromium in PATH)
)

// ErrNoTool reports that a tool a test needs is not installed.
var ErrNoTool = errors.New("e2e: tool not available")

// ToolBinary returns the binary of a tool: $env if set, else the first of
// names found in PATH. The error wraps ErrNoTool and says how to install it.
func ToolBinary(env, pkg string, names ...string) (string, error) {
	if p := os.Getenv(env); p != "" {
		if err := realpart.Executable(p); err != nil {
			return "", fmt.Errorf("%w: %s=%s: %v", ErrNoTool, env, p, err)
		}
		return p, nil
	}
	for _, n := range names {
		if p, err := exec.LookPath(n); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w: %s not found in PATH; apt-get install %s, or set %s", ErrNoTool, strings.Join(names, "/"), pkg, env)
}

// RequireTool is ToolBinary for a test: it skips (or, with
// INFERGATE_E2E_REQUIRE=1, fails) when the tool is missing, and skips in
// -short mode unless required.
func RequireTool(t testing.TB, env, pkg string, names ...string) string {
	t.Helper()
	realpart.SkipShort(t, "the "+pkg+" test")
	bin, err := ToolBinary(env, pkg, names...)
	if err != nil {
		realpart.Missing(t, err)
	}
	return bin
}

// BuildInfergate builds cmd/infergate into dir with the go command that
// runs the tests (GOROOT/bin/go, else go in PATH) and returns the binary.
func BuildInfergate(ctx context.Context, dir string) (string, error) {
	goBin := filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	if os.Getenv("GOROOT") == "" || realpart.Executable(goBin) != nil {
		p, err := exec.LookPath("go")
		if err != nil {
			return "", fmt.Errorf("e2e: build infergate: no go command: %w", err)
		}
		goBin = p
	}
	out := filepath.Join(dir, "infergate")
	cmd := exec.CommandContext(ctx, goBin, "build", "-o", out, "github.com/infergate/infergate/cmd/infergate")
	if msg, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("e2e: go build ./cmd/infergate: %v\n%s", err, msg)
	}
	return out, nil
}

// Process is a child process in its own process group (killed with the
// test process), its output kept (the last 1 MiB) for awaiting and errors.
type Process struct {
	Name   string
	cmd    *exec.Cmd
	out    *tailBuffer
	exited chan struct{}
	err    error // after exited
}

// StartProcess starts bin with args and env (nil: the test's environment
// without INFERGATE_API_KEYS) in dir.
func StartProcess(name, bin string, args, env []string, dir string) (*Process, error) {
	cmd := exec.Command(bin, args...)
	if env == nil {
		env = cleanEnv()
	}
	cmd.Env, cmd.Dir = env, dir
	p := &Process{Name: name, cmd: cmd, out: &tailBuffer{max: 1 << 20}, exited: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.out, p.out
	cmd.SysProcAttr = childproc.Group()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("e2e: start %s: %w", name, err)
	}
	go func() {
		p.err = cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

// StartProcessT is StartProcess for a test: it fails the test on error
// and stops the process (SIGKILL to its group) at the test's end.
func StartProcessT(t testing.TB, name, bin string, args ...string) *Process {
	t.Helper()
	p, err := StartProcess(name, bin, args, nil, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Kill() })
	return p
}

// cleanEnv is the environment without variables that would change what
// an infergate child does (API keys).
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); k != "INFERGATE_API_KEYS" {
			env = append(env, kv)
		}
	}
	return env
}

// Output returns what the process wrote (stdout and stderr, the last MiB).
func (p *Process) Output() string { return p.out.String() }

// Exited is closed when the process has exited.
func (p *Process) Exited() <-chan struct{} { return p.exited }

// Await returns the first submatch of re in the process's output once it
// appears, or an error when the process exits or ctx ends first.
func (p *Process) Await(ctx context.Context, re *regexp.Regexp) (string, error) {
	for {
		if m := re.FindStringSubmatch(p.Output()); m != nil {
			return m[1], nil
		}
		select {
		case <-p.exited:
			if m := re.FindStringSubmatch(p.Output()); m != nil {
				return m[1], nil
			}
			return "", fmt.Errorf("e2e: %s exited (%v) before printing %v; output:\n%s", p.Name, p.err, re, lastLines(p.Output(), 40))
		case <-ctx.Done():
			return "", fmt.Errorf("e2e: %s: waiting for %v: %w; output:\n%s", p.Name, re, ctx.Err(), lastLines(p.Output(), 40))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Stop sends SIGTERM to the process group and waits up to grace for the
// exit, then SIGKILLs the group. It returns the exit error of a process that
// did not exit cleanly after SIGTERM.
func (p *Process) Stop(grace time.Duration) error {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.exited:
		return p.err
	case <-time.After(grace):
		p.Kill()
		return fmt.Errorf("e2e: %s did not exit within %v of SIGTERM", p.Name, grace)
	}
}

// Kill SIGKILLs the process group and waits for the process.
func (p *Process) Kill() {
	select {
	case <-p.exited:
		return
	default:
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.exited
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
	max int
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - b.max; over > 0 {
		b.buf = append(b.buf[:0], b.buf[over:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}

// Prometheus is a Prometheus server on loopback with its own storage.
type Prometheus struct {
	URL  string // http://127.0.0.1:port
	Proc *Process
}

// StartPrometheus starts bin with config (prometheus.yml text) in dir
// (config file and TSDB there), listening on a free loopback port, and waits
// until it answers /-/ready.
func StartPrometheus(ctx context.Context, bin, dir, config string) (*Prometheus, error) {
	cfgPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o644); err != nil {
		return nil, err
	}
	var lastErr error
	for range 3 { // a free port can be taken before Prometheus binds it
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		addr := "127.0.0.1:" + strconv.Itoa(port)
		p, err := StartProcess("prometheus", bin, []string{"--config.file=" + cfgPath,
			"--storage.tsdb.path=" + filepath.Join(dir, "tsdb"), "--web.listen-address=" + addr,
			"--log.level=warn"}, nil, dir)
		if err != nil {
			return nil, err
		}
		prom := &Prometheus{URL: "http://" + addr, Proc: p}
		if lastErr = prom.waitReady(ctx); lastErr == nil {
			return prom, nil
		}
		p.Kill()
		if !strings.Contains(p.Output(), "address already in use") {
			return nil, lastErr
		}
	}
	return nil, lastErr
}

func (p *Prometheus) waitReady(ctx context.Context) error {
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, p.URL+"/-/ready", nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-p.Proc.Exited():
			return fmt.Errorf("e2e: prometheus exited during startup; output:\n%s", lastLines(p.Proc.Output(), 30))
		case <-ctx.Done():
			return fmt.Errorf("e2e: prometheus not ready: %w; output:\n%s", ctx.Err(), lastLines(p.Proc.Output(), 30))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// PromSample is one series of an instant query's answer.
type PromSample struct {
	Metric map[string]string `json:"metric"`
	Value  [2]any            `json:"value"` // [unix seconds, "value"]
}

// PromError is an error answer of Prometheus's HTTP API (a PromQL parse or
// evaluation error, say).
type PromError struct{ Type, Message string }

func (e *PromError) Error() string { return "prometheus: " + e.Type + ": " + e.Message }

// Query evaluates expr now (GET /api/v1/query) and returns its series; an
// expression Prometheus rejects is a *PromError.
func (p *Prometheus) Query(ctx context.Context, expr string) ([]PromSample, error) {
	var data struct {
		ResultType string          `json:"resultType"`
		Result     json.RawMessage `json:"result"`
	}
	if err := p.get(ctx, "/api/v1/query?query="+url.QueryEscape(expr), &data); err != nil {
		return nil, err
	}
	switch data.ResultType {
	case "vector":
		var out []PromSample
		return out, json.Unmarshal(data.Result, &out)
	case "scalar":
		var v [2]any
		return []PromSample{{Value: v}}, json.Unmarshal(data.Result, &v)
	}
	return nil, fmt.Errorf("prometheus: %q: result type %q", expr, data.ResultType)
}

// LabelValues returns the values of label over the series matching match
// (what Grafana's label_values(match, label) asks).
func (p *Prometheus) LabelValues(ctx context.Context, label, match string) ([]string, error) {
	var out []string
	return out, p.get(ctx, "/api/v1/label/"+url.PathEscape(label)+"/values?match[]="+url.QueryEscape(match), &out)
}

func (p *Prometheus) get(ctx context.Context, path string, data any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.URL+path, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var body struct {
		Status    string          `json:"status"`
		Data      json.RawMessage `json:"data"`
		ErrorType string          `json:"errorType"`
		Error     string          `json:"error"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(&body); err != nil {
		return fmt.Errorf("prometheus %s: %d: %w", path, resp.StatusCode, err)
	}
	if body.Status != "success" {
		return &PromError{Type: body.ErrorType, Message: body.Error}
	}
	return json.Unmarshal(body.Data, data)
}

// ChromiumFlags are the flags headless Chromium needs here: no sandbox (a
// container, often root), no GPU, and none of its background connections
// (component updates, sync, QUIC probes), which are refused without a
// network and, many at a time, starve the page's own.
var ChromiumFlags = []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
	"--disable-background-networking", "--disable-component-update", "--disable-sync",
	"--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars"}

// Chromium runs headless Chromium on pageURL with a fresh profile in dir,
// letting the page run for budget of virtual time (its timers and fetches)
// first, and returns the rendered DOM (--dump-dom) or, with screenshot set,
// writes a PNG of width × height there as well.
func Chromium(ctx context.Context, bin, dir, pageURL string, budget time.Duration, screenshot string, width, height int) (dom string, err error) {
	args := append(append([]string(nil), ChromiumFlags...),
		"--user-data-dir="+filepath.Join(dir, "profile"),
		"--virtual-time-budget="+strconv.Itoa(int(budget.Milliseconds())),
		"--window-size="+strconv.Itoa(width)+","+strconv.Itoa(height))
	run := func(extra ...string) (string, error) {
		cmd := exec.CommandContext(ctx, bin, append(append(args, extra...), pageURL)...)
		cmd.Env = append(cleanEnv(), "HOME="+dir) // nothing read from or written to the real home
		cmd.SysProcAttr = childproc.Group()
		cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
		var stdout, stderr tailBuffer
		stdout.max, stderr.max = 16<<20, 64<<10
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			return "", fmt.Errorf("e2e: chromium: %v; stderr:\n%s", err, lastLines(stderr.String(), 20))
		}
		return stdout.String(), nil
	}
	if dom, err = run("--dump-dom"); err != nil {
		return "", err
	}
	if screenshot != "" {
		if _, err := run("--screenshot=" + screenshot); err != nil {
			return dom, err
		}
		if st, err := os.Stat(screenshot); err != nil || st.Size() == 0 {
			return dom, fmt.Errorf("e2e: chromium wrote no screenshot at %s: %v", screenshot, err)
		}
	}
	return dom, nil
}
