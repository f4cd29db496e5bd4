package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/infergate/infergate/autoscale/externalscaler"
	"github.com/infergate/infergate/sched"
)

// startExternalScaler serves g's KEDA external scaler on a loopback port
// and returns a real gRPC client of it.
func startExternalScaler(t *testing.T, g *Gateway) externalscaler.ExternalScalerClient {
	t.Helper()
	return startExternalScalerMax(t, g, kedaMaxStreams)
}

// startExternalScalerMax is startExternalScaler with maxStreams
// StreamIsActive streams at most.
func startExternalScalerMax(t *testing.T, g *Gateway, maxStreams int) externalscaler.ExternalScalerClient {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	g.registerExternalScaler(s, maxStreams)
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Serve(ln) }()
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		s.Stop()
		<-done
	})
	return externalscaler.NewExternalScalerClient(conn)
}

// rpcCtx bounds one call (a generous bound, not a timing claim).
func rpcCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func ref(md map[string]string) *externalscaler.ScaledObjectRef {
	return &externalscaler.ScaledObjectRef{Name: "llama", Namespace: "llm", ScalerMetadata: md}
}

// TestExternalScaler drives KEDA's external scaler service through a real
// gRPC client over loopback: IsActive, StreamIsActive, GetMetricSpec and
// GetMetrics follow the pool's decisions as a request comes and goes and an
// endpoint leaves rotation, the gauges an HPA reads say the same, and bad
// metadata is InvalidArgument (an unknown pool NotFound).
func TestExternalScaler(t *testing.T) {
	e0, e1 := newFakeEngine(t, "e0"), newFakeEngine(t, "e1")
	cfg := testConfig(sched.LeastRequest, e0, e1)
	// Decisions only when the test takes them (the loop's first tick is an
	// hour away); no stabilisation, so each follows its signals.
	cfg.Autoscale = AutoscaleConfig{Policy: "min=0,max=4,target=1,down_window=0s", Interval: time.Hour}
	g, url := startGateway(t, cfg)
	sc := startExternalScaler(t, g)
	md := map[string]string{"scalerAddress": "infergate:9100", "pool": "m"}

	// Idle: inactive, nothing wanted.
	if r, err := sc.IsActive(rpcCtx(t), ref(md)); err != nil || r.GetResult() {
		t.Fatalf("IsActive idle: %v, %v", r, err)
	}
	spec, err := sc.GetMetricSpec(rpcCtx(t), ref(md))
	if err != nil || len(spec.GetMetricSpecs()) != 1 {
		t.Fatalf("GetMetricSpec: %v, %v", spec, err)
	}
	ms := spec.GetMetricSpecs()[0]
	if ms.GetMetricName() != "desired-replicas-m" || ms.GetTargetSizeFloat() != 1 || ms.GetTargetSize() != 1 {
		t.Fatalf("metric spec %v", ms)
	}
	metrics := func() float64 {
		t.Helper()
		// KEDA asks with its "s0-" prefix.
		r, err := sc.GetMetrics(rpcCtx(t), &externalscaler.GetMetricsRequest{ScaledObjectRef: ref(md), MetricName: "s0-desired-replicas-m"})
		if err != nil || len(r.GetMetricValues()) != 1 {
			t.Fatalf("GetMetrics: %v, %v", r, err)
		}
		return r.GetMetricValues()[0].GetMetricValueFloat()
	}
	if v := metrics(); v != 0 {
		t.Fatalf("desired idle: %v", v)
	}
	sctx, scancel := context.WithTimeout(context.Background(), time.Minute)
	defer scancel()
	stream, err := sc.StreamIsActive(sctx, ref(md))
	if err != nil {
		t.Fatal(err)
	}
	if r, err := stream.Recv(); err != nil || r.GetResult() {
		t.Fatalf("StreamIsActive first: %v, %v", r, err)
	}

	// A request in flight (the engine hangs after its first event).
	e0.mode.Store(int32(modeHang))
	e1.mode.Store(int32(modeHang))
	rctx, rcancel := context.WithTimeout(context.Background(), time.Minute)
	defer rcancel()
	req, _ := http.NewRequestWithContext(rctx, http.MethodPost, url+pathCompletions,
		strings.NewReader(`{"model":"m","prompt":"hello","max_tokens":4,"stream":true}`))
	req.Header.Set("Content-Type", "application/json")
	respc := make(chan error, 1)
	go func() {
		resp, err := testClient(t).Do(req)
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		respc <- err
	}()
	waitFor(t, "the request in flight", func() bool {
		st := g.state.Load()
		return st.endpoints[0].ledger.InFlight()+st.endpoints[1].ledger.InFlight() == 1
	})
	waitFor(t, "the request's first token", func() bool {
		return scrape(t, testClient(t), url).value("infergate_time_to_first_token_seconds_count", `model="m"`) == 1
	})
	g.decideAll(time.Now())
	if r, err := stream.Recv(); err != nil || !r.GetResult() {
		t.Fatalf("StreamIsActive after a request: %v, %v", r, err)
	}
	if r, err := sc.IsActive(rpcCtx(t), ref(md)); err != nil || !r.GetResult() {
		t.Fatalf("IsActive busy: %v, %v", r, err)
	}
	if v := metrics(); v != 1 {
		t.Fatalf("desired with one request in flight at target 1: %v", v)
	}
	// Its first event was relayed: the pool's TTFT p90 over the interval
	// (from the TTFT histogram) is positive.
	if v, ok := g.PoolScale("m"); !ok || v.Signals.TTFT <= 0 {
		t.Fatalf("TTFT signal after a first token: %+v", v.Signals)
	}
	inflight := map[string]string{"pool": "m", "metric": "in_flight", "target": "2"}
	spec, err = sc.GetMetricSpec(rpcCtx(t), ref(inflight))
	if err != nil || spec.GetMetricSpecs()[0].GetTargetSizeFloat() != 2 || spec.GetMetricSpecs()[0].GetMetricName() != "in-flight-m" {
		t.Fatalf("in_flight spec: %v, %v", spec, err)
	}
	if r, err := sc.GetMetrics(rpcCtx(t), &externalscaler.GetMetricsRequest{ScaledObjectRef: ref(inflight), MetricName: "in-flight-m"}); err != nil ||
		r.GetMetricValues()[0].GetMetricValueFloat() != 1 {
		t.Fatalf("in_flight: %v, %v", r, err)
	}

	// The gauges an HPA reads.
	c := testClient(t)
	m := scrape(t, c, url)
	for name, want := range map[string]float64{
		"infergate_autoscale_desired_replicas":   1,
		"infergate_autoscale_in_flight_requests": 1,
		"infergate_autoscale_queue_length":       0,
		"infergate_autoscale_saturation":         0.5, // 1 in flight / (target 1 × 2 ready)
	} {
		if !m.has(name) {
			t.Errorf("%s missing", name)
		} else if v := m.value(name, `model="m"`); v != want {
			t.Errorf("%s = %v, want %v", name, v, want)
		}
	}
	if v := m.value("infergate_autoscale_engines", `state="ready"`); v != 2 {
		t.Errorf("ready engines %v", v)
	}
	if v := m.value("infergate_autoscale_recommended_replicas", `reason="load"`); v != 1 {
		t.Errorf("recommended (load) %v", v)
	}

	// An engine that fails its health checks is not ready: starting, as a
	// loading vLLM is.
	e1.down.Store(true)
	waitFor(t, "e1 out of rotation", func() bool { return !g.state.Load().endpoints[1].ready.Load() })
	g.decideAll(time.Now())
	if v, ok := g.PoolScale("m"); !ok || v.Signals.Ready != 1 || v.Signals.Starting != 1 {
		t.Fatalf("after e1 went down: %+v", v)
	}

	// The request ends: inactive once its arrival leaves the rate window.
	rcancel()
	if err := <-respc; err == nil {
		t.Log("request ended without an error")
	}
	waitFor(t, "nothing in flight", func() bool {
		st := g.state.Load()
		return st.endpoints[0].ledger.InFlight()+st.endpoints[1].ledger.InFlight() == 0
	})
	g.decideAll(time.Now().Add(2 * time.Minute)) // the arrival is now outside the 1-minute window
	if r, err := stream.Recv(); err != nil || r.GetResult() {
		t.Fatalf("StreamIsActive after the request: %v, %v", r, err)
	}

	// Bad metadata.
	for name, bad := range map[string]map[string]string{
		"no pool":        {"metric": "desired_replicas"},
		"unknown metric": {"pool": "m", "metric": "gpus"},
		"bad target":     {"pool": "m", "metric": "queue_length", "target": "-1"},
		"nan target":     {"pool": "m", "metric": "queue_length", "target": "NaN"},
		"desired target": {"pool": "m", "target": "3"},
		"unknown key":    {"pool": "m", "poool": "m"},
		"long value":     {"pool": strings.Repeat("m", 300)},
	} {
		_, err := sc.GetMetricSpec(rpcCtx(t), ref(bad))
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: GetMetricSpec error %v, want InvalidArgument", name, err)
		}
		_, err = sc.IsActive(rpcCtx(t), ref(bad))
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: IsActive error %v, want InvalidArgument", name, err)
		}
		s, err := sc.StreamIsActive(rpcCtx(t), ref(bad))
		if err == nil {
			_, err = s.Recv()
		}
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: StreamIsActive error %v, want InvalidArgument", name, err)
		}
	}
	if _, err := sc.GetMetrics(rpcCtx(t), &externalscaler.GetMetricsRequest{ScaledObjectRef: ref(md), MetricName: "queue-length-m"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("GetMetrics of another metric: %v, want InvalidArgument", err)
	}
	if _, err := sc.GetMetrics(rpcCtx(t), &externalscaler.GetMetricsRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("GetMetrics without a reference: %v, want InvalidArgument", err)
	}
	if _, err := sc.IsActive(rpcCtx(t), ref(map[string]string{"pool": "other"})); status.Code(err) != codes.NotFound {
		t.Errorf("unknown pool: %v, want NotFound", err)
	}

	// The stream ends with the client.
	scancel()
	if _, err := stream.Recv(); err == nil || (status.Code(err) != codes.Canceled && !errors.Is(err, context.Canceled)) {
		t.Errorf("stream after cancel: %v", err)
	}
}

