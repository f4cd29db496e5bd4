package epp

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/infergate/infergate/sched"
)

// TestHealthLongServiceName: a health request naming a service longer
// than any the picker serves is refused InvalidArgument, Check and Watch:
// grpc's health server keeps a watcher's name for as long as its stream
// lives (the attack: 100 Watch streams naming 3 MB services kept 301 MB of
// live heap on the health port until the client left). Known names still
// answer, and an unknown short one is SERVICE_UNKNOWN as the protocol says.
func TestHealthLongServiceName(t *testing.T) {
	urls := startEngines(t, 1)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	conn, err := grpc.NewClient(tp.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	long := strings.Repeat("x", 1<<20)
	if _, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: long}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Check of a 1 MB name: %v, want InvalidArgument", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{Service: long})
	if err == nil {
		_, err = w.Recv()
	}
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Watch of a 1 MB name: %v, want InvalidArgument", err)
	}
	for svc, want := range map[string]healthpb.HealthCheckResponse_ServingStatus{
		ReadinessService: healthpb.HealthCheckResponse_SERVING,
		"nope":           healthpb.HealthCheckResponse_SERVICE_UNKNOWN,
	} {
		w, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{Service: svc})
		if err != nil {
			t.Fatal(err)
		}
		r, err := w.Recv()
		if err != nil || r.GetStatus() != want {
			t.Fatalf("Watch %q: %v %v, want %v", svc, r, err, want)
		}
	}
	if r, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: LivenessService}); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check liveness: %v %v", r, err)
	}
}
