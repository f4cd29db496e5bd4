package gateway

import (
	"context"
	"math"
	"strconv"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/infergate/infergate/autoscale/externalscaler"
)

// KEDA external scaler (KEDA's pkg/scalers/externalscaler/externalscaler.proto,
// v2.x; its ScaledObject's trigger is `type: external` with
// `metadata: {scalerAddress: <keda_listen>, pool: <model>}`). The metric a
// ScaledObject reads is one of:
//
//	desired_replicas  (default) the pool's policy decision, target 1: KEDA's
//	                  HPA (AverageValue) then runs exactly the desired count
//	queue_length      requests queued at the gateway for the pool, target
//	                  metadata "target" (default 1 per replica)
//	in_flight         requests in flight at the pool's ready engines, target
//	                  "target" (default the policy's target in flight)
//
// Metadata keys: pool (required: a model with an autoscale policy), metric,
// target (a positive number). Anything else is InvalidArgument; a pool the
// gateway does not scale is NotFound.
const (
	kedaPoolKey   = "pool"
	kedaMetricKey = "metric"
	kedaTargetKey = "target"

	kedaMetricDesired  = "desired_replicas"
	kedaMetricQueue    = "queue_length"
	kedaMetricInFlight = "in_flight"
	// kedaMaxMetadata bounds the metadata a request may carry (entries,
	// bytes of one key or value).
	kedaMaxMetadata = 16
	kedaMaxValue    = 256
	// kedaMaxStreams bounds the StreamIsActive streams open at once,
	// gateway-wide (KEDA keeps one per ScaledObject): each holds a
	// goroutine until its client leaves, and grpc's MaxConcurrentStreams
	// bounds them per connection only. Beyond it: ResourceExhausted.
	kedaMaxStreams = 1024
)

// MaxGRPCHeaderBytes bounds the metadata (HTTP/2 header list, bytes) a client
// may send on one stream of the gateway's gRPC servers: KEDA's scaler port
// and epp's ext_proc and health ports (grpc.MaxHeaderListSize; grpc-go's
// default is 16 MiB, internal/transport/defaults.go v1.83). A stream keeps
// its metadata for as long as it lives, and a StreamIsActive or health Watch
// lives until its client leaves: 200 streams sending 3 MiB of metadata each
// held 730 MB of RSS on either port. KEDA, Envoy and kubelet send well under
// a kilobyte; over the bound a stream is refused before its handler runs.
const MaxGRPCHeaderBytes = 64 << 10

// kedaScaler serves externalscaler.ExternalScalerServer from the gateway's
// autoscaling decisions.
type kedaScaler struct {
	externalscaler.UnimplementedExternalScalerServer
	g       *Gateway
	streams chan struct{} // a slot per open StreamIsActive (kedaMaxStreams)
}

// RegisterExternalScaler registers KEDA's external scaler service, answered
// from the pools' autoscaling decisions (autoscale.policy), on s.
func (g *Gateway) RegisterExternalScaler(s grpc.ServiceRegistrar) {
	g.registerExternalScaler(s, kedaMaxStreams)
}

func (g *Gateway) registerExternalScaler(s grpc.ServiceRegistrar, maxStreams int) {
	externalscaler.RegisterExternalScalerServer(s, &kedaScaler{g: g, streams: make(chan struct{}, maxStreams)})
}

// kedaRef is a validated ScaledObjectRef.
type kedaRef struct {
	pool, metric string
	target       float64 // 0: the metric's default
}

// parseRef validates ref's metadata (InvalidArgument) and finds its pool
// (NotFound).
func (k *kedaScaler) parseRef(ref *externalscaler.ScaledObjectRef) (kedaRef, PoolScale, error) {
	var r kedaRef
	if ref == nil {
		return r, PoolScale{}, status.Error(codes.InvalidArgument, "no scaled object reference")
	}
	md := ref.GetScalerMetadata()
	if len(md) > kedaMaxMetadata {
		return r, PoolScale{}, status.Errorf(codes.InvalidArgument, "%d metadata entries (at most %d)", len(md), kedaMaxMetadata)
	}
	for key, v := range md {
		if len(key) > kedaMaxValue || len(v) > kedaMaxValue {
			return r, PoolScale{}, status.Errorf(codes.InvalidArgument, "metadata entry over %d bytes", kedaMaxValue)
		}
		switch key {
		case kedaPoolKey:
			r.pool = v
		case kedaMetricKey:
			switch v {
			case kedaMetricDesired, kedaMetricQueue, kedaMetricInFlight:
				r.metric = v
			default:
				return r, PoolScale{}, status.Errorf(codes.InvalidArgument, "metadata metric %q: want %s, %s or %s",
					v, kedaMetricDesired, kedaMetricQueue, kedaMetricInFlight)
			}
		case kedaTargetKey:
			x, err := strconv.ParseFloat(v, 64)
			if err != nil || !(x > 0) || math.IsInf(x, 0) {
				return r, PoolScale{}, status.Errorf(codes.InvalidArgument, "metadata target %q: want a positive number", v)
			}
			r.target = x
		case "scalerAddress", "tlsCertFile", "caCert", "tlsClientCert", "tlsClientKey", "unsafeSsl", "enableTLS":
			// KEDA's own keys of the external trigger, passed on to the scaler.
		default:
			return r, PoolScale{}, status.Errorf(codes.InvalidArgument, "unknown metadata key %q (want %s, %s, %s)",
				key, kedaPoolKey, kedaMetricKey, kedaTargetKey)
		}
	}
	if r.pool == "" {
		return r, PoolScale{}, status.Errorf(codes.InvalidArgument, "metadata %q (the model whose pool to scale) is required", kedaPoolKey)
	}
	if r.metric == "" {
		r.metric = kedaMetricDesired
	}
	if r.metric == kedaMetricDesired && r.target != 0 && r.target != 1 {
		return r, PoolScale{}, status.Errorf(codes.InvalidArgument, "metadata target %g: %s has target 1", r.target, kedaMetricDesired)
	}
	v, ok := k.g.PoolScale(r.pool)
	if !ok {
		return r, PoolScale{}, status.Errorf(codes.NotFound, "pool %q has no autoscale policy (autoscale.policy, autoscale.pools)", r.pool)
	}
	return r, v, nil
}

