package helm

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/infergate/infergate/gateway"
)

// manifest is one rendered document, decoded.
type manifest struct {
	src  string
	obj  map[string]any
	kind string
	name string
}

func decode(t *testing.T, docs []string) []manifest {
	t.Helper()
	var ms []manifest
	seen := map[string]bool{}
	for _, d := range docs {
		var obj map[string]any
		if err := yaml.Unmarshal([]byte(d), &obj); err != nil {
			t.Fatalf("rendered document does not parse: %v\n%s", err, d)
		}
		m := manifest{src: d, obj: obj, kind: str(obj, "kind"), name: str(obj, "metadata", "name")}
		if m.kind == "" || m.name == "" || str(obj, "apiVersion") == "" {
			t.Fatalf("document without apiVersion, kind or metadata.name:\n%s", d)
		}
		if ns := str(obj, "metadata", "namespace"); ns != "" {
			t.Errorf("%s/%s sets metadata.namespace %q: the release namespace is helm's to set", m.kind, m.name, ns)
		}
		key := m.kind + "/" + m.name
		if seen[key] {
			t.Errorf("duplicate %s", key)
		}
		seen[key] = true
		ms = append(ms, m)
	}
	return ms
}

// get walks nested maps and lists (a string key into a map, an int into a
// list); nil when the path does not exist.
func get(v any, path ...any) any {
	for _, p := range path {
		switch k := p.(type) {
		case string:
			m, ok := v.(map[string]any)
			if !ok {
				return nil
			}
			v = m[k]
		case int:
			l, ok := v.([]any)
			if !ok || k >= len(l) {
				return nil
			}
			v = l[k]
		}
	}
	return v
}

func str(v any, path ...any) string {
	s, _ := get(v, path...).(string)
	return s
}

func num(v any, path ...any) int {
	n, _ := get(v, path...).(int)
	return n
}

func list(v any, path ...any) []any {
	l, _ := get(v, path...).([]any)
	return l
}

func find(ms []manifest, kind string) []manifest {
	var out []manifest
	for _, m := range ms {
		if m.kind == kind {
			out = append(out, m)
		}
	}
	return out
}

func one(t *testing.T, ms []manifest, kind string) manifest {
	t.Helper()
	f := find(ms, kind)
	if len(f) != 1 {
		t.Fatalf("%d %s documents rendered, want 1", len(f), kind)
	}
	return f[0]
}

func render(t *testing.T, bin string, o Options) []manifest {
	t.Helper()
	docs, err := Template(context.Background(), bin, o)
	if err != nil {
		t.Fatal(err)
	}
	return decode(t, docs)
}

func TestChartLint(t *testing.T) {
	bin := Require(t)
	for _, o := range []Options{
		{},
		{Set: []string{"mode=serve", "discovery.service=vllm"}},
		{Set: []string{"replicas=3", "httpRoute.create=true"}},
	} {
		if out, err := Lint(context.Background(), bin, o); err != nil {
			t.Errorf("lint %v: %v\n%s", o.Set, err, out)
		}
	}
}

// chartCase is one values combination and what it must render.
type chartCase struct {
	name      string
	opts      Options
	mode      string
	pool      string // the InferencePool discovery watches ("" = none)
	service   string // the Service discovery watches ("" = none)
	renders   bool   // an InferencePool document
	route     bool   // an HTTPRoute document
	replicas  int
	endpoints int // static endpoints in the config
}

