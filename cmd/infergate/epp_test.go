package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/infergate/infergate/simserver"
)

// envoyLike plays Envoy for one request through `infergate epp`: the
// request's headers and body (split in pieces) to the picker, the
// request as the picker returned it to the picked engine, and the
// engine's answer back through the picker; it returns the destination and
// the answer as the client gets it, or "" and the status of the picker's
// immediate response. subset, when not nil, is the proxy's subset hint.
func envoyLike(t *testing.T, c extprocv3.ExternalProcessorClient, body []byte, subset []string) (string, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := c.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	send := func(r *extprocv3.ProcessingRequest) {
		if err := s.Send(r); err != nil {
			t.Fatal(err)
		}
	}
	recv := func() *extprocv3.ProcessingResponse {
		r, err := s.Recv()
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	var md *corev3.Metadata
	if subset != nil {
		l := make([]*structpb.Value, len(subset))
		for i, a := range subset {
			l[i] = structpb.NewStringValue(a)
		}
		md = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb.subset_hint": {Fields: map[string]*structpb.Value{
			"x-gateway-destination-endpoint-subset": structpb.NewListValue(&structpb.ListValue{Values: l})}}}}
	}
	send(&extprocv3.ProcessingRequest{MetadataContext: md, Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":method", RawValue: []byte("POST")},
			{Key: ":path", RawValue: []byte("/v1/chat/completions")}, {Key: "content-type", RawValue: []byte("application/json")}}}}}})
	for off := 0; off < len(body); off += 4099 { // pieces that never line up with the picker's chunks
		end := min(len(body), off+4099)
		send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: body[off:end], EndOfStream: end == len(body)}}})
	}
	first := recv()
	if ir := first.GetImmediateResponse(); ir != nil {
		return "", fmt.Appendf(nil, "%d", ir.GetStatus().GetCode())
	}
	hr := first.GetRequestHeaders()
	if hr == nil {
		t.Fatal("no request-headers response")
	}
	var dest string
	for _, h := range hr.GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == "x-gateway-destination-endpoint" {
			dest = string(h.GetHeader().GetRawValue())
		}
	}
	var fwd []byte
	for {
		sr := recv().GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		fwd = append(fwd, sr.GetBody()...)
		if sr.GetEndOfStream() {
			break
		}
	}
	// The ORIGINAL_DST cluster: to the address the header names.
	resp, err := http.Post("http://"+dest+"/v1/chat/completions", "application/json", bytes.NewReader(fwd))
	if err != nil {
		t.Fatal(err)
	}
	answer, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	send(&extprocv3.ProcessingRequest{
		MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb": {Fields: map[string]*structpb.Value{
			"x-gateway-destination-endpoint-served": structpb.NewStringValue(dest)}}}},
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{
			Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: fmt.Appendf(nil, "%d", resp.StatusCode)},
				{Key: "content-type", RawValue: []byte(resp.Header.Get("Content-Type"))}}}}}})
	recv()
	send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
		Body: answer, EndOfStream: true}}})
	var got []byte
	for {
		sr := recv().GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		got = append(got, sr.GetBody()...)
		if sr.GetEndOfStream() {
			break
		}
	}
	if resp.StatusCode != http.StatusOK || !bytes.Equal(got, answer) {
		t.Fatalf("engine answered %d %q; the picker echoed %q", resp.StatusCode, answer, got)
	}
	_ = s.CloseSend()
	return dest, got
}

