package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/gateway"
)

// dashboardFile is the Grafana dashboard, relative to this package.
const dashboardFile = "../deploy/grafana/infergate.json"

// The infergate binary the process tests run, built once per test binary
// (TestMain removes it).
var built struct {
	once     sync.Once
	dir, bin string
	err      error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if built.dir != "" {
		_ = os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// infergateBinary builds cmd/infergate (once) and returns it.
func infergateBinary(t *testing.T) string {
	t.Helper()
	built.once.Do(func() {
		if built.dir, built.err = os.MkdirTemp("", "infergate-e2e-bin-"); built.err != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
		defer cancel()
		built.bin, built.err = BuildInfergate(ctx, built.dir)
	})
	if built.err != nil {
		t.Fatal(built.err)
	}
	return built.bin
}

// grafanaDashboard is the part of Grafana's dashboard JSON model the tests
// read.
type grafanaDashboard struct {
	UID           string `json:"uid"`
	Title         string `json:"title"`
	SchemaVersion int    `json:"schemaVersion"`
	Templating    struct {
		List []struct {
			Name       string          `json:"name"`
			Type       string          `json:"type"`
			Query      json.RawMessage `json:"query"`
			Definition string          `json:"definition"`
			Datasource *grafanaDS      `json:"datasource"`
			IncludeAll bool            `json:"includeAll"`
			AllValue   string          `json:"allValue"`
			Multi      bool            `json:"multi"`
		} `json:"list"`
	} `json:"templating"`
	Panels []grafanaPanel `json:"panels"`
}

type grafanaDS struct{ Type, UID string }

type grafanaPanel struct {
	ID         int                      `json:"id"`
	Type       string                   `json:"type"`
	Title      string                   `json:"title"`
	Datasource *grafanaDS               `json:"datasource"`
	GridPos    struct{ X, Y, W, H int } `json:"gridPos"`
	Targets    []struct {
		Expr       string     `json:"expr"`
		RefID      string     `json:"refId"`
		Datasource *grafanaDS `json:"datasource"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"` // a collapsed row's
}

func loadDashboard(t *testing.T) grafanaDashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d grafanaDashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

// queryPanels returns every panel that queries (rows' nested ones
// included).
func (d grafanaDashboard) queryPanels() []grafanaPanel {
	var out []grafanaPanel
	var walk func([]grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			if p.Type == "row" {
				walk(p.Panels)
				continue
			}
			out = append(out, p)
		}
	}
	walk(d.Panels)
	return out
}

// variableQuery returns a query variable's label_values(match, label).
func variableQuery(t *testing.T, def string) (match, label string) {
	t.Helper()
	m := regexp.MustCompile(`^label_values\((.+), *([a-z_]+)\)$`).FindStringSubmatch(def)
	if m == nil {
		t.Fatalf("variable query %q: want label_values(selector, label)", def)
	}
	return m[1], m[2]
}

// substitute renders expr as Grafana would for the chosen variable values
// (each already a regex: ".*" for All) and a $__rate_interval.
func substitute(expr string, vars map[string]string, rateInterval string) string {
	r := []string{"$__rate_interval", rateInterval}
	for k, v := range vars {
		r = append(r, "${"+k+"}", v, "$"+k, v)
	}
	return strings.NewReplacer(r...).Replace(expr)
}

// recordingRegisterer records the names of the metrics registered on it.
type recordingRegisterer struct {
	*prometheus.Registry
	names map[string]bool
}

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc, 64)
	go func() {
		c.Describe(ch)
		close(ch)
	}()
	re := regexp.MustCompile(`fqName: "([^"]+)"`)
	for d := range ch {
		if m := re.FindStringSubmatch(d.String()); m != nil {
			r.names[m[1]] = true
		}
	}
	return r.Registry.Register(c)
}