func TestChartTemplate(t *testing.T) {
	bin := Require(t)
	const ns = "llm"
	cases := []chartCase{
		{name: "epp default", mode: "epp", pool: "infergate", renders: true, replicas: 1},
		{name: "epp replicas 3 with route", opts: Options{Set: []string{"replicas=3", "httpRoute.create=true",
			"inferencePool.selector.app=vllm-llama", "inferencePool.targetPorts={8000,8001}"}},
			mode: "epp", pool: "infergate", renders: true, route: true, replicas: 3},
		{name: "epp existing pool", opts: Options{Set: []string{"inferencePool.create=false", "inferencePool.name=llama-pool"}},
			mode: "epp", pool: "llama-pool", replicas: 1},
		{name: "serve service discovery", opts: Options{Release: "gw", Set: []string{"mode=serve", "discovery.service=vllm", "discovery.port=http"}},
			mode: "serve", service: "vllm", replicas: 1},
		{name: "serve pool discovery with route", opts: Options{Set: []string{"mode=serve", "inferencePool.name=llama-pool", "httpRoute.create=true"}},
			mode: "serve", pool: "llama-pool", route: true, replicas: 1},
		{name: "serve custom config", mode: "serve", replicas: 2, endpoints: 2, opts: Options{Values: []string{`
mode: serve
replicas: 2
discovery: {enabled: false}
config:
  routing: {policy: precise-prefix}
  aliases: {fast: [llama]}
  endpoints:
    - {url: "http://10.0.0.1:8000", model: llama, kv_events: {endpoint: "tcp://10.0.0.1:5557"}}
    - {url: "http://10.0.0.2:8000", model: llama, kv_events: {endpoint: "tcp://10.0.0.2:5557"}}
`}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			o := c.opts
			o.Namespace = ns
			ms := render(t, bin, o)
			checkRendering(t, ms, c, ns)
		})
	}
}

