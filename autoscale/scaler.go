package autoscale

import "time"

// maxHistory bounds a Scaler's remembered recommendations and decisions
// (each 16 bytes): a decision every second keeps an hour.
const maxHistory = 4096

// sample is one remembered count at a time.
type sample struct {
	t    time.Duration
	n    int
	from int // decisions: the count the pool ran when it was made
}

// history is a bounded, time-ordered ring of samples.
type history struct {
	buf        []sample
	head, size int
}

func (h *history) push(s sample) {
	if h.buf == nil {
		h.buf = make([]sample, maxHistory)
	}
	if h.size == len(h.buf) {
		h.head = (h.head + 1) % len(h.buf)
		h.size--
	}
	h.buf[(h.head+h.size)%len(h.buf)] = s
	h.size++
}

func (h *history) at(i int) sample { return h.buf[(h.head+i)%len(h.buf)] }

// dropBefore forgets the samples older than t, keeping the newest one
// before it (the count in force at t).
func (h *history) dropBefore(t time.Duration) {
	for h.size > 1 && h.at(1).t <= t {
		h.head = (h.head + 1) % len(h.buf)
		h.size--
	}
}

// Decision is a Scaler's answer at one time.
type Decision struct {
	// Desired is the engine count the pool should run (Min..Max).
	Desired int
	// Recommended is the policy's unstabilised recommendation
	// (Config.Recommend) and Reason the rule that set it.
	Recommended int
	Reason      Reason
	// Current is what the pool ran (Ready + Starting).
	Current int
}

// Scaler turns a pool's signals into desired engine counts over time: the
// policy's recommendation (Config.Recommend), stabilised over the windows
// and rate-limited as a HorizontalPodAutoscaler with the same behavior
// would (Kubernetes pkg/controller/podautoscaler/horizontal.go,
// stabilizeRecommendationWithBehaviors and
// convertDesiredReplicasWithBehaviorRate). Its only state is the history of
// recommendations and decisions; time is given, and must not go backwards.
// A Scaler is not safe for concurrent use.
type Scaler struct {
	cfg       Config
	recs      history // recommendations, for the stabilisation windows
	decisions history // desired counts, for the rate limits
	last      Decision
	lastT     time.Duration
	started   bool
}

// New returns a Scaler of cfg (validated; zero fields defaulted).
func New(cfg Config) (*Scaler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Scaler{cfg: cfg.withDefaults()}, nil
}

// Config is the Scaler's configuration, defaults applied.
func (s *Scaler) Config() Config { return s.cfg }

// Last is the latest Decision (zero before the first).
func (s *Scaler) Last() Decision { return s.last }

// Decide is the desired engine count at t for sig. A t earlier than the
// previous call's is taken as that time.
func (s *Scaler) Decide(t time.Duration, sig Signals) Decision {
	if s.started && t < s.lastT {
		t = s.lastT
	}
	s.started, s.lastT = true, t
	c := &s.cfg
	rec, why := c.Recommend(sig)
	cur := max(sig.Ready, 0) + max(sig.Starting, 0)

	// Stabilisation: up to the lowest recommendation of the up window,
	// down to the highest of the down window (this one included).
	s.recs.dropBefore(t - max(c.UpWindow, c.DownWindow))
	s.recs.push(sample{t: t, n: rec})
	upRec, downRec := rec, rec
	for i := 0; i < s.recs.size; i++ {
		r := s.recs.at(i)
		if r.t > t-c.UpWindow || (c.UpWindow == 0 && r.t == t) {
			upRec = min(upRec, r.n)
		}
		if r.t > t-c.DownWindow || (c.DownWindow == 0 && r.t == t) {
			downRec = max(downRec, r.n)
		}
	}
	n := cur
	if n < upRec {
		n = upRec
	}
	if n > downRec {
		n = downRec
	}

	// Rate limits, against the count each period ago.
	if n > cur {
		base := s.countAt(t-c.UpPeriod, cur)
		limit := max(base+base*c.UpPercent/100, base+c.UpEngines)
		n = min(n, max(limit, cur))
	} else if n < cur {
		base := s.countAt(t-c.DownPeriod, cur)
		limit := base - base*c.DownPercent/100
		n = max(n, min(limit, cur))
	}
	n = min(max(n, c.Min), c.Max)

	s.decisions.dropBefore(t - max(c.UpPeriod, c.DownPeriod))
	s.decisions.push(sample{t, n, cur})
	s.last = Decision{Desired: n, Recommended: rec, Reason: why, Current: cur}
	return s.last
}

// countAt is the desired count in force at t (the latest decision at or
// before it), or def before the first.
func (s *Scaler) countAt(t time.Duration, def int) int {
	n, found := def, false
	for i := 0; i < s.decisions.size; i++ {
		d := s.decisions.at(i)
		if d.t > t {
			break
		}
		n, found = d.n, true
	}
	if !found && s.decisions.size > 0 {
		// Every decision is younger: the count the first started from.
		return s.decisions.at(0).from
	}
	return n
}

// RateWindow is a request arrival rate over a sliding window, from samples
// of a cumulative arrival count (single goroutine; bounded to maxHistory
// samples).
type RateWindow struct {
	window time.Duration
	h      history
}

// NewRateWindow returns a RateWindow over window (DefaultRateWindow when
// ≤ 0).
func NewRateWindow(window time.Duration) *RateWindow {
	if window <= 0 {
		window = DefaultRateWindow
	}
	return &RateWindow{window: window}
}

// Observe records that total requests had arrived by t, and returns the
// arrival rate over the window ending at t (requests/s; over the time
// observed when that is shorter).
func (w *RateWindow) Observe(t time.Duration, total uint64) float64 {
	w.h.dropBefore(t - w.window)
	w.h.push(sample{t: t, n: int(total)})
	first := w.h.at(0)
	span := t - first.t
	if t-w.window > first.t {
		span = w.window
	}
	if span <= 0 {
		return 0
	}
	return float64(int(total)-first.n) / span.Seconds()
}
