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
	srv     *health.Server
	g       *gateway.Gateway
	watches chan struct{} // a slot per open Watch (maxWatches)
}

// maxWatches bounds the Watch streams open at once, process-wide: each
// holds a goroutine and a watcher in grpc's health server until its client
// leaves, and grpc's MaxConcurrentStreams bounds them per connection only
// (a probe or a proxy keeps one or two). Beyond it: ResourceExhausted.
const maxWatches = 1024

// NewHealth returns the health service of g's picker, readiness as g has
// it now.
func NewHealth(g *gateway.Gateway) *Health {
	h := &Health{srv: health.NewServer(), g: g, watches: make(chan struct{}, maxWatches)}
	h.srv.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	h.srv.SetServingStatus(LivenessService, healthpb.HealthCheckResponse_SERVING)
	h.update()
	return h
}

// Register registers the service on gs.
func (h *Health) Register(gs *grpc.Server) {
	healthpb.RegisterHealthServer(gs, boundedHealth{h.srv, h.watches})
}

// maxServiceName bounds a health request's service name (bytes): the names
// served are short, and grpc's health server keeps a watcher's name for as
// long as its stream lives (100 Watch streams naming 3 MB services kept
// 301 MB of live heap).
const maxServiceName = 256

// boundedHealth is grpc's health server refusing service names over
// maxServiceName with InvalidArgument, and Watch streams beyond the slots
// of watches with ResourceExhausted.
type boundedHealth struct {
	*health.Server
	watches chan struct{}
}

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
	select {
	case b.watches <- struct{}{}:
		defer func() { <-b.watches }()
	default:
		return status.Errorf(codes.ResourceExhausted, "health: %d Watch streams open already", cap(b.watches))
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
	return ready > 0 && !draining && h.g.ReadinessHold() == ""
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
