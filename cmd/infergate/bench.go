package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/infergate/infergate/bench"
	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/report"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
)

// rateSeed seeds the Poisson arrivals of a --rate sweep, so every rate and
// every run of the command re-times the workload the same way.
const rateSeed = 1

func newBenchCmd() *cobra.Command {
	var (
		target      string
		compare     string
		engines     int
		wl          workloadFlags
		requests    int
		speedup     float64
		timeScale   float64
		model       string
		profile     string
		profFile    string
		outPath     string
		recPath     string
		cfgPath     string
		virtual     bool
		htmlPath    string
		warm        warmupFlags
		rateList    string
		concurrency int
		maxLag      time.Duration
		prof        sim.Profile
		policies    []string
		routing     sched.Config
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Replay a real trace against an endpoint, or compare routing policies",
		Long: `Replay a Mooncake-format trace open-loop at its timestamps (divided by --speedup):
each request is a streaming /v1/completions call whose prompt is the trace's
token ids (equal hash ids give equal token blocks), with max_tokens set to the
trace's output length and ignore_eos. Per request it records TTFT, inter-token
latency, end-to-end latency, prompt and cached tokens.

--target URL replays against an OpenAI-compatible endpoint that accepts token-id
prompts and ignore_eos (vLLM, SGLang, infergate sim or a gateway in front of
them); the URL may end in /v1. --compare POLICIES
starts, for each policy, a fresh simulated fleet of --engines engines running
--speedup times faster than real time (so the engines see the trace's real
load) behind a fresh gateway, replays the same requests and prints one table.
Latencies are reported in engine time: wall-clock measurements multiplied by the
fleet's time scale.

--warmup N / --warmup-duration D send the first N requests (or those sent in the
first D of engine time) but leave them out of the summary, the HTML report and
goodput; --records keeps them, marked "warmup": true.

--rate 1,2,4,8 re-times the workload's arrivals as a Poisson process at each
rate (req/s; fixed seed, same requests in the same order) and runs once per
rate (per policy with --compare, also --virtual); the table gains a rate column.

--concurrency N replays closed loop, in real time only (--target, --compare;
not --virtual, whose fleet needs every arrival up front): N users each send the
next request as soon as their previous one finished, ignoring timestamps. With
--workload chat it is session-aware: a session's next turn is sent when the
previous answer has fully arrived plus the think time (both divided by
--speedup), with at most N sessions active at once (sessions start at their
start times, or later when N are active).

Real-time runs measure how far they fell behind their time scale and print
it beside every result (column "lag p99 ms", engine time): the simulated
fleet's step lag (--compare: how late each engine step's tokens were
delivered against the time scale's wall-clock deadline) and the client's
send lag (how late each request was sent against its schedule). A run whose
p99 lag exceeds --max-lag (default 100ms) is marked BEHIND and explained on
stderr: its latencies measure this host's CPU, not the modelled hardware.
bench then exits non-zero after writing every output; lower --speedup, free
the CPUs, use --virtual, or raise --max-lag to accept such runs. Virtual runs
have no lag.`,
		Example: `  # virtual time: 5-30 s on 2 shared cores
  infergate bench --compare round-robin,least-request,prefix --virtual --engines 8 \
    --trace data/mooncake_conversation_trace.jsonl --requests 2000 --out r.json
  # real time, light enough for a quiet 2-core host: about 8 s
  infergate bench --compare prefix,round-robin --engines 4 --workload shared-prefix \
    --sp-groups 8 --sp-prompts-per-group 16 --sp-rate 4 --sp-output-tokens 64
  # against a running endpoint (infergate up), at the trace's own pace
  infergate bench --target http://127.0.0.1:8080 --requests 200 --speedup 1`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if (target == "") == (compare == "") {
				return errors.New("give exactly one of --target URL or --compare POLICIES")
			}
			if err := warm.w.Validate(); err != nil {
				return err
			}
			if concurrency < 0 {
				return fmt.Errorf("--concurrency %d: must not be negative", concurrency)
			}
			rates, err := parseRates(rateList)
			if err != nil {
				return err
			}
			switch {
			case concurrency > 0 && virtual:
				return errors.New("--concurrency needs real time: the virtual fleet takes every arrival up front, so it cannot send a request when an earlier one finishes (drop --virtual)")
			case concurrency > 0 && rates != nil:
				return errors.New("--concurrency (closed loop) and --rate (open-loop arrivals) exclude each other")
			}
			var (
				recs     []trace.Record
				sessions []trace.Session
			)
			if concurrency > 0 && wl.kind == workloadChat {
				sessions, err = wl.sessions()
			} else {
				recs, err = wl.load()
			}
			if err != nil {
				return err
			}
			var recOut *os.File
			if recPath != "" {
				if recOut, err = os.Create(recPath); err != nil {
					return err
				}
				defer recOut.Close()
			}
			started := time.Now()
			prov := measure.NewProvenance(buildVersion(), os.Args, started)
			var refs *measure.References
			var result report.Report
			var htmlRuns []report.HTMLRun
			addHTML := func(r report.HTMLRun) {
				if htmlPath != "" {
					htmlRuns = append(htmlRuns, report.MeasuredRun(r))
				}
			}
			// runAt replays recs (re-timed to rate req/s when rate > 0).
			runAt := func(recs []trace.Record, rate float64) error {
				if target != "" {
					opts := bench.ReplayOptions{Target: target, Model: model, Records: recs, Requests: requests,
						Speedup: speedup, TimeScale: timeScale, Label: "target", Progress: os.Stderr,
						Warmup: warm.w, Concurrency: concurrency, Sessions: sessions}
					if recOut != nil {
						opts.Output = recOut
					}
					rs, err := bench.Replay(cmd.Context(), opts)
					if err != nil {
						return err
					}
					s := measure.Summarize(measure.RedactValue(target), rs)
					s.RateRPS = rate
					refs.Apply(&s, rs)
					s.CheckLag(maxLag)
					result.Runs = append(result.Runs, s)
					addHTML(report.HTMLRun{Summary: s, Records: rs})
					return nil
				}
				if virtual {
					for _, p := range policies {
						run, err := bench.ReplayVirtual(cmd.Context(), bench.VirtualOptions{Policy: p, Engines: engines, TrackPrecise: true,
							Engine: sim.Config{Profile: prof}, Records: recs, Requests: requests, Model: model, Routing: routing,
							Warmup: warm.w, RateRPS: rate})
						if err != nil {
							return err
						}
						if recOut != nil {
							if err := measure.WriteRecords(recOut, run.Records); err != nil {
								return err
							}
						}
						fmt.Fprintf(os.Stderr, "%s: %d requests in virtual time, %s wall\n", p, len(run.Records), run.Wall.Round(time.Millisecond))
						refs.Apply(&run.Summary, run.Records)
						result.Runs = append(result.Runs, run.Summary)
						addHTML(report.HTMLRun{Summary: run.Summary, Records: run.Records, Engine: run.Engine})
					}
					return nil
				}
				opts := bench.CompareOptions{Routing: routing, Policies: policies, Engines: engines, Engine: sim.Config{Profile: prof},
					Records: recs, Requests: requests, Speedup: speedup, Model: model, Progress: os.Stderr,
					Warmup: warm.w, Concurrency: concurrency, Sessions: sessions, RateRPS: rate, OnRun: addHTML, MaxLag: maxLag,
					References: refs}
				if recOut != nil {
					opts.Output = recOut
				}
				rep, err := bench.Compare(cmd.Context(), opts)
				result.Runs = append(result.Runs, rep.Runs...)
				return err
			}
			if target != "" {
				// The usual OpenAI base URL form (".../v1") is accepted as
				// well (bench.CompletionsURL).
				if model == "" {
					model = sim.DefaultModel
				}
			} else {
				if prof, err = resolveProfile(profile, profFile); err != nil {
					return err
				}
				if model == "" {
					model = prof.Model
				}
				if routing, err = loadRouting(cfgPath); err != nil {
					return err
				}
				if policies, err = parsePolicies(compare, routing); err != nil {
					return fmt.Errorf("--compare: %w", err)
				}
			}
			if err := describeBench(prov, &wl, recs, sessions, requests); err != nil {
				return err
			}
			replayed := recs
			if requests > 0 && requests < len(replayed) {
				replayed = replayed[:requests]
			}
			if target != "" {
				prov.Target, prov.TimeScale, prov.Speedup, prov.Clock = measure.RedactValue(target), timeScale, speedup, "real"
				if len(replayed) > 0 {
					refs = measure.NewReferences(replayed, 0, 0) // the target's KV capacity is unknown: infinite cache only
				}
			} else {
				n := engines
				if n <= 0 {
					n = bench.DefaultEngines
				}
				ec := sim.Config{Profile: prof}
				if prov.Profile, err = bench.NewProfileInfo(ec, profFile); err != nil {
					return err
				}
				prov.Engines, prov.Clock = n, "real"
				if virtual {
					prov.Clock = "virtual"
				} else {
					prov.TimeScale, prov.Speedup = speedup, speedup
				}
				if len(replayed) > 0 {
					ec = ec.WithDefaults()
					refs = measure.NewReferences(replayed, n*ec.NumBlocks, ec.BlockSize)
				}
			}
			if rates == nil {
				if err := runAt(recs, 0); err != nil {
					return err
				}
			}
			if requests > 0 && requests < len(recs) {
				recs = recs[:requests]
			}
			for _, rate := range rates {
				rt, err := bench.Retime(recs, rate, rateSeed)
				if err != nil {
					return err
				}
				if err := runAt(rt, rate); err != nil {
					return fmt.Errorf("rate %g req/s: %w", rate, err)
				}
			}
			result.PooledHitRate, result.InfiniteHitRate = refs.All()
			if err := result.WriteTable(cmd.OutOrStdout()); err != nil {
				return err
			}
			behind, err := result.WriteLagWarnings(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			failed := false
			for _, r := range result.Runs {
				if r.Errors > 0 && r.FirstError != "" {
					fmt.Fprintf(cmd.ErrOrStderr(), "%s: %d of %d requests failed; first error: %s\n", r.Policy, r.Errors, r.Requests, r.FirstError)
				}
				failed = failed || (r.Requests > 0 && r.Errors == r.Requests)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "\ncompleted in %s (wall clock)\n", time.Since(started).Round(time.Second))
			prov.WallS = time.Since(started).Seconds()
			result.Provenance = prov
			if outPath != "" {
				if err := writeFile(outPath, result.WriteJSON); err != nil {
					return err
				}
			}
			if htmlPath != "" {
				title := "infergate bench: " + measure.RedactValue(target)
				if target == "" {
					mode := "real time"
					if virtual {
						mode = "virtual time"
					}
					title = fmt.Sprintf("infergate bench: %s on %d engines (%s)", compare, engines, mode)
				}
				rep := report.HTMLReport{Title: title, Runs: htmlRuns, Provenance: prov, References: refs}
				if err := writeFile(htmlPath, func(w io.Writer) error { return report.WriteHTMLReport(w, rep) }); err != nil {
					return err
				}
			}
			if failed {
				return errors.New("every request of a run failed")
			}
			if behind > 0 {
				return fmt.Errorf("%d of %d runs fell behind their time scale by more than --max-lag %v (p99): their latencies are not the modelled hardware's (outputs written; see the warnings above)",
					behind, len(result.Runs), maxLag)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&target, "target", "", "base URL of an OpenAI-compatible endpoint to replay against")
	f.StringVar(&compare, "compare", "", "comma-separated routing policies to compare on fresh simulated fleets ("+strings.Join(sched.Names(), ",")+")")
	f.IntVar(&engines, "engines", 8, "simulated engines per fleet (--compare)")
	wl.register(f)
	f.IntVar(&requests, "requests", 0, "replay only the first N requests (0 = all)")
	f.Float64Var(&speedup, "speedup", 10, "replay the trace this many times faster; in --compare also the fleet's time scale")
	f.Float64Var(&timeScale, "time-scale", 1, "the target's simulated seconds per wall second, to report engine time (--target)")
	f.StringVar(&model, "model", "", "model name to request (default: the profile's model)")
	f.StringVar(&profile, "profile", sim.DefaultProfile().Name, "engine profile for --compare: "+strings.Join(profileNames(), ", "))
	f.StringVar(&profFile, "profile-file", "", "engine profile from a YAML file for --compare (overrides --profile)")
	f.StringVarP(&outPath, "out", "o", "", "write the summary as JSON to this file")
	f.StringVarP(&cfgPath, "config", "c", "", "gateway YAML whose routing section tunes the compared policies (--compare)")
	f.BoolVar(&virtual, "virtual", false, "with --compare: run the same engine model and policies in virtual time (discrete events, no sleeping, no HTTP): seconds instead of minutes")
	f.StringVar(&htmlPath, "html", "", "write a self-contained HTML report to this file: what produced it (command, version, host, trace digest, profile, clock, lag), the summary table with the pooled- and infinite-cache reference hit rates, TTFT and ITL CDFs and percentiles, hit rate against the references, time series, per-engine share")
	f.StringVar(&recPath, "records", "", "write per-request records as JSONL to this file")
	warm.register(f)
	f.StringVar(&rateList, "rate", "", "request-rate sweep: comma-separated rates (req/s, e.g. 1,2,4,8); the workload's arrivals are re-timed as a Poisson process at each rate (fixed seed, same requests in the same order) and run once per rate (per policy with --compare)")
	f.DurationVar(&maxLag, "max-lag", measure.DefaultMaxLag, "real-time runs: the largest p99 lag (engine time) of the simulated fleet's steps and of the client's sends against their schedule; a run past it is marked BEHIND and bench exits non-zero")
	f.IntVar(&concurrency, "concurrency", 0, "closed loop (real time only, not --virtual): N users each send their next request as soon as the previous one finished, ignoring timestamps; with --workload chat, at most N sessions active at once, each turn sent when the previous answer has arrived plus the think time")
	return cmd
}

// writeFile creates path and writes it with write, reporting the first error.
func writeFile(path string, write func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// describeBench records the workload of a bench run in prov: recs (or the
// turns of sessions) of which the first requests (0: all) are replayed.
func describeBench(prov *measure.Provenance, wl *workloadFlags, recs []trace.Record, sessions []trace.Session, requests int) error {
	total := len(recs)
	for _, s := range sessions {
		total += len(s.Turns)
	}
	replayed := total
	if requests > 0 && requests < total {
		replayed = requests
	}
	var err error
	prov.Workload, err = wl.describe(replayed, total)
	return err
}
