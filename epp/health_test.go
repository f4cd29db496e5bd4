package epp

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

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

// TestHealthWatchesBounded: Watch streams beyond the process-wide slots are
// refused ResourceExhausted, and a slot is given back when its client
// leaves (the attack: 200 Watch streams, nothing else, were all served and
// held; with 3 MiB of metadata each they held 730 MB of RSS on infergate
// epp's health port, which had grpc's defaults: unbounded streams, 16 MiB
// of metadata per stream).
func TestHealthWatchesBounded(t *testing.T) {
	urls := startEngines(t, 1)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	h := NewHealth(tp.g)
	h.watches = make(chan struct{}, 3)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	h.Register(gs)
	go func() { _ = gs.Serve(ln) }()
	defer gs.Stop()
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	watch := func(ctx context.Context) error {
		w, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{Service: LivenessService})
		if err == nil {
			_, err = w.Recv()
		}
		return err
	}
	var cancels []context.CancelFunc
	for i := range 3 {
		wctx, wcancel := context.WithCancel(ctx)
		cancels = append(cancels, wcancel)
		if err := watch(wctx); err != nil {
			t.Fatalf("watch %d: %v", i, err)
		}
	}
	if err := watch(ctx); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a 4th Watch with 3 slots: %v, want ResourceExhausted", err)
	}
	cancels[0]()
	// The slot comes back once the server sees the stream end: retry
	// until it does, within the test's minute.
	for {
		err := watch(ctx)
		if err == nil {
			break
		}
		if status.Code(err) != codes.ResourceExhausted || ctx.Err() != nil {
			t.Fatalf("a Watch after one left: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, c := range cancels {
		c()
	}
}
