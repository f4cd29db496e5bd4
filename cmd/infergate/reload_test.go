package main

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// metricSum sums the samples of name whose labels contain sel on base's
// /metrics.
func metricSum(t *testing.T, c *http.Client, base, name, sel string) float64 {
	t.Helper()
	resp, err := c.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, name+"{") && !strings.HasPrefix(l, name+" ") || !strings.Contains(l, sel) {
			continue
		}
		if v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64); err == nil {
			sum += v
		}
	}
	return sum
}

// until polls cond every 20 ms for up to a minute (an upper bound, never
// a timing claim).
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestServeReloadOnSIGHUP runs `infergate serve -c file` in front of
// `infergate sim` processes while clients send requests without a pause,
// and rewrites the file and sends SIGHUP four times: an endpoint replaced
// (the removed engine is stopped once the gateway has drained it) and a key
// added; both endpoints replaced and the key removed; a file that does not
// parse (refused, counted, nothing changes); an endpoint put back with a
// setting that needs a restart (kept, logged). No client request fails,
// and every change takes effect.
func TestServeReloadOnSIGHUP(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	addrRe := regexp.MustCompile(`addr=(http://[0-9.:]+)`)
	sim := func() (*proc, string) {
		s := start(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "m")
		return s, s.await(t, addrRe)
	}
	simA, a := sim()
	defer simA.stop(t)
	simB, b := sim()
	simC, c := sim()
	defer simC.stop(t)

	dir := t.TempDir()
	conf, keys := filepath.Join(dir, "gateway.yaml"), filepath.Join(dir, "keys")
	write := func(path, s string) {
		t.Helper()
		if err := os.WriteFile(path+".tmp", []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".tmp", path); err != nil { // as a ConfigMap update swaps the file
			t.Fatal(err)
		}
	}
	config := func(extra string, urls ...string) string {
		// Round-robin: every endpoint gets requests (the clients send one
		// prompt, which a cache-aware policy keeps on one engine).
		s := "health_check_interval: 200ms\nhealth_check_timeout: 10s\nrouting: {policy: round-robin}\nauth:\n  keys_file: " + keys + "\n" + extra + "endpoints:\n"
		for _, u := range urls {
			s += "  - {url: " + u + ", model: m, kind: sim}\n"
		}
		return s
	}
	write(keys, "client plain:key-one\n")
	write(conf, config("", a, b))
	// No access log: a line per request would fill the output's buffer
	// (proc.lines drops what does not fit) and hide the reload's lines.
	g := start(t, "serve", "-c", conf, "--listen", "127.0.0.1:0", "--access-log=false")
	base := g.await(t, addrRe)
	defer g.stop(t)

	hc := &http.Client{Timeout: 30 * time.Second}
	send := func(key string, stream bool) (int, string, error) {
		body := `{"model":"m","max_tokens":4,"stream":` + strconv.FormatBool(stream) + `,"messages":[{"role":"user","content":"hello"}]}`
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := hc.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		got, err := io.ReadAll(resp.Body)
		return resp.StatusCode, string(got), err
	}
	var (
		stop     atomic.Bool
		answered atomic.Int64
		wg       sync.WaitGroup
		mu       sync.Mutex
		failures []string
	)
	for w := range 4 {
		wg.Go(func() {
			for i := 0; !stop.Load(); i++ {
				stream := (w+i)%2 == 0
				status, body, err := send("key-one", stream)
				if err == nil && (status != 200 || strings.Contains(body, `"error"`) ||
					(stream && !strings.HasSuffix(body, "data: [DONE]\n\n")) || (!stream && !strings.Contains(body, `"choices"`))) {
					err = fmt.Errorf("status %d: %s", status, body)
				}
				if err != nil {
					mu.Lock()
					failures = append(failures, err.Error())
					mu.Unlock()
				}
				answered.Add(1)
			}
		})
	}
	defer func() {
		stop.Store(true)
		wg.Wait()
	}()
	flowing := func(what string) {
		t.Helper()
		n := answered.Load()
		until(t, what, func() bool { return answered.Load() >= n+10 })
	}
	served := func(u string) float64 {
		return metricSum(t, hc, base, "infergate_requests_total", `endpoint="`+u+`"`)
	}
	reloads := func(result string) float64 {
		return metricSum(t, hc, base, "infergate_config_reloads_total", `result="`+result+`"`)
	}
	hup := func(what string, result string, n float64) {
		t.Helper()
		if err := g.cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		until(t, what, func() bool { return reloads(result) == n })
	}
	flowing("requests before the first reload")

	// 1. B replaced by C; a second key.
	write(keys, "client plain:key-one\nsecond plain:key-two\n")
	write(conf, config("", a, c))
	hup("reload 1", "success", 1)
	g.await(t, regexp.MustCompile(`removed endpoint drained.*endpoint=(`+regexp.QuoteMeta(b)+`)`))
	simB.stop(t) // gone: a request sent to it now would fail over
	if s, body, err := send("key-two", false); err != nil || s != 200 {
		t.Fatalf("key added by the reload: %d %v %s", s, err, body)
	}
	until(t, "requests on the added endpoint", func() bool { return served(c) > 0 })
	flowing("requests after reload 1")

	// 2. A and C replaced by C and D; the second key removed.
	simD, d := sim()
	defer simD.stop(t)
	write(keys, "client plain:key-one\n")
	write(conf, config("", c, d))
	hup("reload 2", "success", 2)
	if s, _, err := send("key-two", false); err != nil || s != 401 {
		t.Fatalf("key removed by the reload: %d %v, want 401", s, err)
	}
	until(t, "requests on the second added endpoint", func() bool { return served(d) > 0 })
	flowing("requests after reload 2")

	// 3. A file that does not parse: refused, nothing changes.
	write(conf, "endpoints: [this is not yaml\n")
	hup("reload 3 refused", "failure", 1)
	if ok := metricSum(t, hc, base, "infergate_config_last_reload_successful", ""); ok != 0 {
		t.Fatalf("config_last_reload_successful %v after a refused reload", ok)
	}
	flowing("requests after the refused reload")

	// 4. A back, with a setting that needs a restart.
	aBefore := served(a)
	write(conf, config("max_body_bytes: 1024\n", a, c, d))
	hup("reload 4", "success", 3)
	// The only one: a setting the flags give (--listen, --access-log) is
	// the same at every load.
	if got := g.await(t, regexp.MustCompile(`need a restart.*settings=(\S+)`)); got != "max_body_bytes" {
		t.Fatalf("settings that need a restart: %s, want max_body_bytes", got)
	}
	until(t, "requests on the endpoint put back", func() bool { return served(a) > aBefore })
	flowing("requests after reload 4")

	stop.Store(true)
	wg.Wait()
	if len(failures) > 0 {
		t.Fatalf("%d of %d requests failed across the reloads; first: %s", len(failures), answered.Load(), failures[0])
	}
	t.Logf("%d requests, none failed, over 4 SIGHUPs (retries %v)", answered.Load(),
		metricSum(t, hc, base, "infergate_retries_total", ""))
}