func TestAutoscaleConfigValidate(t *testing.T) {
	e := newFakeEngine(t, "e0")
	for _, tc := range []struct {
		ac   AutoscaleConfig
		want string
	}{
		{AutoscaleConfig{Policy: "min=0"}, "max is required"},
		{AutoscaleConfig{Policy: "max=4,bogus=1"}, "unknown keys"},
		{AutoscaleConfig{Pools: map[string]string{"m": "max=2,min=3"}}, "autoscale.pools.m"},
		{AutoscaleConfig{KEDAListen: ":9100"}, "needs autoscale.policy"},
		{AutoscaleConfig{Policy: "max=2", KEDAListen: "nohost"}, "keda_listen"},
		{AutoscaleConfig{Policy: "max=2", Interval: -time.Second}, "interval"},
	} {
		cfg := testConfig(sched.LeastRequest, e)
		cfg.Autoscale = tc.ac
		_, err := New(context.Background(), cfg, nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error with %q", tc.ac, err, tc.want)
		}
	}
}

// TestQuantileOfIncrease: histogram_quantile over the increase of
// cumulative buckets (Prometheus' interpolation).
func TestQuantileOfIncrease(t *testing.T) {
	bounds := []float64{0.1, 0.5, 1}
	prev := []uint64{5, 5, 5}
	for _, tc := range []struct {
		cur   []uint64
		total uint64
		want  time.Duration
	}{
		// 10 new, all in (0.1, 0.5]: p90 is 0.1 + 0.4 × 9/10.
		{[]uint64{5, 15, 15}, 10, 460 * time.Millisecond},
		// 10 new, all ≤ 0.1: 0.1 × 9/10.
		{[]uint64{15, 15, 15}, 10, 90 * time.Millisecond},
		// Beyond the last finite bound: that bound.
		{[]uint64{5, 5, 6}, 10, time.Second},
	} {
		if got := quantileOfIncrease(0.9, bounds, tc.cur, prev, tc.total); (got - tc.want).Abs() > time.Microsecond {
			t.Errorf("cur %v: %v, want %v", tc.cur, got, tc.want)
		}
	}
}

