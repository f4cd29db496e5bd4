package sched

import "testing"

func pdEndpoints(roles ...Role) []Endpoint {
	eps := make([]Endpoint, len(roles))
	for i, r := range roles {
		eps[i] = Endpoint{Name: string(rune('a' + i)), Ready: true, Role: r}
	}
	return eps
}

func TestPDPicksByRoleAndSplitsLongPrompts(t *testing.T) {
	cfg := Config{Policy: LeastRequest, PD: PDConfig{Threshold: 1000}}
	pd, err := NewPD(cfg, Pool{Capacity: []int{100, 100, 100, 100}})
	if err != nil {
		t.Fatal(err)
	}
	eps := pdEndpoints(RolePrefill, RoleDecode, RolePrefill, RoleDecode)
	eps[1].InFlight = 5 // D 3 is the less loaded decode endpoint
	eps[0].InFlight = 2 // P 2 the less loaded prefill endpoint
	long := &Request{PromptTokens: 4000}
	d := pd.Pick(long, eps)
	if !d.Split || d.Decode.Endpoint != 3 || d.Prefill.Endpoint != 2 || d.Reason != "" {
		t.Fatalf("long prompt: %+v, want split P 2 → D 3", d)
	}
	if long.Role != RoleBoth {
		t.Fatalf("Pick left req.Role %v", long.Role)
	}
	short := &Request{PromptTokens: 999}
	d = pd.Pick(short, eps)
	if d.Split || d.Decode.Endpoint != 3 || d.Prefill.Endpoint != -1 || d.Reason != PDReasonShort {
		t.Fatalf("short prompt: %+v, want D 3 whole", d)
	}
	// No prefill endpoint ready: served whole on D.
	eps[0].Ready, eps[2].Ready = false, false
	if d = pd.Pick(long, eps); d.Split || d.Decode.Endpoint != 3 || d.Reason != PDReasonNoPrefill {
		t.Fatalf("no P: %+v", d)
	}
	// No decode endpoint ready: nothing (a prefill endpoint does not decode).
	eps[0].Ready, eps[1].Ready, eps[3].Ready = true, false, false
	if d = pd.Pick(long, eps); d.Decode.Endpoint != -1 || d.Reason != PDReasonNoDecode {
		t.Fatalf("no D: %+v", d)
	}
}

func TestPDBothRoleEndpointsServeEitherLeg(t *testing.T) {
	pd, err := NewPD(Config{Policy: RoundRobin, PD: PDConfig{Threshold: -1}}, Pool{Capacity: []int{1, 1}})
	if err != nil {
		t.Fatal(err)
	}
	eps := pdEndpoints(RoleBoth, RoleBoth)
	d := pd.Pick(&Request{PromptTokens: 1}, eps)
	if !d.Split || d.Decode.Endpoint < 0 || d.Prefill.Endpoint < 0 {
		t.Fatalf("always-split on both-role endpoints: %+v", d)
	}
	// A plain policy (no P/D) ignores roles.
	p, _ := NewPolicy(Config{Policy: RoundRobin}, Pool{Capacity: []int{1, 1}})
	if got := p.Pick(&Request{}, pdEndpoints(RolePrefill, RolePrefill)); got.Endpoint < 0 {
		t.Fatal("a request without a role found no endpoint")
	}
}

func TestPDThresholdCountsDecodeMatch(t *testing.T) {
	// D's expected match makes the uncached part short: not split.
	cfg := Config{Policy: Prefix, PD: PDConfig{Threshold: 64}, Prefix: PrefixConfig{BlockSize: 16}}
	pd, err := NewPD(cfg, Pool{Capacity: []int{100, 100}})
	if err != nil {
		t.Fatal(err)
	}
	hashes := make([]uint64, 10)
	for i := range hashes {
		hashes[i] = uint64(i + 1)
	}
	req := &Request{PromptTokens: 170, Hashes: hashes}
	if !pd.Wants(req, Decision{MatchedBlocks: 6}) { // 170 − 96 = 74 ≥ 64
		t.Fatal("74 uncached tokens not split at threshold 64")
	}
	if pd.Wants(req, Decision{MatchedBlocks: 7}) { // 58 < 64
		t.Fatal("58 uncached tokens split at threshold 64")
	}
}

func TestPDPrefillBusy(t *testing.T) {
	pd, err := NewPD(Config{Policy: LeastRequest, PD: PDConfig{Threshold: 1, MaxPrefillQueue: 2}}, Pool{Capacity: []int{1, 1}})
	if err != nil {
		t.Fatal(err)
	}
	eps := pdEndpoints(RolePrefill, RoleDecode)
	eps[0].PrefillTokensPerSecond, eps[0].PendingPrefillTokens = 1000, 2500
	if d := pd.Pick(&Request{PromptTokens: 10}, eps); d.Split || d.Reason != PDReasonPrefillBusy || d.Decode.Endpoint != 1 {
		t.Fatalf("busy P: %+v", d)
	}
	eps[0].PendingPrefillTokens = 1500
	if d := pd.Pick(&Request{PromptTokens: 10}, eps); !d.Split {
		t.Fatalf("P within bound: %+v", d)
	}
	if _, err := NewPD(Config{PD: PDConfig{MaxPrefillQueue: -1}}, Pool{Capacity: []int{1}}); err == nil {
		t.Fatal("negative max_prefill_queue_seconds accepted")
	}
}

