package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/infergate/infergate/plan"
)

// planJudgeFlags are `plan judge`'s flags.
type planJudgeFlags struct {
	refsDir    string
	references string
	baseline   string
	incumbent  string
	workloads  string
	seeds      string
	targets    plan.Targets
	all        bool
	league     bool
	// referencesSet: --references was given (an error with --league).
	referencesSet bool
}

// policyTableWorkloads are scripts/policy-table.sh's workloads, issue 19's
// seven.
const policyTableWorkloads = "mooncake,azure,shared-prefix,chat,agentic,rag,long-tail"

func newPlanJudgeCmd() *cobra.Command {
	fl := planJudgeFlags{targets: plan.DefaultTargets}
	cmd := &cobra.Command{
		Use:   "judge [flags] [LABEL=]DIR/POLICY...",
		Short: "Judge policies against issue 19's targets on scripts/policy-table.sh's runs, cell by cell",
		Long: `Read the runs scripts/policy-table.sh wrote (DIR/<workload>-s<seed>-<policy>.json, one
plan --out each) and print, for each candidate, every cell of every workload and seed
where it misses issue 19's targets (sched/README.md, "Evaluation against the peers"):

  hit rate >= 95% of the pooled-cache reference          (hit/pooled)
  hit rate >= each reference profile's                  (hit>=REF)
  TTFT p50, p90, p99 <= the best of the references'     (ttft_pXX)
      and the baseline's
  each prompt-length bucket's TTFT p90 <= 1.1 x the     (p90 BUCKET)
      baseline's

A candidate is [LABEL=]DIR/POLICY: POLICY's runs in DIR, shown as LABEL (default
DIR/POLICY), so that the same policy run with two configurations (two DIRs) can be
told apart. The references and the baseline are read from --refs (default: the first
candidate's DIR). A run that is missing counts as a lost cell. With --incumbent, each
other candidate is also compared with it cell by cell: the cells it gains and those it
gives up, the adoption rule of sched/README.md ("strictly more cells won, none given
up").

With --league, each candidate is judged with all the other candidates as its reference
profiles instead of --references (never against itself: a peer judged against a set
of references that holds it ties its own cells), and the candidates are ranked by
cells lost: which policy is best on the table when none wins every cell. The baseline
is read from --refs as without it. A cell counts the same lost by 0.1% or by a factor
of three, so the ranking is followed by each candidate's margins (plan.Margins): its
mean rank over every case and metric (hit rate, TTFT p50/p90/p99, each bucket's p90)
and the geometric mean of its ratio to the table's best there ("excess": 4% is 4%
worse than the best on average), overall and per metric. Exits 1 when any candidate
loses a cell.`,
		Example: `  scripts/policy-table.sh base least-request,llm-d,sglang,dynamo,cache-aware
  scripts/policy-table.sh lof cache-aware lof.yaml
  infergate plan judge --incumbent base/cache-aware base/cache-aware lof=lof/cache-aware
  infergate plan judge --league base/cache-aware base/precise-prefix base/llm-d base/sglang base/dynamo`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			fl.referencesSet = cmd.Flags().Changed("references")
			return fl.run(cmd.OutOrStdout(), args)
		},
	}
	f := cmd.Flags()
	f.StringVar(&fl.refsDir, "refs", "", "directory of the references' and the baseline's runs (default: the first candidate's)")
	f.StringVar(&fl.references, "references", "llm-d,sglang,dynamo", "reference profiles, comma-separated")
	f.StringVar(&fl.baseline, "baseline", "least-request", "baseline policy (TTFT percentiles and the per-bucket p90s)")
	f.StringVar(&fl.incumbent, "incumbent", "", "a candidate (its LABEL) to compare the others with, cell by cell")
	f.StringVar(&fl.workloads, "workloads", policyTableWorkloads, "workloads, comma-separated")
	f.StringVar(&fl.seeds, "seeds", "0,1,2", "seeds, comma-separated")
	f.Float64Var(&fl.targets.HitOfPooled, "hit-of-pooled", plan.DefaultTargets.HitOfPooled, "share of the pooled-cache hit rate to reach")
	f.Float64Var(&fl.targets.BucketSlack, "bucket-slack", plan.DefaultTargets.BucketSlack, "how much slower than the baseline's a bucket's TTFT p90 may be (fraction)")
	f.Float64Var(&fl.targets.HitTolerance, "hit-tolerance", 0, "hit-rate shortfall against a reference still counted as equal (fraction of prompt tokens; 0: strict)")
	f.Float64Var(&fl.targets.TTFTTolerance, "ttft-tolerance", 0, "TTFT excess over the best reference still counted as equal (fraction; 0: strict)")
	f.BoolVar(&fl.all, "all", false, "print every cell, won ones too")
	f.BoolVar(&fl.league, "league", false, "judge each candidate against all the others (not --references) and rank them by cells lost")
	return cmd
}