// TestExternalScalerHeldRequests: requests held for a pool at zero (scale
// from zero: no endpoint ready) are in its admission queue, so they are
// the queue signal: the pool's decision wants an engine per held request at
// target 1 (not just the activation's one), KEDA's IsActive says true and
// GetMetrics gives that count through a real gRPC client, and the HPA's
// queue gauge counts them. Once the engine is ready and they are served,
// the queue signal is empty again.
func TestExternalScalerHeldRequests(t *testing.T) {
	e := newColdEngine(t)
	wk := &countingWaker{}
	cfg := coldConfig(e, ScaleFromZeroConfig{HoldTTL: time.Minute, Wake: WakeConfig{Waker: wk}})
	cfg.Autoscale = AutoscaleConfig{Policy: "min=0,max=4,target=1,down_window=0s", Interval: time.Hour}
	g, url := startGateway(t, cfg)
	sc := startExternalScaler(t, g)
	md := map[string]string{"pool": "m"}
	p := g.state.Load().pools["m"]

	g.decideAll(time.Now())
	if r, err := sc.IsActive(rpcCtx(t), ref(md)); err != nil || r.GetResult() {
		t.Fatalf("IsActive at zero, idle: %v, %v", r, err)
	}

	const n = 3
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := testClient(t)
	var chans []<-chan result
	for range n {
		chans = append(chans, sendAsync(ctx, c, url+pathChat, chatBody))
	}
	waitFor(t, "every request held", func() bool { return p.gate.heldNow.Load() == n })
	// No rate rule (rate= unset) and activation asks for one: n engines
	// at target 1 is the load rule reading the held requests as queued.
	g.decideAll(time.Now())
	v, ok := g.PoolScale("m")
	if !ok || v.Signals.Queued != n || v.Signals.Ready != 0 || v.Desired != n {
		t.Fatalf("decision with %d held at zero: %+v", n, v)
	}
	if r, err := sc.IsActive(rpcCtx(t), ref(md)); err != nil || !r.GetResult() {
		t.Fatalf("IsActive with held requests: %v, %v", r, err)
	}
	r, err := sc.GetMetrics(rpcCtx(t), &externalscaler.GetMetricsRequest{ScaledObjectRef: ref(md), MetricName: "s0-desired-replicas-m"})
	if err != nil || len(r.GetMetricValues()) != 1 || r.GetMetricValues()[0].GetMetricValueFloat() != n {
		t.Fatalf("GetMetrics with %d held: %v, %v", n, r, err)
	}
	if got := scrape(t, c, url).value("infergate_autoscale_queue_length", `model="m"`); got != n {
		t.Errorf("infergate_autoscale_queue_length = %v, want %d", got, n)
	}

	e.ready.Store(true)
	for _, ch := range chans {
		if r := await(t, ch); r.status != http.StatusOK {
			t.Errorf("held request: %d %s", r.status, r.body)
		}
	}
	g.decideAll(time.Now().Add(4 * time.Minute))
	if v, ok := g.PoolScale("m"); !ok || v.Signals.Queued != 0 || v.Signals.Ready != 1 {
		t.Fatalf("after the held requests were served: %+v", v)
	}
}