func (r *recordingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

var metricRe = regexp.MustCompile(`\binfergate_[a-z0-9_]+`)

// TestGrafanaDashboardFile checks the dashboard's structure without any
// tool: Grafana's schema fields, the datasource and template variables,
// unique panel ids on a 24-column grid, and that every metric a query names
// is one the gateway registers, filtered by the gateway replica.
func TestGrafanaDashboardFile(t *testing.T) {
	d := loadDashboard(t)
	if d.UID == "" || d.Title == "" || d.SchemaVersion < 39 {
		t.Errorf("uid %q title %q schemaVersion %d (want ≥ 39: Grafana 10.4+)", d.UID, d.Title, d.SchemaVersion)
	}
	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
		switch v.Type {
		case "datasource":
			if v.Name != "datasource" || string(v.Query) != `"prometheus"` {
				t.Errorf("datasource variable %q query %s", v.Name, v.Query)
			}
		case "query":
			if v.Datasource == nil || v.Datasource.UID != "${datasource}" || !v.Multi || !v.IncludeAll || v.AllValue != ".*" {
				t.Errorf("variable %q: datasource %+v multi %v includeAll %v allValue %q", v.Name, v.Datasource, v.Multi, v.IncludeAll, v.AllValue)
			}
			variableQuery(t, v.Definition)
			var q struct{ Query string }
			if json.Unmarshal(v.Query, &q) != nil || q.Query != v.Definition {
				t.Errorf("variable %q: query %s differs from its definition %q", v.Name, v.Query, v.Definition)
			}
		}
	}
	for _, n := range []string{"datasource", "instance", "model", "endpoint"} {
		if !vars[n] {
			t.Errorf("no %q template variable", n)
		}
	}

	reg := &recordingRegisterer{Registry: prometheus.NewRegistry(), names: map[string]bool{}}
	cfg := gateway.Config{HealthCheckPath: "-", ScrapeInterval: -1,
		Endpoints: []gateway.EndpointConfig{{URL: "http://127.0.0.1:9", Model: "m", KVBlocks: 1000}}}
	g, err := gateway.New(context.Background(), cfg, reg)
	if err != nil {
		t.Fatal(err)
	}
	g.Close()
	known := func(name string) bool {
		if reg.names[name] {
			return true
		}
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			if base, ok := strings.CutSuffix(name, suf); ok && reg.names[base] {
				return true
			}
		}
		return false
	}

	ids := map[int]string{}
	used := map[string]bool{}
	panels := d.queryPanels()
	if len(panels) < 20 {
		t.Errorf("%d panels", len(panels))
	}
	for _, p := range panels {
		if prev, dup := ids[p.ID]; dup || p.ID == 0 {
			t.Errorf("panel %q: id %d (also %q)", p.Title, p.ID, prev)
		}
		ids[p.ID] = p.Title
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" || p.Datasource.Type != "prometheus" {
			t.Errorf("panel %q: datasource %+v, want the ${datasource} variable", p.Title, p.Datasource)
		}
		if p.GridPos.W <= 0 || p.GridPos.H <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: gridPos %+v", p.Title, p.GridPos)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		refs := map[string]bool{}
		for _, tg := range p.Targets {
			if tg.Expr == "" || tg.RefID == "" || refs[tg.RefID] || tg.Datasource == nil || tg.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q: target %+v", p.Title, tg)
			}
			refs[tg.RefID] = true
			names := metricRe.FindAllString(tg.Expr, -1)
			if len(names) == 0 {
				t.Errorf("panel %q: %q queries no infergate metric", p.Title, tg.Expr)
			}
			for _, n := range names {
				if !known(n) {
					t.Errorf("panel %q: %s is not a metric the gateway registers", p.Title, n)
				}
				used[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_sum"), "_count")] = true
			}
			if strings.Count(tg.Expr, `instance=~"$instance"`) != strings.Count(tg.Expr, "{") {
				t.Errorf("panel %q: %q: every selector should filter on $instance", p.Title, tg.Expr)
			}
		}
	}
	var unused []string
	for n := range reg.names {
		if strings.HasPrefix(n, "infergate_") && !used[n] {
			unused = append(unused, n)
		}
	}
	slices.Sort(unused)
	if len(unused) > 0 {
		t.Logf("gateway metrics no panel shows: %v", unused)
	}
}

