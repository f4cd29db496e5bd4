package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/infergate/infergate/autoscale/externalscaler"
)

// TestServeExternalScaler runs `infergate serve` with autoscale.keda_listen
// as a real process in front of a simulated engine, and asks its KEDA
// external scaler over gRPC: the pool is inactive and wants no engine
// (min 0) while idle; bad metadata is InvalidArgument; SIGTERM stops both
// servers cleanly.
func TestServeExternalScaler(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	addrRe := regexp.MustCompile(`addr=(http://[0-9.:]+)`)
	s := start(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "m")
	engine := s.await(t, addrRe)
	defer s.stop(t)
	cfg := filepath.Join(t.TempDir(), "config.yaml")
	yaml := fmt.Sprintf(`listen: 127.0.0.1:0
endpoints:
  - url: %s
    model: m
autoscale:
  policy: "min=0,max=4,target=8"
  keda_listen: 127.0.0.1:0
`, engine)
	if err := os.WriteFile(cfg, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	g := start(t, "serve", "-c", cfg)
	scaler := g.await(t, regexp.MustCompile(`KEDA external scaler listening"? addr=([0-9.:]+)`))
	g.await(t, addrRe)
	defer g.stop(t)

	conn, err := grpc.NewClient(scaler, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := externalscaler.NewExternalScalerClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ref := &externalscaler.ScaledObjectRef{Name: "m", Namespace: "default", ScalerMetadata: map[string]string{"pool": "m"}}
	if r, err := c.IsActive(ctx, ref); err != nil || r.GetResult() {
		t.Fatalf("IsActive of an idle pool: %v, %v", r, err)
	}
	m, err := c.GetMetrics(ctx, &externalscaler.GetMetricsRequest{ScaledObjectRef: ref, MetricName: "desired-replicas-m"})
	if err != nil || len(m.GetMetricValues()) != 1 || m.GetMetricValues()[0].GetMetricValueFloat() != 0 {
		t.Fatalf("GetMetrics: %v, %v", m, err)
	}
	bad := &externalscaler.ScaledObjectRef{ScalerMetadata: map[string]string{"metric": "gpus", "pool": "m"}}
	if _, err := c.GetMetricSpec(ctx, bad); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("bad metadata: %v, want InvalidArgument", err)
	}
	// A stream's gRPC metadata is bounded (gateway.MaxGRPCHeaderBytes): a
	// StreamIsActive keeps it until its client leaves (the attack: 200
	// streams with 3 MiB each held 730 MB of RSS).
	big := metadata.AppendToOutgoingContext(ctx, "x-pad", strings.Repeat("a", 1<<20))
	st, err := c.StreamIsActive(big, ref)
	if err == nil {
		_, err = st.Recv()
	}
	if err == nil {
		t.Fatal("a StreamIsActive with 1 MiB of metadata was served")
	}
	small := metadata.AppendToOutgoingContext(ctx, "x-pad", strings.Repeat("a", 1<<10))
	if st, err = c.StreamIsActive(small, ref); err == nil {
		_, err = st.Recv()
	}
	if err != nil {
		t.Fatalf("a StreamIsActive with 1 KiB of metadata: %v", err)
	}
}