// metricName is the metric's name as KEDA sees it: "<metric>-<pool>",
// the pool sanitised to [a-z0-9-] (KEDA prefixes its own "s<N>-").
func (r kedaRef) metricName() string {
	var b strings.Builder
	b.WriteString(strings.ReplaceAll(r.metric, "_", "-"))
	b.WriteByte('-')
	for _, c := range strings.ToLower(r.pool) {
		if (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') {
			b.WriteRune(c)
		} else {
			b.WriteByte('-')
		}
	}
	return b.String()
}

// targetOf is r's metric target per replica.
func (r kedaRef) targetOf(v PoolScale) float64 {
	switch {
	case r.metric == kedaMetricDesired:
		return 1
	case r.target > 0:
		return r.target
	case r.metric == kedaMetricInFlight && v.Policy.TargetInFlight > 0:
		return v.Policy.TargetInFlight
	}
	return 1
}

// valueOf is r's metric now.
func (r kedaRef) valueOf(v PoolScale) float64 {
	switch r.metric {
	case kedaMetricQueue:
		return float64(v.Signals.Queued)
	case kedaMetricInFlight:
		return float64(v.Signals.InFlight)
	}
	return float64(v.Desired)
}

// IsActive implements externalscaler.ExternalScalerServer: the pool has
// work or wants engines (PoolScale.IsActive); KEDA scales from and to
// zero on it.
func (k *kedaScaler) IsActive(_ context.Context, ref *externalscaler.ScaledObjectRef) (*externalscaler.IsActiveResponse, error) {
	_, v, err := k.parseRef(ref)
	if err != nil {
		return nil, err
	}
	return &externalscaler.IsActiveResponse{Result: v.IsActive()}, nil
}

// StreamIsActive implements externalscaler.ExternalScalerServer: the
// activity now, then after every round of decisions in which it changed,
// until the client or the gateway goes away.
func (k *kedaScaler) StreamIsActive(ref *externalscaler.ScaledObjectRef, stream grpc.ServerStreamingServer[externalscaler.IsActiveResponse]) error {
	r, v, err := k.parseRef(ref)
	if err != nil {
		return err
	}
	select {
	case k.streams <- struct{}{}:
		defer func() { <-k.streams }()
	default:
		return status.Errorf(codes.ResourceExhausted, "%d StreamIsActive streams open already", cap(k.streams))
	}
	last := v.IsActive()
	if err := stream.Send(&externalscaler.IsActiveResponse{Result: last}); err != nil {
		return err
	}
	for {
		changed := k.g.scaleChanged()
		select {
		case <-stream.Context().Done():
			return nil
		case <-k.g.loops.Done():
			return status.Error(codes.Unavailable, "gateway shutting down")
		case <-changed:
		}
		v, ok := k.g.PoolScale(r.pool)
		if !ok {
			return status.Errorf(codes.NotFound, "pool %q no longer has an autoscale policy", r.pool)
		}
		if a := v.IsActive(); a != last {
			last = a
			if err := stream.Send(&externalscaler.IsActiveResponse{Result: a}); err != nil {
				return err
			}
		}
	}
}

// GetMetricSpec implements externalscaler.ExternalScalerServer.
func (k *kedaScaler) GetMetricSpec(_ context.Context, ref *externalscaler.ScaledObjectRef) (*externalscaler.GetMetricSpecResponse, error) {
	r, v, err := k.parseRef(ref)
	if err != nil {
		return nil, err
	}
	t := r.targetOf(v)
	return &externalscaler.GetMetricSpecResponse{MetricSpecs: []*externalscaler.MetricSpec{{
		MetricName: r.metricName(), TargetSize: int64(math.Ceil(t)), TargetSizeFloat: t,
	}}}, nil
}

// GetMetrics implements externalscaler.ExternalScalerServer. The metric
// name KEDA asks for must be the spec's (KEDA may prefix it "s<N>-").
func (k *kedaScaler) GetMetrics(_ context.Context, req *externalscaler.GetMetricsRequest) (*externalscaler.GetMetricsResponse, error) {
	if req == nil {
		return nil, status.Error(codes.InvalidArgument, "empty request")
	}
	r, v, err := k.parseRef(req.GetScaledObjectRef())
	if err != nil {
		return nil, err
	}
	name := r.metricName()
	if got := req.GetMetricName(); got != "" && got != name && !strings.HasSuffix(got, "-"+name) {
		return nil, status.Errorf(codes.InvalidArgument, "metric %q: this reference's metric is %q", got, name)
	}
	x := r.valueOf(v)
	return &externalscaler.GetMetricsResponse{MetricValues: []*externalscaler.MetricValue{{
		MetricName: name, MetricValue: int64(math.Ceil(x)), MetricValueFloat: x,
	}}}, nil
}