// TestEPPEndToEnd runs `infergate epp` as a process in front of simulated
// engines, driven as Envoy drives it: requests that share a long prefix
// go to the same engine (cache-aware routing through the picker), the
// answers are accounted, the health and HTTP listeners answer, an engine
// added to the file is picked after SIGHUP (the gateway's reload path, which
// discovery feeds too), SIGTERM ends it cleanly.
func TestEPPEndToEnd(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	f, err := simserver.StartFleet(4, simserver.ServerConfig{Model: "m", TimeScale: 100})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var yaml strings.Builder
	yaml.WriteString("listen: 127.0.0.1:0\nhealth_check_interval: 50ms\nrouting: {policy: cache-aware}\n" +
		"epp: {listen: \"127.0.0.1:0\", health_listen: \"127.0.0.1:0\"}\nendpoints:\n")
	head := yaml.String()
	for _, u := range f.URLs[:3] { // the 4th joins at the reload
		fmt.Fprintf(&yaml, "  - {url: %q, model: m}\n", u)
	}
	cfg := filepath.Join(t.TempDir(), "epp.yaml")
	if err := os.WriteFile(cfg, []byte(yaml.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	p := start(t, "epp", "-c", cfg)
	line := p.await(t, regexp.MustCompile(`(epp listening.*)`))
	field := func(k string) string {
		m := regexp.MustCompile(k + `=(\S+)`).FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("no %s in %q", k, line)
		}
		return m[1]
	}
	extProc, health, httpURL := field("ext_proc"), field("health"), field("http")

	conn, err := grpc.NewClient(extProc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := extprocv3.NewExternalProcessorClient(conn)
	engines := map[string]bool{}
	for _, u := range f.URLs[:3] {
		engines[strings.TrimPrefix(u, "http://")] = true
	}
	homes := map[int]string{}
	for round := range 3 {
		for conv := range 4 {
			system := fmt.Sprintf("conversation %d: ", conv) + strings.Repeat(fmt.Sprintf("the %d-th shared instructions, word for word. ", conv), 120)
			body := fmt.Appendf(nil, `{"model":"m","max_tokens":4,"messages":[{"role":"system","content":%q},{"role":"user","content":"turn %d"}]}`,
				system, round)
			dest, _ := envoyLike(t, c, body, nil)
			if !engines[dest] {
				t.Fatalf("destination %q is no engine of %v", dest, f.URLs)
			}
			if round == 0 {
				homes[conv] = dest
			} else if dest != homes[conv] {
				t.Errorf("conversation %d, turn %d: sent to %s, its earlier turns to %s", conv, round, dest, homes[conv])
			}
		}
	}

	spread := map[string]bool{}
	for _, h := range homes {
		spread[h] = true
	}
	t.Logf("conversations' engines: %v", homes)
	if len(spread) < 2 {
		t.Errorf("4 conversations all on one engine (%v): no load spreading", homes)
	}

	hc, err := grpc.NewClient(health, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer hc.Close()
	for _, svc := range []string{"", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"} {
		r, err := healthpb.NewHealthClient(hc).Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health %q: %v %v", svc, r, err)
		}
	}
	// The health port (and ext_proc's) bound a stream's gRPC metadata
	// (gateway.MaxGRPCHeaderBytes; a Watch keeps it until its client
	// leaves: 200 with 3 MiB each held 730 MB of RSS).
	big := metadata.AppendToOutgoingContext(context.Background(), "x-pad", strings.Repeat("a", 1<<20))
	if _, err := healthpb.NewHealthClient(hc).Check(big, &healthpb.HealthCheckRequest{}); err == nil {
		t.Error("a health Check with 1 MiB of metadata was served")
	}
	resp, err := http.Get(httpURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`infergate_epp_decisions_total{result="picked"} 12`, `infergate_prompt_tokens_total{`, `infergate_requests_total{`} {
		if !bytes.Contains(metrics, []byte(want)) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if r, err := http.Get(httpURL + "/v1/chat/completions"); err != nil || r.StatusCode != http.StatusNotFound {
		t.Errorf("the HTTP listener serves the API: %v %v", r, err)
	} else {
		r.Body.Close()
	}

	// An engine added to the file joins at SIGHUP; the proxy's subset hint
	// names it alone.
	yaml.Reset()
	yaml.WriteString(head)
	for _, u := range f.URLs {
		fmt.Fprintf(&yaml, "  - {url: %q, model: m}\n", u)
	}
	if err := os.WriteFile(cfg, []byte(yaml.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	p.await(t, regexp.MustCompile(`(configuration reloaded)`))
	fourth := strings.TrimPrefix(f.URLs[3], "http://")
	body := []byte(`{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"new engine"}]}`)
	deadline := time.Now().Add(time.Minute) // a bound on its first health check, not a timing claim
	for {
		dest, status := envoyLike(t, c, body, []string{fourth})
		if dest == fourth {
			break
		}
		if dest != "" || string(status) != "503" || time.Now().After(deadline) {
			t.Fatalf("subset {%s} after the reload: %q %s", fourth, dest, status)
		}
		time.Sleep(20 * time.Millisecond)
	}
	p.stop(t)
}
