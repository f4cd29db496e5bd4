// Command overhead is the load generator of bench/overhead/run.sh: a
// closed-loop client that keeps a fixed number of small streaming
// completions in flight against one or more OpenAI-compatible targets for a
// fixed time and reports throughput and latency percentiles, so a proxy's
// added cost can be read against direct calls.
//
//	overhead run --label direct --target http://127.0.0.1:8001,http://127.0.0.1:8002 --out results.jsonl
//	overhead table results.jsonl
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Result is one run's summary (one JSON line of --out).
type Result struct {
	Label       string  `json:"label"`
	Concurrency int     `json:"concurrency"`
	DurationS   float64 `json:"duration_s"`
	Requests    int     `json:"requests"`
	Errors      int     `json:"errors"`
	FirstError  string  `json:"first_error,omitempty"`
	ReqPerS     float64 `json:"req_per_s"`
	E2EP50Ms    float64 `json:"e2e_p50_ms"`
	E2EP99Ms    float64 `json:"e2e_p99_ms"`
	TTFTP50Ms   float64 `json:"ttft_p50_ms"`
	TTFTP99Ms   float64 `json:"ttft_p99_ms"`
	// AllRequests counts every request sent, warm-up included, over WallS
	// seconds (for CPU per request).
	AllRequests int     `json:"all_requests"`
	WallS       float64 `json:"wall_s"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: overhead run [flags] | overhead table RESULTS [PROXY-CPU] | overhead reverseproxy [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "run":
		err = runCmd(os.Args[2:])
	case "reverseproxy":
		err = reverseProxyCmd(os.Args[2:])
	case "table":
		switch len(os.Args) {
		case 3:
			err = tableCmd(os.Args[2], "", os.Stdout)
		case 4:
			err = tableCmd(os.Args[2], os.Args[3], os.Stdout)
		default:
			err = errors.New("usage: overhead table RESULTS [PROXY-CPU]")
		}
	default:
		err = fmt.Errorf("unknown command %q (want run, table or reverseproxy)", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "overhead:", err)
		os.Exit(1)
	}
}

func runCmd(args []string) error {
	fs := flag.NewFlagSet("run", flag.ExitOnError)
	targets := fs.String("target", "", "comma-separated base URLs; worker i uses target i mod n")
	label := fs.String("label", "run", "name of the run in the output")
	model := fs.String("model", "m", "model field")
	conc := fs.Int("concurrency", 32, "requests kept in flight")
	dur := fs.Duration("duration", 15*time.Second, "measured time")
	warm := fs.Duration("warmup", 2*time.Second, "unmeasured time before it")
	promptTokens := fs.Int("prompt-tokens", 16, "prompt length (token ids)")
	maxTokens := fs.Int("max-tokens", 8, "max_tokens (with ignore_eos)")
	apiKey := fs.String("api-key", "", "sent as Authorization: Bearer")
	out := fs.String("out", "", "append the result as a JSON line to this file")
	_ = fs.Parse(args)
	if *targets == "" {
		return errors.New("--target is required")
	}
	urls := strings.Split(*targets, ",")
	res, err := run(urls, *label, *model, *conc, *warm, *dur, *promptTokens, *maxTokens, *apiKey)
	if err != nil {
		return err
	}
	line, _ := json.Marshal(res)
	fmt.Println(string(line))
	if *out != "" {
		f, err := os.OpenFile(*out, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = f.Write(append(line, '\n'))
		return err
	}
	return nil
}

// sample is one finished request.
type sample struct {
	e2e, ttft time.Duration
	err       error
}

func run(urls []string, label, model string, conc int, warm, dur time.Duration, promptTokens, maxTokens int, apiKey string) (Result, error) {
	tr := &http.Transport{MaxIdleConnsPerHost: conc, MaxConnsPerHost: 0, DisableCompression: true, IdleConnTimeout: time.Minute}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	start := time.Now()
	measureFrom, measureTo := start.Add(warm), start.Add(warm+dur)
	var (
		mu      sync.Mutex
		samples []sample
		all     int
		wg      sync.WaitGroup
	)
	for w := range conc {
		wg.Go(func() {
			target := strings.TrimRight(urls[w%len(urls)], "/") + "/v1/completions"
			var local []sample
			body := make([]byte, 0, 256)
			seq := 0
			for ; ; seq++ {
				t0 := time.Now()
				if t0.After(measureTo) {
					break
				}
				body = appendBody(body[:0], model, w, seq, promptTokens, maxTokens)
				s := one(ctx, client, target, body, apiKey)
				if t0.After(measureFrom) {
					local = append(local, s)
				}
			}
			mu.Lock()
			samples = append(samples, local...)
			all += seq
			mu.Unlock()
		})
	}
	wg.Wait()

	r := Result{Label: label, Concurrency: conc, DurationS: dur.Seconds(), AllRequests: all, WallS: time.Since(start).Seconds()}
	var e2e, ttft []float64
	for _, s := range samples {
		r.Requests++
		if s.err != nil {
			r.Errors++
			if r.FirstError == "" {
				r.FirstError = s.err.Error()
			}
			continue
		}
		e2e = append(e2e, float64(s.e2e)/1e6)
		ttft = append(ttft, float64(s.ttft)/1e6)
	}
	r.ReqPerS = float64(len(e2e)) / dur.Seconds()
	r.E2EP50Ms, r.E2EP99Ms = percentile(e2e, 50), percentile(e2e, 99)
	r.TTFTP50Ms, r.TTFTP99Ms = percentile(ttft, 50), percentile(ttft, 99)
	if len(e2e) == 0 {
		return r, fmt.Errorf("%s: no successful request (%d errors; first: %s)", label, r.Errors, r.FirstError)
	}
	return r, nil
}

// appendBody appends a streaming completion request whose prompt is
// promptTokens token ids unique to (worker, seq), so prefix-aware routing
// sees no reuse and spreads the load.
func appendBody(b []byte, model string, worker, seq, promptTokens, maxTokens int) []byte {
	b = append(b, `{"model":`...)
	b = strconv.AppendQuote(b, model)
	b = append(b, `,"prompt":[`...)
	x := uint32(worker*1_000_003 + seq*7919 + 1)
	for i := range promptTokens {
		if i > 0 {
			b = append(b, ',')
		}
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b = strconv.AppendUint(b, uint64(x%100000+1), 10)
	}
	b = append(b, `],"max_tokens":`...)
	b = strconv.AppendInt(b, int64(maxTokens), 10)
	return append(b, `,"stream":true,"ignore_eos":true,"stream_options":{"include_usage":true}}`...)
}

var (
	dataPrefix = []byte("data: ")
	doneData   = []byte("[DONE]")
)

// one sends a request and reads its stream to [DONE].
func one(ctx context.Context, c *http.Client, url string, body []byte, apiKey string) sample {
	t0 := time.Now()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return sample{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	resp, err := c.Do(req)
	if err != nil {
		return sample{err: err}
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return sample{err: fmt.Errorf("status %d: %s", resp.StatusCode, b)}
	}
	br := bufio.NewReaderSize(resp.Body, 8<<10)
	var s sample
	for {
		line, err := br.ReadSlice('\n')
		if err != nil {
			s.err = fmt.Errorf("stream ended without [DONE]: %v", err)
			return s
		}
		data, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), dataPrefix)
		if !ok {
			continue
		}
		if bytes.Equal(data, doneData) {
			s.e2e = time.Since(t0)
			// Read to the end of the body, as OpenAI's SDKs do: closing
			// it earlier makes net/http drop the connection whenever the
			// last chunk ("0\r\n\r\n") comes in a later packet than
			// [DONE], and the next request pays for a new connection.
			if _, err := io.Copy(io.Discard, io.LimitReader(br, 1<<20)); err != nil {
				s.err = fmt.Errorf("after [DONE]: %v", err)
			}
			return s
		}
		if s.ttft == 0 {
			s.ttft = time.Since(t0)
		}
	}
}

// percentile interpolates linearly between closest ranks (NumPy's default).
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	h := float64(len(s)-1) * p / 100
	lo := int(math.Floor(h))
	if lo+1 >= len(s) {
		return s[len(s)-1]
	}
	return s[lo] + (h-float64(lo))*(s[lo+1]-s[lo])
}

// tableCmd prints the results of a file as a Markdown table, one row per
// label (the median of its runs when there are several): throughput,
// latency, the latency added over the label "direct" and ratios against the
// label "nginx", and with cpuPath (lines "label seconds": a proxy's CPU time
// over one whole load) the proxy's CPU time per request.
func tableCmd(path, cpuPath string, w io.Writer) error {
	cpu := map[string]float64{}
	if cpuPath != "" {
		data, err := os.ReadFile(cpuPath)
		if err != nil {
			return err
		}
		for line := range strings.SplitSeq(string(data), "\n") {
			if f := strings.Fields(line); len(f) == 2 {
				if v, err := strconv.ParseFloat(f[1], 64); err == nil {
					cpu[f[0]] += v
				}
			}
		}
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var labels []string
	runs := map[string][]Result{}
	for line := range strings.SplitSeq(strings.TrimSpace(string(data)), "\n") {
		if line == "" {
			continue
		}
		var r Result
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		if runs[r.Label] == nil {
			labels = append(labels, r.Label)
		}
		runs[r.Label] = append(runs[r.Label], r)
	}
	rows := map[string]row{}
	for _, l := range labels {
		rows[l] = medianRow(runs[l], cpu[l])
	}
	direct, hasDirect := rows["direct"]
	nginx, hasNginx := rows["nginx"]
	fmt.Fprintln(w, "| target | runs | req/s | e2e p50 ms | e2e p99 ms | added p50 ms | added p99 ms | req/s vs nginx | added p50 vs nginx | proxy CPU µs/req | errors |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|")
	for _, l := range labels {
		r := rows[l]
		addP50, addP99 := "", ""
		if hasDirect {
			addP50 = fmt.Sprintf("%.2f", r.p50-direct.p50)
			addP99 = fmt.Sprintf("%.2f", r.p99-direct.p99)
		}
		vsThr, vsLat := "", ""
		if hasNginx && l != "direct" {
			vsThr = fmt.Sprintf("%.2f×", r.rps/nginx.rps)
			if hasDirect {
				if na := nginx.p50 - direct.p50; na > 0 {
					vsLat = fmt.Sprintf("%.2f×", (r.p50-direct.p50)/na)
				}
			}
		}
		perReq := ""
		if r.cpuPerReq > 0 {
			perReq = fmt.Sprintf("%.0f", r.cpuPerReq)
		}
		fmt.Fprintf(w, "| %s | %d | %.0f | %.2f | %.2f | %s | %s | %s | %s | %s | %d |\n",
			l, r.n, r.rps, r.p50, r.p99, addP50, addP99, vsThr, vsLat, perReq, r.errors)
	}
	return nil
}

// row is one label's runs summarized: medians, summed errors, CPU per
// request over all runs (µs).
type row struct {
	n             int
	rps, p50, p99 float64
	errors        int
	cpuPerReq     float64
}

func medianRow(rs []Result, cpuSeconds float64) row {
	var rps, p50, p99 []float64
	r := row{n: len(rs)}
	all := 0
	for _, x := range rs {
		rps, p50, p99 = append(rps, x.ReqPerS), append(p50, x.E2EP50Ms), append(p99, x.E2EP99Ms)
		r.errors += x.Errors
		all += x.AllRequests
	}
	r.rps, r.p50, r.p99 = percentile(rps, 50), percentile(p50, 50), percentile(p99, 50)
	if cpuSeconds > 0 && all > 0 {
		r.cpuPerReq = cpuSeconds / float64(all) * 1e6
	}
	return r
}