func checkRendering(t *testing.T, ms []manifest, c chartCase, ns string) {
	dep := one(t, ms, "Deployment")
	svc := one(t, ms, "Service")
	cm := one(t, ms, "ConfigMap")
	pod := get(dep.obj, "spec", "template")

	// The Deployment selects its pods, the Service the same pods.
	sel, _ := get(dep.obj, "spec", "selector", "matchLabels").(map[string]any)
	labels, _ := get(pod, "metadata", "labels").(map[string]any)
	if len(sel) == 0 {
		t.Fatal("Deployment without spec.selector.matchLabels")
	}
	for k, v := range sel {
		if labels[k] != v {
			t.Errorf("pod label %s = %v, the selector wants %v", k, labels[k], v)
		}
	}
	if svcSel, _ := get(svc.obj, "spec", "selector").(map[string]any); !reflect.DeepEqual(svcSel, sel) {
		t.Errorf("Service selector %v, Deployment's %v", svcSel, sel)
	}
	if got := num(dep.obj, "spec", "replicas"); got != c.replicas {
		t.Errorf("replicas %d, want %d", got, c.replicas)
	}

	ctr := get(pod, "spec", "containers", 0)
	args := list(ctr, "args")
	want := []any{c.mode, "-c", "/etc/infergate/config.yaml"}
	if len(args) < 3 || !reflect.DeepEqual(args[:3], want) {
		t.Errorf("container args %v, want %v first", args, want)
	}
	if str(get(pod, "spec", "volumes", 0), "configMap", "name") != cm.name {
		t.Errorf("config volume %v does not mount ConfigMap %s", get(pod, "spec", "volumes", 0), cm.name)
	}
	if mp := str(ctr, "volumeMounts", 0, "mountPath"); mp != "/etc/infergate" {
		t.Errorf("config mounted at %q", mp)
	}
	checkSecurity(t, pod, ctr)

	// Ports, probes and scrape annotations.
	ports := map[string]int{}
	for _, p := range list(ctr, "ports") {
		ports[str(p, "name")] = num(p, "containerPort")
	}
	ann, _ := get(pod, "metadata", "annotations").(map[string]any)
	if ann["checksum/config"] == nil || len(str(ann, "checksum/config")) != 64 {
		t.Errorf("pod template without a sha256 checksum/config annotation: %v", ann)
	}
	if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/path"] != "/metrics" {
		t.Errorf("scrape annotations %v", ann)
	}
	svcPorts := map[string]map[string]any{}
	for _, p := range list(svc.obj, "spec", "ports") {
		svcPorts[str(p, "name")] = p.(map[string]any)
	}
	live, ready := get(ctr, "livenessProbe"), get(ctr, "readinessProbe")
	var cfgWant map[string]any
	switch c.mode {
	case "epp":
		if !reflect.DeepEqual(ports, map[string]int{"grpc": 9002, "health": 9003, "metrics": 9090}) {
			t.Errorf("epp container ports %v", ports)
		}
		if str(ann, "prometheus.io/port") != "9090" {
			t.Errorf("prometheus.io/port %v, want 9090", ann["prometheus.io/port"])
		}
		if num(live, "grpc", "port") != 9003 || str(live, "grpc", "service") != "liveness" {
			t.Errorf("epp liveness probe %v: want gRPC on 9003, service liveness", live)
		}
		if num(ready, "grpc", "port") != 9003 || str(ready, "grpc", "service") != "readiness" {
			t.Errorf("epp readiness probe %v: want gRPC on 9003, service readiness", ready)
		}
		g := svcPorts["grpc"]
		if num(g, "port") != 9002 || str(g, "targetPort") != "grpc" || str(g, "appProtocol") != "http2" {
			t.Errorf("Service port grpc %v: want 9002 → grpc, appProtocol http2", g)
		}
		if num(svcPorts["health"], "port") != 9003 || num(svcPorts["metrics"], "port") != 9090 || len(svcPorts) != 3 {
			t.Errorf("epp Service ports %v", svcPorts)
		}
		cfgWant = map[string]any{"listen": ":9090", "epp": map[string]any{"listen": ":9002", "health_listen": ":9003"}}
	case "serve":
		if !reflect.DeepEqual(ports, map[string]int{"http": 8080}) {
			t.Errorf("serve container ports %v", ports)
		}
		if str(ann, "prometheus.io/port") != "8080" {
			t.Errorf("prometheus.io/port %v, want 8080", ann["prometheus.io/port"])
		}
		if str(live, "httpGet", "path") != "/healthz" || str(live, "httpGet", "port") != "http" {
			t.Errorf("serve liveness probe %v: want GET /healthz on http", live)
		}
		if str(ready, "httpGet", "path") != "/readyz" || str(ready, "httpGet", "port") != "http" {
			t.Errorf("serve readiness probe %v: want GET /readyz on http", ready)
		}
		if num(svcPorts["http"], "port") != 8080 || len(svcPorts) != 1 {
			t.Errorf("serve Service ports %v", svcPorts)
		}
		cfgWant = map[string]any{"listen": "0.0.0.0:8080"}
	}

	// The gateway configuration.
	data := str(cm.obj, "data", "config.yaml")
	raw := checkGatewayConfig(t, data, c.endpoints)
	for k, v := range cfgWant {
		if !reflect.DeepEqual(raw[k], v) {
			t.Errorf("config %s = %v, want %v", k, raw[k], v)
		}
	}
	if c.mode == "serve" && raw["epp"] != nil {
		t.Errorf("serve config has an epp section: %v", raw["epp"])
	}
	disc, _ := get(raw, "discovery", "kubernetes").(map[string]any)
	discovers := c.pool != "" || c.service != ""
	if discovers {
		if disc["namespace"] != ns {
			t.Errorf("discovery.kubernetes.namespace %v, want the release namespace %s", disc["namespace"], ns)
		}
		if str(disc, "inference_pool") != c.pool || str(disc, "service") != c.service {
			t.Errorf("discovery.kubernetes %v: want inference_pool %q, service %q", disc, c.pool, c.service)
		}
	} else if raw["discovery"] != nil {
		t.Errorf("config has discovery %v, want none", raw["discovery"])
	}

	// RBAC: exactly get/list/watch on the three resources discovery reads,
	// bound to the pods' service account; none without discovery.
	sa := str(pod, "spec", "serviceAccountName")
	if a := one(t, ms, "ServiceAccount"); a.name != sa {
		t.Errorf("pods run as %q, the chart's ServiceAccount is %q", sa, a.name)
	}
	if discovers {
		checkRBAC(t, ms, sa, ns)
	} else if len(find(ms, "Role")) != 0 || len(find(ms, "RoleBinding")) != 0 {
		t.Error("RBAC rendered without discovery")
	}

	// PodDisruptionBudget iff more than one replica.
	pdbs := find(ms, "PodDisruptionBudget")
	if c.replicas > 1 {
		if len(pdbs) != 1 {
			t.Fatalf("%d replicas and %d PodDisruptionBudgets", c.replicas, len(pdbs))
		}
		if ps, _ := get(pdbs[0].obj, "spec", "selector", "matchLabels").(map[string]any); !reflect.DeepEqual(ps, sel) {
			t.Errorf("PodDisruptionBudget selector %v, Deployment's %v", ps, sel)
		}
	} else if len(pdbs) != 0 {
		t.Errorf("PodDisruptionBudget rendered for %d replica", c.replicas)
	}

	// The InferencePool points its endpoint picker at this Service's grpc port.
	pools := find(ms, "InferencePool")
	if c.renders != (len(pools) == 1) || len(pools) > 1 {
		t.Fatalf("%d InferencePools rendered, want renders=%v", len(pools), c.renders)
	}
	if c.renders {
		p := pools[0]
		if str(p.obj, "apiVersion") != "inference.networking.k8s.io/v1" || p.name != c.pool {
			t.Errorf("InferencePool %s %s, want inference.networking.k8s.io/v1 %s", str(p.obj, "apiVersion"), p.name, c.pool)
		}
		ref := get(p.obj, "spec", "endpointPickerRef")
		if str(ref, "kind") != "Service" || str(ref, "name") != svc.name || num(ref, "port", "number") != num(svcPorts["grpc"], "port") {
			t.Errorf("endpointPickerRef %v: want Service %s port %d", ref, svc.name, num(svcPorts["grpc"], "port"))
		}
		if fm := str(ref, "failureMode"); fm != "FailClose" && fm != "FailOpen" {
			t.Errorf("failureMode %q", fm)
		}
		if ml, _ := get(p.obj, "spec", "selector", "matchLabels").(map[string]any); len(ml) == 0 {
			t.Error("InferencePool without spec.selector.matchLabels")
		}
		if tp := list(p.obj, "spec", "targetPorts"); len(tp) == 0 || num(tp[0], "number") == 0 {
			t.Errorf("targetPorts %v", tp)
		}
	}
	routes := find(ms, "HTTPRoute")
	if c.route != (len(routes) == 1) || len(routes) > 1 {
		t.Fatalf("%d HTTPRoutes rendered, want route=%v", len(routes), c.route)
	}
	if c.route {
		r := routes[0]
		br := get(r.obj, "spec", "rules", 0, "backendRefs", 0)
		if str(r.obj, "apiVersion") != "gateway.networking.k8s.io/v1" {
			t.Errorf("HTTPRoute apiVersion %s", str(r.obj, "apiVersion"))
		}
		switch c.mode {
		case "epp":
			if str(br, "group") != "inference.networking.k8s.io" || str(br, "kind") != "InferencePool" || str(br, "name") != c.pool {
				t.Errorf("HTTPRoute backendRef %v: want the InferencePool %s", br, c.pool)
			}
		case "serve":
			if str(br, "kind") != "Service" || str(br, "name") != svc.name || num(br, "port") != num(svcPorts["http"], "port") {
				t.Errorf("HTTPRoute backendRef %v: want Service %s port %d", br, svc.name, num(svcPorts["http"], "port"))
			}
		}
		if len(list(r.obj, "spec", "parentRefs")) == 0 {
			t.Error("HTTPRoute without parentRefs")
		}
	}
}

