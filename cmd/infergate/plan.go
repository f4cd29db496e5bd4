package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/bench"
	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/plan"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
)

// planFlags are plan's flags (bind).
type planFlags struct {
	wl       workloadFlags
	warm     warmupFlags
	profFile string
	profile  string
	engines  string
	policies string
	sloText  string
	requests int
	model    string
	cfgPath  string
	outPath  string
	workers  int
	maxMemGB float64 // --max-memory-gib
	seed     int64
	htmlPath string
	tiers    tierFlags
	// P/D sweep (--pd, --pd-threshold, --pd-local).
	pd          string
	pdThreshold string
	pdLocal     string
	pdBusy      string
	pdBudget    string
	// budget is every engine's token budget per step (--max-num-batched-tokens).
	budget int
	// autoscale is --autoscale's policy ("" none).
	autoscale string
}

func newPlanCmd() *cobra.Command {
	var fl planFlags
	cmd := &cobra.Command{
		Use:   "plan",
		Short: "Size a fleet for a trace and an SLO by virtual-time simulation",
		Long: `Replay a Mooncake-format trace in virtual time (the same engine model and the
same routing policies as the gateway, no network, no sleeping) on every fleet
size of --engines with every policy of --policy, judge each run against --slo,
and recommend the smallest fleet that meets it, with the best policy at that
size (highest goodput, then lowest TTFT p90). Prints one table row per run and
the recommendation; exits non-zero when no fleet in the range meets the SLO.

--engines: comma-separated items, each N, a..b (a, 2a, 4a, ... up to b, plus b:
4..32 is 4,8,16,32) or a..b/s (a, a+s, ... up to b, plus b: 4..16/4 is
4,8,12,16).

--slo: comma-separated metric_pXX=duration targets, metric one of ttft, itl,
tpot, e2e (e.g. ttft_p90=2s,itl_p99=100ms; metric_max is p100), each checked
at fleet level: the run's XX-th percentile must not exceed the duration (ITL
pools every gap of every request). Optionally goodput>=X (a share, or 90%)
also requires that share of requests to meet every target on its own.
Goodput is reported in any case: the share of requests whose TTFT, TPOT and
E2E are within their targets and whose own ITL XX-th percentile is within the
ITL target; a failed request meets none. See plan/README.md.

Latencies are simulated engine time. The model ignores network and gateway
overhead, and engines never fail.`,
		Example: `  # 16 engines with cache-aware meet it; 25-40 s on 2 shared cores
  infergate plan --trace data/mooncake_conversation_trace.jsonl --requests 2000 \
    --engines 4..32 --policy precise-prefix,cache-aware,least-request --slo ttft_p90=5s,itl_p99=100ms --out plan.json
  # 4 engines miss, 8 meet it; 5-20 s (quote the SLO: > is a shell redirection)
  infergate plan --requests 2000 --engines 4..24/4 --policy cache-aware --slo 'ttft_p99=25s,goodput>=0.9'`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return fl.run(cmd) },
	}
	fl.bind(cmd.Flags())
	cmd.AddCommand(newPlanJudgeCmd())
	return cmd
}