// judgeCandidate is one parsed [LABEL=]DIR/POLICY argument.
type judgeCandidate struct {
	label, dir, policy string
}

// parseJudgeCandidate parses [LABEL=]DIR/POLICY.
func parseJudgeCandidate(arg string) (judgeCandidate, error) {
	label, path, ok := strings.Cut(arg, "=")
	if !ok {
		label, path = arg, arg
	}
	dir, policy := filepath.Split(filepath.Clean(path))
	if label == "" || strings.HasSuffix(path, "/") || policy == "" || dir == "" || strings.ContainsAny(policy, `/\`) {
		return judgeCandidate{}, fmt.Errorf("candidate %q: want [LABEL=]DIR/POLICY", arg)
	}
	return judgeCandidate{label: label, dir: filepath.Clean(dir), policy: policy}, nil
}

// judgeCases is the cross product of comma-separated workloads and seeds.
func judgeCases(workloads, seeds string) ([]plan.Case, error) {
	var out []plan.Case
	for _, w := range strings.Split(workloads, ",") {
		w = strings.TrimSpace(w)
		if w == "" {
			return nil, fmt.Errorf("--workloads %q: empty workload", workloads)
		}
		for _, s := range strings.Split(seeds, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil {
				return nil, fmt.Errorf("--seeds %q: %v", seeds, err)
			}
			out = append(out, plan.Case{Workload: w, Seed: n})
		}
	}
	return out, nil
}

// loadPolicyRuns reads policy's runs in dir for cases
// (dir/<workload>-s<seed>-<policy>.json, scripts/policy-table.sh's
// names); a missing file is a missing run, not an error.
func loadPolicyRuns(dir, policy string, cases []plan.Case) (plan.Runs, error) {
	runs := plan.Runs{}
	for _, c := range cases {
		path := filepath.Join(dir, fmt.Sprintf("%s-s%d-%s.json", c.Workload, c.Seed, policy))
		b, err := os.ReadFile(path)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		var res plan.Result
		if err := json.Unmarshal(b, &res); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		found := false
		for _, r := range res.Rows {
			if r.Policy == policy && r.PD.Prefill == 0 {
				if found {
					return nil, fmt.Errorf("%s: more than one aggregated run of %s", path, policy)
				}
				runs[c], found = r.Summary, true
			}
		}
		if !found {
			return nil, fmt.Errorf("%s: no run of policy %s", path, policy)
		}
	}
	return runs, nil
}

// run judges every candidate of args and writes the lost cells (every cell
// with --all) and, with --incumbent, each other candidate's gains and
// losses against it; the error of a lost cell makes the command exit 1.
func (fl *planJudgeFlags) run(out io.Writer, args []string) error {
	cases, err := judgeCases(fl.workloads, fl.seeds)
	if err != nil {
		return err
	}
	cands := make([]judgeCandidate, len(args))
	for i, a := range args {
		if cands[i], err = parseJudgeCandidate(a); err != nil {
			return err
		}
		for _, c := range cands[:i] {
			if c.label == cands[i].label {
				return fmt.Errorf("candidate label %q given twice", c.label)
			}
		}
	}
	refsDir := fl.refsDir
	if refsDir == "" {
		refsDir = cands[0].dir
	}
	if fl.league {
		return fl.runLeague(out, cands, refsDir, cases)
	}
	refs := map[string]plan.Runs{}
	for _, name := range strings.Split(fl.references, ",") {
		if name = strings.TrimSpace(name); name == "" {
			continue
		}
		if refs[name], err = loadPolicyRuns(refsDir, name, cases); err != nil {
			return err
		}
	}
	baseline, err := loadPolicyRuns(refsDir, fl.baseline, cases)
	if err != nil {
		return err
	}
	judged := make(map[string][]plan.Cell, len(cands))
	lostAny := false
	for _, c := range cands {
		runs, err := loadPolicyRuns(c.dir, c.policy, cases)
		if err != nil {
			return err
		}
		cells := plan.Judge(runs, refs, fl.baseline, baseline, cases, fl.targets)
		judged[c.label] = cells
		lost := plan.Lost(cells)
		lostAny = lostAny || len(lost) > 0
		fmt.Fprintf(out, "== %s: %d of %d cells lost (%d cases)\n", c.label, len(lost), len(cells), len(cases))
		show := lost
		if fl.all {
			show = cells
		}
		if err := plan.WriteCells(out, show); err != nil {
			return err
		}
	}
	if fl.incumbent != "" {
		inc, ok := judged[fl.incumbent]
		if !ok {
			return fmt.Errorf("--incumbent %q: not a candidate's label", fl.incumbent)
		}
		for _, c := range cands {
			if c.label == fl.incumbent {
				continue
			}
			gained, givenUp := plan.Versus(inc, judged[c.label])
			verdict := "does not qualify"
			if len(gained) > 0 && len(givenUp) == 0 {
				verdict = "qualifies (more cells won, none given up)"
			}
			fmt.Fprintf(out, "== %s against %s: %d cells gained, %d given up: %s\n", c.label, fl.incumbent, len(gained), len(givenUp), verdict)
			if len(gained) > 0 {
				fmt.Fprintln(out, "-- gained")
				if err := plan.WriteCells(out, gained); err != nil {
					return err
				}
			}
			if len(givenUp) > 0 {
				fmt.Fprintln(out, "-- given up")
				if err := plan.WriteCells(out, givenUp); err != nil {
					return err
				}
			}
		}
	}
	if lostAny {
		return errJudgeLost
	}
	return nil
}

// runLeague is run with --league: every candidate judged against the
// others (plan.League), its lost cells (every cell with --all) and then
// the ranking.
func (fl *planJudgeFlags) runLeague(out io.Writer, cands []judgeCandidate, refsDir string, cases []plan.Case) error {
	switch {
	case fl.incumbent != "":
		return errors.New("--league ranks the candidates; --incumbent compares them with one: give one of the two")
	case fl.referencesSet:
		return errors.New("--league takes the other candidates as the references: --references does not apply")
	case len(cands) < 2:
		return errors.New("--league needs at least two candidates")
	}
	baseline, err := loadPolicyRuns(refsDir, fl.baseline, cases)
	if err != nil {
		return err
	}
	// Without the baseline's run a case's bucket cells are lost by every
	// candidate and its TTFT cells judged without it: a --refs that names
	// the wrong directory (by default the first candidate's), not a result.
	for _, k := range cases {
		if _, ok := baseline[k]; !ok {
			return fmt.Errorf("--league: the baseline %s has no run of %s (%s): give --refs the directory that holds it", fl.baseline, k, filepath.Join(refsDir, fmt.Sprintf("%s-s%d-%s.json", k.Workload, k.Seed, fl.baseline)))
		}
	}
	runs := make(map[string]plan.Runs, len(cands))
	for _, c := range cands {
		if runs[c.label], err = loadPolicyRuns(c.dir, c.policy, cases); err != nil {
			return err
		}
		// A candidate without a case is no rival: it would lose one cell
		// there and take every other candidate's cells against it (a typo
		// in a DIR or POLICY ranked first).
		for _, k := range cases {
			if _, ok := runs[c.label][k]; !ok {
				return fmt.Errorf("--league: %s has no run of %s (%s)", c.label, k, filepath.Join(c.dir, fmt.Sprintf("%s-s%d-%s.json", k.Workload, k.Seed, c.policy)))
			}
		}
	}
	standings := plan.League(runs, fl.baseline, baseline, cases, fl.targets)
	lostAny := false
	for _, s := range standings {
		lostAny = lostAny || s.Lost > 0
		fmt.Fprintf(out, "== %s: %d of %d cells lost (%d cases; against the other candidates)\n", s.Label, s.Lost, len(s.Cells), len(cases))
		show := plan.Lost(s.Cells)
		if fl.all {
			show = s.Cells
		}
		if err := plan.WriteCells(out, show); err != nil {
			return err
		}
	}
	fmt.Fprintf(out, "== league (each candidate against the others; baseline %s):\n", fl.baseline)
	for i, s := range standings {
		fmt.Fprintf(out, "%2d. %-28s %4d of %d cells lost\n", i+1, s.Label, s.Lost, len(s.Cells))
	}
	writeMargins(out, plan.Margins(runs, baseline, cases))
	if lostAny {
		return errJudgeLost
	}
	return nil
}

// writeMargins writes plan.Margins as a table, smallest excess first.
func writeMargins(out io.Writer, ms []plan.Margin) {
	if len(ms) == 0 {
		return
	}
	fmt.Fprintf(out, "== margins (%d cells each: every case's hit rate, TTFT p50/p90/p99 and bucket p90s; excess: geometric mean of the ratio to the best, minus 1):\n", ms[0].Cells)
	fmt.Fprintf(out, "    %-28s %9s %6s %7s %7s %7s %7s %7s %7s\n", "candidate", "mean rank", "best", "excess", "hit", "p50", "p90", "p99", "buckets")
	pct := func(v float64, ok bool) string {
		if !ok {
			return "–"
		}
		return fmt.Sprintf("%.1f%%", 100*v)
	}
	for i, m := range ms {
		col := func(k string) string { v, ok := m.ByMetric[k]; return pct(v, ok) }
		fmt.Fprintf(out, "%2d. %-28s %9.2f %6d %7s %7s %7s %7s %7s %7s\n", i+1, m.Label, m.MeanRank, m.Best, pct(m.Excess, true),
			col("hit"), col("ttft_p50"), col("ttft_p90"), col("ttft_p99"), col("p90 buckets"))
	}
}

// errJudgeLost is plan judge's error when a candidate lost a cell.
var errJudgeLost = errors.New("plan judge: a candidate misses a target (cells above)")