func checkSecurity(t *testing.T, pod, ctr any) {
	t.Helper()
	if get(pod, "spec", "securityContext", "runAsNonRoot") != true || num(pod, "spec", "securityContext", "runAsUser") != 65532 {
		t.Errorf("pod securityContext %v: want non-root 65532", get(pod, "spec", "securityContext"))
	}
	sc := get(ctr, "securityContext")
	if get(sc, "readOnlyRootFilesystem") != true || get(sc, "allowPrivilegeEscalation") != false ||
		!reflect.DeepEqual(list(sc, "capabilities", "drop"), []any{"ALL"}) {
		t.Errorf("container securityContext %v: want read-only root, no escalation, drop ALL", sc)
	}
	if res := get(ctr, "resources", "requests"); str(res, "cpu") == "" || str(res, "memory") == "" {
		t.Errorf("container without cpu and memory requests: %v", get(ctr, "resources"))
	}
}

func checkRBAC(t *testing.T, ms []manifest, sa, ns string) {
	t.Helper()
	role := one(t, ms, "Role")
	want := map[string]string{
		"inference.networking.k8s.io/inferencepools": "",
		"/pods":                           "",
		"discovery.k8s.io/endpointslices": "",
	}
	rules := list(role.obj, "rules")
	if len(rules) != len(want) {
		t.Errorf("Role has %d rules, want %d: %v", len(rules), len(want), rules)
	}
	for _, r := range rules {
		groups, res := list(r, "apiGroups"), list(r, "resources")
		if len(groups) != 1 || len(res) != 1 {
			t.Errorf("rule %v: want one group and one resource", r)
			continue
		}
		key := groups[0].(string) + "/" + res[0].(string)
		if _, ok := want[key]; !ok {
			t.Errorf("rule on %s: not one discovery reads", key)
		}
		delete(want, key)
		if v := list(r, "verbs"); !reflect.DeepEqual(v, []any{"get", "list", "watch"}) {
			t.Errorf("rule on %s has verbs %v, want exactly get, list, watch", key, v)
		}
		if r.(map[string]any)["resourceNames"] != nil || r.(map[string]any)["nonResourceURLs"] != nil {
			t.Errorf("rule on %s: unexpected fields %v", key, r)
		}
	}
	for k := range want {
		t.Errorf("no rule on %s", k)
	}
	if len(find(ms, "ClusterRole")) != 0 || len(find(ms, "ClusterRoleBinding")) != 0 {
		t.Error("cluster-wide RBAC rendered")
	}
	rb := one(t, ms, "RoleBinding")
	if str(rb.obj, "roleRef", "kind") != "Role" || str(rb.obj, "roleRef", "name") != role.name ||
		str(rb.obj, "subjects", 0, "kind") != "ServiceAccount" || str(rb.obj, "subjects", 0, "name") != sa ||
		str(rb.obj, "subjects", 0, "namespace") != ns || len(list(rb.obj, "subjects")) != 1 {
		t.Errorf("RoleBinding %v: want Role %s to ServiceAccount %s/%s", rb.obj, role.name, ns, sa)
	}
}