// TestGrafanaDashboardPrometheus loads every query of the dashboard against
// a real Prometheus scraping two real gateways: `infergate up` (2 simulated
// engines, cache-aware) and `infergate serve` in front of two `infergate
// sim` processes, configured and driven so that every panel has data:
// API keys (a 401, a key's rate limit), admission (max_in_flight 1,
// max_queue 1: a request queues, one is refused), a client that goes away,
// and two engines killed in turn (an ejection and a retry; then a
// retryable failure with no endpoint left). Every query must parse and
// return series, with the variables at All and at one value each.
func TestGrafanaDashboardPrometheus(t *testing.T) {
	promBin := RequireTool(t, EnvPrometheus, "prometheus", "prometheus")
	bin := infergateBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dir := t.TempDir()
	client := &http.Client{Timeout: 2 * time.Minute}

	up := StartProcessT(t, "infergate up", bin, "up", "--engines", "2", "--listen", "127.0.0.1:0", "--time-scale", "100")
	upURL := await(t, ctx, up, apiRe)

	var sims []*Process
	var simURLs []string
	for i := range 2 {
		s := StartProcessT(t, "infergate sim "+strconv.Itoa(i), bin, "sim", "--listen", "127.0.0.1:0", "--time-scale", "1", "--model", "m")
		sims = append(sims, s)
		simURLs = append(simURLs, await(t, ctx, s, addrRe))
	}
	const opsKey, tinyKey = "sk-dashboard-ops-0123456789", "sk-dashboard-tiny-0123456789"
	cfg := fmt.Sprintf(`listen: 127.0.0.1:0
routing: {policy: round-robin}
health_check_interval: 10m
admission: {max_in_flight: 1, max_queue: 1}
auth:
  protect_metrics: true
  keys:
    - {name: ops, hash: %s}
    - {name: tiny, hash: %s, requests_per_minute: 1}
endpoints:
  - {url: %q, model: m, kind: sim}
  - {url: %q, model: m, kind: sim}
`, auth.HashKey(opsKey), auth.HashKey(tinyKey), simURLs[0], simURLs[1])
	cfgPath := filepath.Join(dir, "serve.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	serve := StartProcessT(t, "infergate serve", bin, "serve", "-c", cfgPath)
	serveURL := await(t, ctx, serve, addrRe)

	host := func(u string) string { return strings.TrimPrefix(u, "http://") }
	prom, err := StartPrometheus(ctx, promBin, dir, fmt.Sprintf(`global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: infergate-up
    static_configs: [{targets: [%q]}]
  - job_name: infergate-serve
    authorization: {credentials: %q}
    static_configs: [{targets: [%q]}]
`, host(upURL), opsKey, host(serveURL)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(prom.Proc.Kill)
	waitQuery(t, ctx, prom, `up == 1`, 2, "Prometheus scraping both gateways (up == 1)")

	// `up`: two-turn chat sessions sharing a long system prompt (cache
	// hits, prediction error), streaming (TTFT, ITL) and not, and an
	// unknown model (a 404).
	model := "meta-llama/Llama-3.1-70B-Instruct"
	for s := range 4 {
		sys := strings.Repeat(fmt.Sprintf("Session %d: you are a careful assistant who answers in full sentences. ", s), 30)
		for turn := range 2 {
			body := fmt.Sprintf(`{"model":%q,"stream":%v,"max_tokens":8,"messages":[{"role":"system","content":%q},{"role":"user","content":"question %d"}]}`,
				model, turn == 0 || s%2 == 0, sys, turn)
			if code, b := call(t, client, upURL+"/v1/chat/completions", "", body); code != 200 {
				t.Fatalf("up: session %d turn %d: %d %s", s, turn, code, b)
			}
		}
	}
	if code, _ := call(t, client, upURL+"/v1/chat/completions", "", `{"model":"nope","messages":[{"role":"user","content":"x"}]}`); code != 404 {
		t.Fatalf("up: unknown model: %d, want 404", code)
	}

	// `serve`: keys and limits.
	short := `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hello"}]}`
	if code, _ := call(t, client, serveURL+"/v1/chat/completions", "sk-wrong", short); code != 401 {
		t.Fatalf("serve: wrong key: %d, want 401", code)
	}
	if code, b := call(t, client, serveURL+"/v1/chat/completions", tinyKey, short); code != 200 {
		t.Fatalf("serve: tiny key, first: %d %s", code, b)
	}
	if code, _ := call(t, client, serveURL+"/v1/chat/completions", tinyKey, short); code != 429 {
		t.Fatalf("serve: tiny key, second within the minute: %d, want 429", code)
	}
	// Admission: a long stream holds the only slot until the client goes
	// away; a second request queues; a third finds the queue full.
	longCtx, longCancel := context.WithCancel(ctx)
	longDone := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(longCtx, http.MethodPost, serveURL+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","stream":true,"max_tokens":20000,"messages":[{"role":"user","content":"tell me everything"}]}`))
		req.Header.Set("Authorization", "Bearer "+opsKey)
		resp, err := client.Do(req)
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		longDone <- err
	}()
	waitState(t, ctx, client, serveURL, opsKey, "the long stream admitted", func(p gateway.DashPool) bool { return p.Admitted == 1 })
	queued := make(chan int, 1)
	go func() {
		code, _, _ := callCtx(ctx, client, serveURL+"/v1/chat/completions", opsKey, short)
		queued <- code
	}()
	waitState(t, ctx, client, serveURL, opsKey, "a request queued", func(p gateway.DashPool) bool { return p.QueueLength == 1 })
	if code, _ := call(t, client, serveURL+"/v1/chat/completions", opsKey, short); code != 429 {
		t.Fatalf("serve: third request with the queue full: %d, want 429", code)
	}
	longCancel()
	if err := <-longDone; err == nil {
		t.Fatal("the long stream ended by itself; it should have outlasted the queue steps")
	}
	if code := <-queued; code != 200 {
		t.Fatalf("serve: queued request: %d, want 200 once admitted", code)
	}
	// Engine 0 dies: round-robin sends one of the next two requests to
	// it; the refused attempt ejects it and is retried on engine 1.
	sims[0].Kill()
	for i := range 2 {
		if code, b := call(t, client, serveURL+"/v1/chat/completions", opsKey, short); code != 200 {
			t.Fatalf("serve: request %d after engine 0 died: %d %s", i, code, b)
		}
	}
	// Engine 1 dies too: the next request fails with no endpoint to retry on.
	sims[1].Kill()
	if code, _ := call(t, client, serveURL+"/v1/chat/completions", opsKey, short); code != 502 {
		t.Fatalf("serve: request after both engines died: %d, want 502", code)
	}
	st := state(t, ctx, client, serveURL, opsKey)
	if st.Fleet.Ejections != 2 || st.Fleet.Total.Retries != 1 || st.Fleet.Ready != 0 {
		t.Fatalf("serve after the engines died: ejections %v retries %v ready %d, want 2, 1, 0", st.Fleet.Ejections, st.Fleet.Total.Retries, st.Fleet.Ready)
	}

	// Every panel's every query, with the variables at All: parses, and
	// has series once Prometheus has scraped what the traffic produced.
	d := loadDashboard(t)
	all := map[string]string{"instance": ".*", "model": ".*", "endpoint": ".*"}
	deadline := time.Now().Add(90 * time.Second)
	for _, p := range d.queryPanels() {
		for _, tg := range p.Targets {
			expr := substitute(tg.Expr, all, "5m")
			for {
				res, err := prom.Query(ctx, expr)
				var pe *PromError
				if errors.As(err, &pe) {
					t.Fatalf("panel %q: Prometheus rejects %s: %v", p.Title, expr, err)
				} else if err != nil {
					t.Fatalf("panel %q: %s: %v", p.Title, expr, err)
				}
				if len(res) > 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("panel %q: no series for %s", p.Title, expr)
				}
				time.Sleep(250 * time.Millisecond)
			}
		}
	}

	// The variables' own queries list what the gateways export.
	wantValues := map[string][]string{
		"instance": {host(upURL), host(serveURL)},
		"model":    {model, "m", "unknown"},
		"endpoint": simURLs,
	}
	chosen := map[string]string{}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		match, label := variableQuery(t, v.Definition)
		vals, err := prom.LabelValues(ctx, label, substitute(match, all, "5m"))
		if err != nil {
			t.Fatalf("variable %q: %v", v.Name, err)
		}
		for _, w := range wantValues[v.Name] {
			if !slices.Contains(vals, w) {
				t.Errorf("variable %q: values %v lack %q", v.Name, vals, w)
			}
		}
		chosen[v.Name] = grafanaRegex(wantValues[v.Name][len(wantValues[v.Name])-1])
	}
	// One value of each (Grafana escapes a value it puts under =~ as a
	// regex inside a PromQL string: `\\.` for a dot): every query still
	// parses.
	chosen["instance"], chosen["model"] = grafanaRegex(host(serveURL)), "m"
	for _, p := range d.queryPanels() {
		for _, tg := range p.Targets {
			expr := substitute(tg.Expr, chosen, "5m")
			if _, err := prom.Query(ctx, expr); err != nil {
				t.Errorf("panel %q with one value per variable: %s: %v", p.Title, expr, err)
			}
		}
	}
	if err := up.Stop(30 * time.Second); err != nil {
		t.Errorf("infergate up: %v", err)
	}
}

// grafanaRegex is a variable's value as Grafana's Prometheus data source
// puts it under =~ (prometheusRegularEscape): regex characters escaped,
// and the backslashes doubled for the PromQL string literal.
func grafanaRegex(v string) string {
	return strings.ReplaceAll(regexp.QuoteMeta(v), `\`, `\\`)
}

var (
	apiRe  = regexp.MustCompile(`OpenAI API at (http://[0-9.:]+)/v1`)
	addrRe = regexp.MustCompile(`addr=(http://[0-9.:]+)`)
)

func await(t *testing.T, ctx context.Context, p *Process, re *regexp.Regexp) string {
	t.Helper()
	actx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	s, err := p.Await(actx, re)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// waitQuery waits until expr returns n series.
func waitQuery(t *testing.T, ctx context.Context, prom *Prometheus, expr string, n int, what string) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		res, err := prom.Query(ctx, expr)
		if err == nil && len(res) == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s: %v %v; prometheus output:\n%s", what, res, err, lastLines(prom.Proc.Output(), 20))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// call posts body with key (none if empty) and returns the status and body.
func call(t *testing.T, c *http.Client, url, key, body string) (int, []byte) {
	t.Helper()
	code, b, err := callCtx(context.Background(), c, url, key, body)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return code, b
}

func callCtx(ctx context.Context, c *http.Client, url, key, body string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// state reads the gateway's /dashboard/state.json.
func state(t *testing.T, ctx context.Context, c *http.Client, base, key string) gateway.DashboardState {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/dashboard/state.json", nil)
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st gateway.DashboardState
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil || resp.StatusCode != 200 {
		t.Fatalf("state.json: %d %v", resp.StatusCode, err)
	}
	return st
}

// waitState waits until the first pool of the gateway's state satisfies ok.
func waitState(t *testing.T, ctx context.Context, c *http.Client, base, key, what string, ok func(gateway.DashPool) bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		st := state(t, ctx, c, base, key)
		if len(st.Pools) > 0 && ok(st.Pools[0]) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s: %+v", what, st.Pools)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestLiveDashboardChromium renders /dashboard of a real `infergate up` in
// headless Chromium after some traffic and checks that the page's script
// drew what state.json says: the model, every endpoint with its request
// count and cache hit rate, the fleet's readiness. The static page holds
// none of it. A gateway with auth.protect_metrics gets the key prompt.
// INFERGATE_DASHBOARD_SCREENSHOT=path.png keeps a screenshot.
func TestLiveDashboardChromium(t *testing.T) {
	chromium := RequireTool(t, EnvChromium, "chromium", "chromium", "chromium-browser")
	bin := infergateBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	client := &http.Client{Timeout: time.Minute}

	// Round-robin spreads the sessions over every engine (cache-aware
	// would keep sequential ones together on an idle fleet).
	up := StartProcessT(t, "infergate up", bin, "up", "--engines", "3", "--listen", "127.0.0.1:0", "--time-scale", "100", "--policy", "round-robin")
	base := await(t, ctx, up, apiRe)
	model := "meta-llama/Llama-3.1-70B-Instruct"
	for s := range 6 {
		sys := strings.Repeat(fmt.Sprintf("Team %d assistant: answer briefly and cite sources. ", s), 25)
		for turn := range 3 {
			body := fmt.Sprintf(`{"model":%q,"stream":true,"max_tokens":8,"messages":[{"role":"system","content":%q},{"role":"user","content":"question %d"}]}`, model, sys, turn)
			if code, b := call(t, client, base+"/v1/chat/completions", "", body); code != 200 {
				t.Fatalf("session %d turn %d: %d %s", s, turn, code, b)
			}
		}
	}
	st := state(t, ctx, client, base, "")
	if len(st.Pools) != 1 || len(st.Pools[0].Endpoints) != 3 || st.Fleet.Total.Requests != 18 {
		t.Fatalf("state: %+v", st)
	}

	page := get(t, base+"/dashboard")
	for _, e := range st.Pools[0].Endpoints {
		if strings.Contains(page, e.Endpoint) {
			t.Fatalf("the static page already names %s: the test would not show the script rendered it", e.Endpoint)
		}
	}

	dir := t.TempDir()
	shot := os.Getenv("INFERGATE_DASHBOARD_SCREENSHOT")
	if shot == "" {
		shot = filepath.Join(dir, "dashboard.png")
	}
	dom, err := Chromium(ctx, chromium, dir, base+"/dashboard", 5*time.Second, shot, 1440, 1000)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s", shot)
	field := func(scope, name string) string {
		m := regexp.MustCompile(`data-field="` + regexp.QuoteMeta(name) + `"[^>]*>([^<]*)<`).FindStringSubmatch(scope)
		if m == nil {
			return "<missing>"
		}
		return m[1]
	}
	if got, want := field(dom, "model"), st.Pools[0].Model; got != want {
		t.Errorf("rendered model %q, want %q", got, want)
	}
	if got, want := field(dom, "fleet-ready"), fmt.Sprintf("%d / %d", st.Fleet.Ready, st.Fleet.Endpoints); got != want {
		t.Errorf("rendered readiness %q, want %q", got, want)
	}
	for _, e := range st.Pools[0].Endpoints {
		row := regexp.MustCompile(`(?s)<tr data-endpoint="` + regexp.QuoteMeta(e.Endpoint) + `">(.*?)</tr>`).FindStringSubmatch(dom)
		if row == nil {
			t.Errorf("no rendered row for %s", e.Endpoint)
			continue
		}
		if got, want := strings.ReplaceAll(field(row[1], "requests"), ",", ""), strconv.FormatFloat(e.Total.Requests, 'f', 0, 64); got != want {
			t.Errorf("%s: rendered requests %q, want %q", e.Endpoint, got, want)
		}
		want := "–"
		if r := e.Total.CacheHitRate; r != nil {
			want = strconv.FormatFloat(*r*100, 'f', 1, 64) + "%"
		}
		if got := strings.TrimSpace(field(row[1], "hit-total")); got != want {
			t.Errorf("%s: rendered total hit rate %q, want %q", e.Endpoint, got, want)
		}
		if got := field(row[1], "state"); !strings.Contains(row[1], ">"+e.State+"<") {
			t.Errorf("%s: state %q not rendered (%q)", e.Endpoint, e.State, got)
		}
	}
	if !strings.Contains(dom, `class="pill pill-ok">serving<`) {
		t.Errorf("status pill not 'serving'")
	}
	if t.Failed() {
		t.Logf("rendered DOM:\n%s", dom)
	}

	// With protect_metrics the page asks for a key instead.
	cfgPath := filepath.Join(dir, "serve.yaml")
	cfg := fmt.Sprintf("listen: 127.0.0.1:0\nhealth_check_path: \"-\"\nauth: {protect_metrics: true, keys: [{name: ops, hash: %s}]}\nendpoints: [{url: %q, model: m}]\n",
		auth.HashKey("sk-chromium-test-key"), closedURL(t))
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	serve := StartProcessT(t, "infergate serve", bin, "serve", "-c", cfgPath)
	sbase := await(t, ctx, serve, addrRe)
	dom, err = Chromium(ctx, chromium, dir, sbase+"/dashboard", 3*time.Second, "", 1200, 800)
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`<section id="auth" class="panel auth">`).MatchString(dom) || !strings.Contains(dom, ">key required<") {
		t.Errorf("protect_metrics: no key prompt rendered:\n%s", dom)
	}
	if err := up.Stop(30 * time.Second); err != nil {
		t.Errorf("infergate up: %v", err)
	}
}

// closedURL is the URL of a loopback port nothing listens on.
func closedURL(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := url.URL{Scheme: "http", Host: l.Addr().String()}
	_ = l.Close()
	return u.String()
}