// fakeTarget is a ScaleTarget that records its orders.
type fakeTarget struct {
	starting atomic.Int64
	mu       sync.Mutex
	orders   []string
}

func (f *fakeTarget) StartingEngines(string) int { return int(f.starting.Load()) }
func (f *fakeTarget) ScaleTo(pool string, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.orders = append(f.orders, fmt.Sprintf("%s=%d", pool, n))
}

// TestAutoscaleTarget: with an in-process ScaleTarget (up's elastic fleet)
// every decision is sent to it, and only the engines it says are starting
// count as starting; the pool's other not-ready endpoints are stopped
// slots, not capacity on its way.
func TestAutoscaleTarget(t *testing.T) {
	e := newColdEngine(t)
	wk := &countingWaker{}
	ft := &fakeTarget{}
	cfg := coldConfig(e, ScaleFromZeroConfig{HoldTTL: time.Minute, Wake: WakeConfig{Waker: wk}})
	cfg.Autoscale = AutoscaleConfig{Policy: "min=0,max=4,target=1,down_window=0s", Interval: time.Hour, RateWindow: time.Second, Target: ft}
	g, url := startGateway(t, cfg)
	p := g.state.Load().pools["m"]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ch := sendAsync(ctx, testClient(t), url+pathChat, chatBody)
	waitFor(t, "the request held", func() bool { return p.gate.heldNow.Load() == 1 })

	g.decideAll(time.Now())
	if v, _ := g.PoolScale("m"); v.Signals.Starting != 0 || v.Signals.Queued != 1 || v.Desired != 1 {
		t.Fatalf("stopped slot counted as starting: %+v", v)
	}
	ft.starting.Store(1)
	g.decideAll(time.Now())
	if v, _ := g.PoolScale("m"); v.Signals.Starting != 1 {
		t.Fatalf("the target's starting engine not counted: %+v", v.Signals)
	}
	e.ready.Store(true)
	if r := await(t, ch); r.status != http.StatusOK {
		t.Fatalf("held request: %d %s", r.status, r.body)
	}
	ft.starting.Store(0)
	g.decideAll(time.Now().Add(time.Minute)) // past the 1 s rate window: idle
	ft.mu.Lock()
	got := strings.Join(ft.orders, " ")
	ft.mu.Unlock()
	// The startup decision (nothing held: 0), two with the request held,
	// one idle.
	if got != "m=0 m=1 m=1 m=0" {
		t.Fatalf("orders %q, want %q", got, "m=0 m=1 m=1 m=0")
	}
}