// configKeys are the top-level YAML keys gateway.Config knows, its inline
// sections' keys included.
func configKeys() map[string]bool {
	keys := map[string]bool{}
	var walk func(reflect.Type)
	walk = func(rt reflect.Type) {
		for f := range rt.Fields() {
			tag := f.Tag.Get("yaml")
			name, opts, _ := strings.Cut(tag, ",")
			if strings.Contains(opts, "inline") && f.Type.Kind() == reflect.Struct {
				walk(f.Type)
				continue
			}
			if name != "" && name != "-" {
				keys[name] = true
			}
		}
	}
	walk(reflect.TypeFor[gateway.Config]())
	return keys
}

// checkGatewayConfig loads the rendered config.yaml with the gateway's own
// loader (gateway.LoadConfig: unknown keys are errors), defaults and
// validates it as `infergate serve` does, and returns it as a map. A
// discovered engine is stood in by the discovery.kubernetes.endpoint
// template with {ip} and {port} filled in, decoded as a gateway
// EndpointConfig (unknown keys are errors), so the template is validated as
// the engines it will make. Sections that this build's gateway.Config does
// not have yet (discovery and epp, from issue 17's other branches) are
// checked by their shape here and left out of the gateway's load, with a
// log line saying so.
func checkGatewayConfig(t *testing.T, data string, static int) map[string]any {
	t.Helper()
	var raw map[string]any
	if err := yaml.Unmarshal([]byte(data), &raw); err != nil {
		t.Fatalf("config.yaml does not parse: %v\n%s", err, data)
	}
	known := configKeys()
	load := map[string]any{}
	for k, v := range raw {
		if known[k] {
			load[k] = v
			continue
		}
		if k != "discovery" && k != "epp" {
			t.Errorf("config key %q: neither gateway.Config's nor issue 17's (discovery, epp)", k)
			continue
		}
		t.Logf("gateway.Config has no %q section in this build: checked by shape only", k)
	}
	var tmpl *gateway.EndpointConfig
	if e, ok := get(raw, "discovery", "kubernetes", "endpoint").(map[string]any); ok {
		b, err := yaml.Marshal(e)
		if err != nil {
			t.Fatal(err)
		}
		filled := strings.NewReplacer("{ip}", "10.1.2.3", "{port}", "8000").Replace(string(b))
		dec := yaml.NewDecoder(strings.NewReader(filled))
		dec.KnownFields(true)
		tmpl = new(gateway.EndpointConfig)
		if err := dec.Decode(tmpl); err != nil {
			t.Fatalf("discovery.kubernetes.endpoint is not an endpoint config: %v\n%s", err, b)
		}
		if tmpl.URL != "" {
			t.Errorf("discovery.kubernetes.endpoint sets url %q (discovery makes it)", tmpl.URL)
		}
		tmpl.URL = "http://10.1.2.3:8000"
	}
	if eps := list(raw, "endpoints"); len(eps) != static {
		t.Errorf("%d static endpoints, want %d", len(eps), static)
	}
	b, err := yaml.Marshal(load)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := gateway.LoadConfig(path)
	if err != nil {
		t.Fatalf("the gateway refuses the rendered config: %v\n%s", err, data)
	}
	if tmpl != nil {
		cfg.Endpoints = append(cfg.Endpoints, *tmpl)
	}
	if err := cfg.WithDefaults().Validate(); err != nil {
		t.Fatalf("rendered config does not validate: %v\n%s", err, data)
	}
	return raw
}