// bind registers plan's flags on f.
func (fl *planFlags) bind(f *pflag.FlagSet) {
	fl.wl.register(f)
	fl.tiers.register(f)
	fl.warm.register(f)
	f.StringVar(&fl.profFile, "profile-file", "", "engine profile from a YAML file (overrides --profile)")
	f.StringVar(&fl.profile, "profile", sim.DefaultProfile().Name, "engine profile: "+strings.Join(profileNames(), ", "))
	f.StringVar(&fl.engines, "engines", "4..32", "fleet sizes to sweep: N, a..b (doubling, plus b), a..b/s (step s, plus b), comma-separated")
	f.StringVar(&fl.policies, "policy", sched.DefaultPolicy, "comma-separated routing policies to sweep ("+strings.Join(sched.Names(), ",")+")")
	f.StringVar(&fl.sloText, "slo", "", "objective: metric_pXX=duration,... (metrics ttft, itl, tpot, e2e) and optionally goodput>=X")
	f.IntVar(&fl.requests, "requests", 0, "replay only the first N requests (0 = all)")
	f.StringVar(&fl.model, "model", "", "model name routing hashes are seeded with (default: the profile's model)")
	f.StringVarP(&fl.cfgPath, "config", "c", "", "gateway YAML whose routing section tunes the policies")
	f.StringVarP(&fl.outPath, "out", "o", "", "write the sweep and the recommendation as JSON to this file")
	f.IntVar(&fl.workers, "workers", 0, "runs to simulate at once (0 = one per CPU)")
	f.Float64Var(&fl.maxMemGB, "max-memory-gib", 0, "refuse a sweep whose estimated peak memory (workers × (engines × KV block pool + prefix index)) is over this many GiB (0 = half the machine's memory)")
	f.StringVar(&fl.htmlPath, "html", "", "write a self-contained HTML report to this file: what produced it, the sweep table, and against fleet size each SLO target's value with its threshold line, goodput, and the hit rate with its references, the recommended point marked")
	f.Int64Var(&fl.seed, "seed", 0, "seed of the engines' outputs, the policies' tie-breaking and the workload generators (added to each generator's seed: 0 keeps their defaults; a fixed trace such as mooncake is unchanged)")
	f.StringVar(&fl.pd, "pd", "", "P/D splits to sweep at every fleet size: prefill-engine counts (0 = aggregated) and ranges, comma-separated, e.g. 0,2..6; 'all' = 0 to N-1")
	f.StringVar(&fl.pdThreshold, "pd-threshold", "", "with --pd: the decider's non-cached-token thresholds to sweep, comma-separated (0 = the default 2048, -1 = always split)")
	f.StringVar(&fl.pdLocal, "pd-local", "", "with --pd: where requests that are not split run, comma-separated: decode, any (default decode)")
	f.IntVar(&fl.budget, "max-num-batched-tokens", 0, "every engine's token budget per step, as vLLM's flag (0: 8192; with --pd the decode engines' is --pd-decode-budget when given)")
	f.StringVar(&fl.pdBusy, "pd-busy", "", "with --pd: how the decider judges a prefill engine busy, comma-separated: queue (routing.pd.max_prefill_queue_seconds), cost (its backlog's wait against the decode engine's own prefill; default queue)")
	f.StringVar(&fl.autoscale, "autoscale", "", "also run an autoscaled fleet per policy and compare its GPU-hours with the smallest static size meeting --slo: min=0,max=8 and optionally target= (requests in flight per engine, default 16), rate=, kv=, queue=, ttft=, down_window= (default 5m), up_window=, startup= (where a starting engine reads its weights: remote, nvme, page_cache (default) or peer) and image_cached= (default true), which the profile's start-up model turns into the cold start (sim/startup.go), or cold_start= (a fixed start-up time instead), or cache=cold|disk|warm (every start reads through its node's artifact cache, declared in that state at start; engines_per_node=, peers=true), interval= (decision period, default 15s), hold_ttl=, initial= (plan/README.md, \"Autoscaling\")")
	f.StringVar(&fl.pdBudget, "pd-decode-budget", "", "with --pd: the decode engines' token budgets per step to sweep, comma-separated (sim pd.decode_max_num_batched_tokens; 0 = the engines' --max-num-batched-tokens, 8192)")
}

