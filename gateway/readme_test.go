package gateway

import (
	"context"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/auth"
)

// configKeys lists the YAML keys of t (a struct type) under prefix: leaves
// as "a.b", fields of list elements as "a[].b"; inline structs are flattened,
// maps and scalars are leaves.
func configKeys(t reflect.Type, prefix string) []string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	var keys []string
	for f := range t.Fields() {
		if !f.IsExported() {
			continue
		}
		tag, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if tag == "-" {
			continue
		}
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if opts == "inline" {
			keys = append(keys, configKeys(ft, prefix)...)
			continue
		}
		if tag == "" {
			tag = strings.ToLower(f.Name)
		}
		key := prefix + tag
		switch {
		case ft.Kind() == reflect.Struct && ft != reflect.TypeFor[time.Time]():
			keys = append(keys, configKeys(ft, key+".")...)
		case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct:
			keys = append(keys, configKeys(ft.Elem(), key+"[].")...)
		default:
			keys = append(keys, key)
		}
	}
	return keys
}

// readmeSection returns the text of gateway/README.md from the heading
// that starts with heading to the next heading of its level.
func readmeSection(t *testing.T, heading string) string {
	t.Helper()
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i := strings.Index(s, "\n"+heading)
	if i < 0 {
		t.Fatalf("README.md has no %q section", heading)
	}
	s = s[i+1:]
	level := heading[:strings.IndexByte(heading, ' ')+1]
	if j := strings.Index(s[1:], "\n"+level); j >= 0 {
		s = s[:j+1]
	}
	return s
}

// documented reports whether the configuration table documents key: as
// `key`, under a wildcard row `parent.*`, or, for a field of list
// elements (`a[].b`), by the list's own row `a` naming the field.
func documented(table, key string) bool {
	if strings.Contains(table, "`"+key+"`") {
		return true
	}
	for i := len(key) - 1; i > 0; i-- {
		if key[i] == '.' && strings.Contains(table, "`"+key[:i]+".*`") {
			return true
		}
	}
	list, field, ok := strings.Cut(key, "[].")
	if !ok {
		return false
	}
	for line := range strings.SplitSeq(table, "\n") {
		if strings.HasPrefix(line, "| `"+list+"` |") && regexp.MustCompile(`\b`+regexp.QuoteMeta(field)+`\b`).MatchString(line) {
			return true
		}
	}
	return false
}

// TestREADMEListsEveryConfigKey: every key of Config (walked through its
// yaml tags) is in README.md's configuration table.
func TestREADMEListsEveryConfigKey(t *testing.T) {
	table := readmeSection(t, "## Configuration")
	keys := configKeys(reflect.TypeFor[Config](), "")
	if len(keys) < 60 || !slices.Contains(keys, "endpoints[].kv_events.endpoint") || !slices.Contains(keys, "routing.prefix.block_size") {
		t.Fatalf("the walk found %d keys: %v", len(keys), keys)
	}
	for _, k := range keys {
		if !documented(table, k) {
			t.Errorf("config key %s is not in README.md's configuration table", k)
		}
	}
}

// describingRegisterer records the names of the metrics registered on it
// (as e2e's recordingRegisterer: the descriptors, not the samples, so
// vectors without children count).
type describingRegisterer struct {
	*prometheus.Registry
	names map[string]bool
}

var fqNameRe = regexp.MustCompile(`fqName: "([^"]+)"`)

func (r *describingRegisterer) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc, 64)
	go func() {
		c.Describe(ch)
		close(ch)
	}()
	for d := range ch {
		if m := fqNameRe.FindStringSubmatch(d.String()); m != nil {
			r.names[m[1]] = true
		}
	}
	return r.Registry.Register(c)
}

func (r *describingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// TestREADMEListsEveryMetric: every metric a gateway registers, with every
// feature that registers metrics on (API keys, KV events, the access log),
// has a row in README.md's metrics table, and every row is a metric.
func TestREADMEListsEveryMetric(t *testing.T) {
	reg := &describingRegisterer{Registry: prometheus.NewRegistry(), names: map[string]bool{}}
	cfg := Config{HealthCheckPath: healthCheckOff, Endpoints: []EndpointConfig{{URL: "http://127.0.0.1:9", Model: "m", KVBlocks: 1000,
		KVEvents: &KVEventsConfig{Endpoint: "tcp://127.0.0.1:9"}}}}
	cfg.Auth.Keys = []auth.Key{{Name: "k", Hash: auth.HashKey("sk-k")}}
	cfg.Autoscale.Policy = "max=4"
	withAccessLog(t, &cfg, LogFormatJSON)
	g, err := New(context.Background(), cfg, reg)
	if err != nil {
		t.Fatal(err)
	}
	g.Close()
	table := readmeSection(t, "## Metrics")
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `(infergate_[a-z0-9_]+)`").FindAllStringSubmatch(table, -1) {
		listed[m[1]] = true
	}
	n := 0
	for name := range reg.names {
		if !strings.HasPrefix(name, "infergate_") {
			continue
		}
		n++
		if !listed[name] {
			t.Errorf("metric %s is not in README.md's metrics table", name)
		}
	}
	if n < 30 {
		t.Fatalf("%d infergate_ metrics registered: %v", n, reg.names)
	}
	for name := range listed {
		if !reg.names[name] {
			t.Errorf("README.md lists %s, which the gateway does not register", name)
		}
	}
}