// A config change changes the pods' checksum annotation (and so rolls
// them); the same values render the same checksum.
func TestChartConfigChecksum(t *testing.T) {
	bin := Require(t)
	sum := func(o Options) string {
		dep := one(t, render(t, bin, o), "Deployment")
		return str(dep.obj, "spec", "template", "metadata", "annotations", "checksum/config")
	}
	a := sum(Options{})
	if b := sum(Options{}); a != b {
		t.Errorf("same values, checksums %s and %s", a, b)
	}
	if c := sum(Options{Set: []string{"config.routing.policy=precise-prefix"}}); c == a {
		t.Error("a config change left the checksum as it was")
	}
}

// Values the chart must refuse: the schema's enums and the template's own
// check that some engines are configured.
func TestChartRefuses(t *testing.T) {
	bin := Require(t)
	for _, c := range []struct {
		set  []string
		want string
	}{
		{[]string{"mode=proxy"}, "mode"},
		{[]string{"inferencePool.failureMode=Open"}, "failureMode"},
		{[]string{"inferencePool.targetPorts={}"}, "targetPorts"},
		{[]string{"ports.grpc=70000"}, "grpc"},
		{[]string{"replica=2"}, "replica"},
		{[]string{"mode=serve"}, "no engines"},
		{[]string{"discovery.enabled=false"}, "no engines"},
	} {
		_, err := Template(context.Background(), bin, Options{Set: c.set})
		if err == nil {
			t.Errorf("--set %v rendered", c.set)
			continue
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("--set %v: error does not mention %q: %v", c.set, c.want, err)
		}
	}
}