// pdVariants parses --pd, --pd-threshold and --pd-local into the sweep's
// P/D variants for fleet sizes up to largest (nil without --pd).
func (fl *planFlags) pdVariants(largest int) ([]plan.PDVariant, error) {
	if fl.pd == "" {
		if fl.pdThreshold != "" || fl.pdLocal != "" || fl.pdBusy != "" || fl.pdBudget != "" {
			return nil, errors.New("--pd-threshold, --pd-local, --pd-busy and --pd-decode-budget need --pd")
		}
		return nil, nil
	}
	var prefill []int
	for _, item := range strings.Split(fl.pd, ",") {
		item = strings.TrimSpace(item)
		lo, hi, ok := strings.Cut(item, "..")
		if item == "all" {
			lo, hi, ok = "0", strconv.Itoa(largest-1), true
		}
		a, err := strconv.Atoi(lo)
		b := a
		if err == nil && ok {
			b, err = strconv.Atoi(hi)
		}
		if err != nil || a < 0 || b < a || b > 1<<10 {
			return nil, fmt.Errorf("--pd %q: want prefill-engine counts such as 0,2..6 or all", item)
		}
		for n := a; n <= b; n++ {
			if !slices.Contains(prefill, n) {
				prefill = append(prefill, n)
			}
		}
	}
	thresholds := []int{0}
	if fl.pdThreshold != "" {
		thresholds = thresholds[:0]
		for _, item := range strings.Split(fl.pdThreshold, ",") {
			t, err := strconv.Atoi(strings.TrimSpace(item))
			if err != nil {
				return nil, fmt.Errorf("--pd-threshold %q: want a number of tokens, 0 for the default (%d), or -1 to always split", item, sched.DefaultPDThreshold)
			}
			if err := checkPDThreshold(t); err != nil {
				return nil, err
			}
			thresholds = append(thresholds, t)
		}
	}
	locals, err := choiceList("--pd-local", fl.pdLocal, sched.PDLocalDecode, sched.PDLocalAny)
	if err != nil {
		return nil, err
	}
	busies, err := choiceList("--pd-busy", fl.pdBusy, sched.PDBusyQueue, sched.PDBusyCost)
	if err != nil {
		return nil, err
	}
	budgets := []int{0}
	if fl.pdBudget != "" {
		budgets = budgets[:0]
		for _, item := range strings.Split(fl.pdBudget, ",") {
			b, err := strconv.Atoi(strings.TrimSpace(item))
			if err != nil || b < 0 || b > 1<<20 {
				return nil, fmt.Errorf("--pd-decode-budget %q: want a number of tokens (0 = the engines' budget)", item)
			}
			budgets = append(budgets, b)
		}
	}
	var out []plan.PDVariant
	for _, p := range prefill {
		if p == 0 {
			out = append(out, plan.PDVariant{})
			continue
		}
		for _, t := range thresholds {
			for _, l := range locals {
				for _, b := range busies {
					for _, db := range budgets {
						out = append(out, plan.PDVariant{Prefill: p, Threshold: t, Local: l, Busy: b, DecodeBudget: db})
					}
				}
			}
		}
	}
	return out, nil
}

// choiceList parses flag's comma-separated value, each item one of
// allowed; an empty value is [""] (the configuration's default).
func choiceList(flag, value string, allowed ...string) ([]string, error) {
	if value == "" {
		return []string{""}, nil
	}
	var out []string
	for _, item := range strings.Split(value, ",") {
		v := strings.TrimSpace(item)
		if !slices.Contains(allowed, v) {
			return nil, fmt.Errorf("%s %q: want %s", flag, item, strings.Join(allowed, " or "))
		}
		out = append(out, v)
	}
	return out, nil
}

// run is plan's RunE: sweep the fleet sizes and policies (plan.Run), print
// the table and write --out and --html; the error of a sweep in which no
// fleet meets the SLO makes the command exit non-zero.
func (fl *planFlags) run(cmd *cobra.Command) error {
	started := time.Now()
	opts, err := fl.options()
	if err != nil {
		return err
	}
	prov := measure.NewProvenance(buildVersion(), os.Args, started)
	prov.Clock = "virtual"
	if err := describeBench(prov, &fl.wl, opts.Records, nil, fl.requests); err != nil {
		return err
	}
	if prov.Profile, err = bench.NewProfileInfo(opts.Engine, fl.profFile); err != nil {
		return err
	}
	stderr := cmd.ErrOrStderr()
	opts.Progress = func(r plan.Row) {
		verdict := "meets the SLO"
		if !r.MeetsSLO {
			verdict = "misses: " + strings.Join(r.Failed(opts.SLO.MinGoodput), ", ")
		}
		pol := r.Policy
		if l := r.PD.Label(); l != "" {
			pol += " " + l
		}
		fmt.Fprintf(stderr, "plan: %d engines, %s: %s wall, %s\n", r.Engines, pol,
			time.Duration(r.WallS*float64(time.Second)).Round(10*time.Millisecond), verdict)
	}
	res, err := plan.Run(cmd.Context(), opts)
	if err != nil {
		return err
	}
	prov.WallS = time.Since(started).Seconds()
	res.Provenance = prov
	if err := fl.write(cmd.OutOrStdout(), &res); err != nil {
		return err
	}
	return res.Err()
}

