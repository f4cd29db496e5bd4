package epp

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/infergate/infergate/gateway"
)

// Health service names (GIE's EPP: liveness and readiness probes name
// them; the ext_proc service's own name reports readiness too).
const (
	LivenessService  = "liveness"
	ReadinessService = "readiness"
)

// Health is the standard gRPC health service (grpc.health.v1.Health) for
// the picker: "" and "liveness" are SERVING while the process runs;
// "readiness" and ServiceName are SERVING while at least one endpoint is in
// rotation and the gateway is not shutting down, NOT_SERVING otherwise.
type Health struct {
	srv *health.Server
	g   *gateway.Gateway
}

// NewHealth returns the health service of g's picker, readiness as g has
// it now.
func NewHealth(g *gateway.Gateway) *Health {
	h := &Health{srv: health.NewServer(), g: g}
	h.srv.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	h.srv.SetServingStatus(LivenessService, healthpb.HealthCheckResponse_SERVING)
	h.update()
	return h
}

// Register registers the service on gs.
func (h *Health) Register(gs *grpc.Server) { healthpb.RegisterHealthServer(gs, boundedHealth{h.srv}) }

// maxServiceName bounds a health request's service name (bytes): the names
// served are short, and grpc's health server keeps a watcher's name for as
// long as its stream lives (100 Watch streams naming 3 MB services kept
// 301 MB of live heap).
const maxServiceName = 256

// boundedHealth is grpc's health server refusing service names over
// maxServiceName with InvalidArgument.
type boundedHealth struct{ *health.Server }

func (b boundedHealth) Check(ctx context.Context, in *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	if err := checkServiceName(in); err != nil {
		return nil, err
	}
	return b.Server.Check(ctx, in)
}

func (b boundedHealth) Watch(in *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	if err := checkServiceName(in); err != nil {
		return err
	}
	return b.Server.Watch(in, stream)
}

func checkServiceName(in *healthpb.HealthCheckRequest) error {
	if n := len(in.GetService()); n > maxServiceName {
		return status.Errorf(codes.InvalidArgument, "health: service name of %d bytes, over %d", n, maxServiceName)
	}
	return nil
}

// Ready reports the readiness the service reports.
func (h *Health) Ready() bool {
	ready, _, draining := h.g.ReadyEndpoints()
	return ready > 0 && !draining
}

func (h *Health) update() {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if h.Ready() {
		st = healthpb.HealthCheckResponse_SERVING
	}
	h.srv.SetServingStatus(ReadinessService, st)
	h.srv.SetServingStatus(ServiceName, st)
}

// Run updates readiness every interval until ctx ends, then reports every
// service NOT_SERVING (the process is stopping; watchers are told).
func (h *Health) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			h.srv.Shutdown()
			return
		case <-t.C:
			h.update()
		}
	}
}