// NOTES.txt renders for every case (helm template leaves it out, so a copy
// of the chart wraps it in a ConfigMap): it names the Service and prints no
// missing value.
func TestChartNotes(t *testing.T) {
	bin := Require(t)
	src, err := ChartDir()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "infergate")
	if err := os.CopyFS(dir, os.DirFS(src)); err != nil {
		t.Fatal(err)
	}
	notes, err := os.ReadFile(filepath.Join(src, "templates", "NOTES.txt"))
	if err != nil {
		t.Fatal(err)
	}
	check := "{{- define \"notescheck\" -}}\n" + string(notes) + "\n{{- end -}}\n" +
		"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes-check}\ndata:\n  notes: {{ include \"notescheck\" . | quote }}\n"
	if err := os.WriteFile(filepath.Join(dir, "templates", "zz-notes-check.yaml"), []byte(check), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, set := range [][]string{
		nil,
		{"replicas=3", "httpRoute.create=true", "inferencePool.targetPorts={8000,8001}"},
		{"inferencePool.create=false", "inferencePool.name=llama-pool"},
		{"mode=serve", "discovery.service=vllm"},
		{"mode=serve", "inferencePool.name=llama-pool", "httpRoute.create=true"},
		{"mode=serve", "discovery.enabled=false", "config.endpoints[0].url=http://10.0.0.1:8000", "config.endpoints[0].model=m"},
	} {
		ms := render(t, bin, Options{Set: set, chart: dir})
		var text string
		for _, m := range find(ms, "ConfigMap") {
			if m.name == "notes-check" {
				text = str(m.obj, "data", "notes")
			}
		}
		svc := one(t, ms, "Service")
		if !strings.Contains(text, "Service "+svc.name) || strings.Contains(text, "<no value>") || strings.Contains(text, "%!") {
			t.Errorf("--set %v: NOTES.txt renders badly:\n%s", set, text)
		}
		if len(set) > 1 && set[1] == "httpRoute.create=true" && !strings.Contains(text, "8000,8001") {
			t.Errorf("--set %v: NOTES.txt does not list the target ports:\n%s", set, text)
		}
	}
}

func TestSplitDocuments(t *testing.T) {
	in := "---\n# Source: a.yaml\n\n---\n# Source: b.yaml\nkind: A\n---\nkind: B\nx: \"---\"\n"
	got := SplitDocuments(in)
	want := []string{"# Source: b.yaml\nkind: A\n", "kind: B\nx: \"---\"\n"}
	if !slices.Equal(got, want) {
		t.Errorf("SplitDocuments = %q, want %q", got, want)
	}
}

// The chart's crds/inferencepool.yaml (CONTRACT: the one copy in the
// repository) renders with IncludeCRDs as the InferencePool v1 CRD, ahead
// of the pool that needs it.
func TestChartCRD(t *testing.T) {
	bin := Require(t)
	dir, err := ChartDir()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "crds", "inferencepool.yaml")); err != nil {
		t.Skipf("no CRD manifest in the chart yet: %v", err)
	}
	docs, err := Template(context.Background(), bin, Options{IncludeCRDs: true})
	if err != nil {
		t.Fatal(err)
	}
	ms := decode(t, docs)
	crd := ms[0]
	if crd.kind != "CustomResourceDefinition" || crd.name != "inferencepools.inference.networking.k8s.io" ||
		str(crd.obj, "spec", "group") != "inference.networking.k8s.io" {
		t.Fatalf("first document %s/%s, want the CustomResourceDefinition inferencepools.inference.networking.k8s.io", crd.kind, crd.name)
	}
	served := false
	for _, v := range list(crd.obj, "spec", "versions") {
		if str(v, "name") == "v1" && get(v, "served") == true {
			served = true
		}
	}
	if !served {
		t.Error("the CRD does not serve v1")
	}
	one(t, ms, "InferencePool")
}