// options validates the flags, in the order their errors are reported, and
// returns the sweep they ask for (Progress not set), the workload loaded.
func (fl *planFlags) options() (plan.Options, error) {
	if fl.sloText == "" {
		return plan.Options{}, errors.New("--slo is required, e.g. --slo ttft_p90=2s,itl_p99=100ms")
	}
	slo, err := plan.ParseSLO(fl.sloText)
	if err != nil {
		return plan.Options{}, fmt.Errorf("--slo: %w", err)
	}
	sizes, err := plan.ParseEngines(fl.engines)
	if err != nil {
		return plan.Options{}, fmt.Errorf("--engines: %w", err)
	}
	if fl.requests < 0 {
		return plan.Options{}, fmt.Errorf("--requests %d: must not be negative", fl.requests)
	}
	if fl.budget < 0 || fl.budget > 1<<20 {
		return plan.Options{}, fmt.Errorf("--max-num-batched-tokens %d: want 1..%d tokens (0: the default)", fl.budget, 1<<20)
	}
	prof, err := resolveProfile(fl.profile, fl.profFile)
	if err != nil {
		return plan.Options{}, err
	}
	model := fl.model
	if model == "" {
		model = prof.Model
	}
	routing, err := loadRouting(fl.cfgPath)
	if err != nil {
		return plan.Options{}, err
	}
	pols, err := parsePolicies(fl.policies, routing)
	if err != nil {
		return plan.Options{}, fmt.Errorf("--policy: %w", err)
	}
	pds, err := fl.pdVariants(slices.Max(sizes))
	if err != nil {
		return plan.Options{}, err
	}
	for _, v := range pds {
		if v.Prefill >= slices.Max(sizes) {
			return plan.Options{}, fmt.Errorf("--pd %d: want fewer prefill engines than the largest fleet of --engines (%d), so that decode engines remain", v.Prefill, slices.Max(sizes))
		}
	}
	var as *plan.Autoscale
	if fl.autoscale != "" {
		if as, err = plan.ParseAutoscale(fl.autoscale); err != nil {
			return plan.Options{}, fmt.Errorf("--autoscale: %w", err)
		}
	}
	fl.wl.reseed(uint64(fl.seed))
	if !(fl.maxMemGB >= 0 && fl.maxMemGB <= 1<<20) { // NaN too
		return plan.Options{}, fmt.Errorf("--max-memory-gib %g: want 0 (half the machine's memory) to %d", fl.maxMemGB, 1<<20)
	}
	recs, err := fl.wl.load()
	if err != nil {
		return plan.Options{}, err
	}
	return plan.Options{PD: pds, Autoscale: as, MaxMemory: int64(fl.maxMemGB * (1 << 30)),
		Records: recs, Requests: fl.requests, Engines: sizes, Policies: pols,
		Engine: fl.tiers.engine(sim.Config{Profile: prof, MaxNumBatchedTokens: fl.budget}), Remote: fl.tiers.remote, Model: model, Routing: routing, Seed: fl.seed,
		SLO: slo, Workers: fl.workers, Warmup: fl.warm.w,
	}, nil
}

// write prints res's table and the sweep's wall time on out and writes
// --out (JSON) and --html.
func (fl *planFlags) write(out io.Writer, res *plan.Result) error {
	if err := res.WriteTable(out); err != nil {
		return err
	}
	fmt.Fprintf(out, "swept %d runs of %d requests in %s (wall clock, %d at once)\n",
		len(res.Rows), res.Requests, time.Duration(res.WallS*float64(time.Second)).Round(100*time.Millisecond), res.Workers)
	if fl.outPath != "" {
		if err := writeFile(fl.outPath, res.WriteJSON); err != nil {
			return err
		}
	}
	if fl.htmlPath != "" {
		if err := writeFile(fl.htmlPath, func(w io.Writer) error { return res.WriteHTML(w) }); err != nil {
			return err
		}
	}
	return nil
}