// TestServeRotatesEngineKeyOnSIGHUP: `infergate serve` in front of an
// `infergate sim` started with --api-key, configured with a key the engine
// refuses: 502 upstream_auth, the endpoint ejected for ten minutes. The
// file rewritten to take the engine's key from api_key_env and SIGHUP: the
// next request is served, no restart, and no key reaches the log.
func TestServeRotatesEngineKeyOnSIGHUP(t *testing.T) {
	s := start(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "m", "--api-key", simKey)
	engine := s.await(t, addrRe)
	defer s.stop(t)
	conf := filepath.Join(t.TempDir(), "gateway.yaml")
	write := func(endpoint string) {
		t.Helper()
		yaml := "health_check_interval: 200ms\n" + ejectLong + "endpoints:\n  - {url: " + engine + ", model: m, kind: sim, " + endpoint + "}\n"
		if err := os.WriteFile(conf+".tmp", []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(conf+".tmp", conf); err != nil {
			t.Fatal(err)
		}
	}
	write("api_key: " + wrongKey + ", max_model_len: 4096, kv_blocks: 1000")
	g := startEnv(t, []string{"ENGINE_KEY=" + simKey, "INFERGATE_API_KEYS=alice plain:" + clientKey},
		"serve", "-c", conf, "--listen", "127.0.0.1:0", "--access-log=false")
	base := g.await(t, addrRe)
	c := &http.Client{Timeout: 30 * time.Second}
	if code, _, body := request(t, c, base, false); code != http.StatusBadGateway || !strings.Contains(body, "upstream_auth") {
		t.Fatalf("with a key the engine refuses: %d %s, want 502 upstream_auth", code, body)
	}
	if code, _, body := request(t, c, base, false); code != http.StatusServiceUnavailable {
		t.Fatalf("ejected: %d %s, want 503", code, body)
	}

	write("api_key_env: ENGINE_KEY, max_model_len: 4096, kv_blocks: 1000")
	if err := g.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	until(t, "the reload", func() bool {
		return metric(t, c, base, "infergate_config_reloads_total", `result="success"`) == 1
	})
	for i := range 4 {
		if code, _, body := request(t, c, base, i%2 == 0); code != 200 || !strings.Contains(body, `"choices"`) {
			t.Fatalf("request %d after the reload with the engine's key: %d %s", i, code, body)
		}
	}
	g.stop(t)
	for _, key := range []string{simKey, wrongKey, clientKey} {
		if strings.Contains(g.all.String(), key) {
			t.Fatalf("a key is in the gateway's output:\n%s", g.all.String())
		}
	}
}