// TestExternalScalerStreamsBounded: StreamIsActive streams are bounded
// gateway-wide (kedaMaxStreams; grpc's MaxConcurrentStreams bounds them per
// connection only, so a client with many connections held a goroutine per
// stream without limit: 2,000 streams that never read, +2,000 goroutines).
// Past the bound a stream gets ResourceExhausted; a stream that ends gives
// its slot back.
func TestExternalScalerStreamsBounded(t *testing.T) {
	e0 := newFakeEngine(t, "e0")
	cfg := testConfig(sched.LeastRequest, e0)
	cfg.Autoscale = AutoscaleConfig{Policy: "min=0,max=4,target=1", Interval: time.Hour}
	g, _ := startGateway(t, cfg)
	const max = 4
	sc := startExternalScalerMax(t, g, max)
	md := map[string]string{"pool": "m"}
	cancels := make([]context.CancelFunc, 0, max)
	for i := range max {
		ctx, cancel := context.WithCancel(rpcCtx(t))
		cancels = append(cancels, cancel)
		st, err := sc.StreamIsActive(ctx, ref(md))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
	}
	st, err := sc.StreamIsActive(rpcCtx(t), ref(md))
	if err == nil {
		_, err = st.Recv()
	}
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("stream %d: %v, want ResourceExhausted", max+1, err)
	}
	cancels[0]()
	waitFor(t, "a slot given back", func() bool {
		st, err := sc.StreamIsActive(rpcCtx(t), ref(md))
		if err == nil {
			_, err = st.Recv()
		}
		return err == nil
	})
	for _, c := range cancels[1:] {
		c()
	}
}