func TestParseRole(t *testing.T) {
	for s, want := range map[string]Role{"": RoleBoth, "both": RoleBoth, "Prefill": RolePrefill, "decode": RoleDecode} {
		if r, err := ParseRole(s); err != nil || r != want {
			t.Errorf("ParseRole(%q) = %v, %v", s, r, err)
		}
	}
	if _, err := ParseRole("encode"); err == nil {
		t.Error("ParseRole(encode) accepted")
	}
}

func TestPDLocalAny(t *testing.T) {
	pd, err := NewPD(Config{Policy: LeastRequest, PD: PDConfig{Threshold: 1000, Local: PDLocalAny}}, Pool{Capacity: []int{1, 1, 1}})
	if err != nil {
		t.Fatal(err)
	}
	eps := pdEndpoints(RolePrefill, RoleDecode, RoleDecode)
	eps[1].InFlight, eps[2].InFlight = 3, 4
	// Short: whole on the least loaded endpoint, a prefill one.
	if d := pd.Pick(&Request{PromptTokens: 10}, eps); d.Split || d.Decode.Endpoint != 0 {
		t.Fatalf("short: %+v, want whole on endpoint 0", d)
	}
	// ... unless it has a long prefill queued: then a decode endpoint.
	eps[0].PendingPrefillTokens = 5000
	if d := pd.Pick(&Request{PromptTokens: 10}, eps); d.Split || d.Decode.Endpoint != 1 {
		t.Fatalf("short, busy prefill endpoint: %+v, want whole on endpoint 1", d)
	}
	// Long, first pick a prefill endpoint: it is P, D is picked among the decode ones.
	eps[0].PendingPrefillTokens = 0
	if d := pd.Pick(&Request{PromptTokens: 5000}, eps); !d.Split || d.Prefill.Endpoint != 0 || d.Decode.Endpoint != 1 {
		t.Fatalf("long: %+v, want P 0 → D 1", d)
	}
	if err := (PDConfig{Local: "nowhere"}).Validate(); err == nil {
		t.Fatal("local nowhere accepted")
	}
}

// prefill_busy: cost keeps a request on D when the wait for P's backlog
// alone is longer than D's own backlog plus the request's uncached tokens;
// an idle P always takes it.
func TestPDPrefillBusyCost(t *testing.T) {
	pd, err := NewPD(Config{Policy: LeastRequest, PD: PDConfig{Threshold: 1, PrefillBusy: PDBusyCost}}, Pool{Capacity: []int{1, 1}})
	if err != nil {
		t.Fatal(err)
	}
	eps := pdEndpoints(RolePrefill, RoleDecode)
	eps[0].PrefillTokensPerSecond, eps[1].PrefillTokensPerSecond = 1000, 1000
	req := &Request{PromptTokens: 3000}
	if d := pd.Pick(req, eps); !d.Split {
		t.Fatalf("idle P: %+v, want split", d)
	}
	// P waits 3.5 s, D would take 1 s of backlog + 3 s: split.
	eps[0].PendingPrefillTokens, eps[1].PendingPrefillTokens = 3500, 1000
	if d := pd.Pick(req, eps); !d.Split {
		t.Fatalf("P 3.5 s, D 4 s: %+v, want split", d)
	}
	// P waits 4.5 s: D is sooner.
	eps[0].PendingPrefillTokens = 4500
	if d := pd.Pick(req, eps); d.Split || d.Reason != PDReasonPrefillBusy || d.Decode.Endpoint != 1 {
		t.Fatalf("P 4.5 s, D 4 s: %+v, want whole on D, prefill-busy", d)
	}
	// Rates are each endpoint's own: a D twice as fast takes 2 s.
	eps[0].PendingPrefillTokens, eps[1].PrefillTokensPerSecond = 2500, 2000
	if d := pd.Pick(req, eps); d.Split {
		t.Fatalf("P 2.5 s, D 2 s: %+v, want whole", d)
	}
	// The queue mode (default) ignores D's estimate.
	q, err := NewPD(Config{Policy: LeastRequest, PD: PDConfig{Threshold: 1}}, Pool{Capacity: []int{1, 1}})
	if err != nil {
		t.Fatal(err)
	}
	if q.Config().PrefillBusy != PDBusyQueue {
		t.Fatalf("default prefill_busy %q", q.Config().PrefillBusy)
	}
	if d := q.Pick(req, eps); !d.Split {
		t.Fatalf("queue mode without a bound: %+v, want split", d)
	}
	if _, err := NewPD(Config{PD: PDConfig{PrefillBusy: "soon"}}, Pool{Capacity: []int{1}}); err == nil {
		t.Fatal("prefill_busy \"soon\" accepted")
	}
}
