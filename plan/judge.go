package plan

import (
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/infergate/infergate/measure"
)

// Judging a policy against issue 19's targets, cell by cell. The policy ×
// workload table of sched/README.md ("Evaluation against the peers") is
// one plan run per workload, seed and policy (scripts/policy-table.sh); a
// candidate wins a workload and seed when, against the same workload and
// seed's runs of the reference profiles (the peers: llm-d, sglang, dynamo)
// and the baseline (least-request),
//
//	hit rate ≥ HitOfPooled (95%) × the pooled-cache reference
//	hit rate ≥ each reference's
//	TTFT p50, p90, p99 ≤ the best (lowest) of the references' and the baseline's
//	TTFT p90 of each prompt-length bucket ≤ (1 + BucketSlack) × the baseline's
//
// (issue 19, "Targets"). Judge checks each of these as one Cell, so that
// "wins every cell" is a program's verdict, not a reading of ranges.

// Targets are the thresholds of Judge (issue 19's; DefaultTargets).
type Targets struct {
	// HitOfPooled is the share of the pooled-cache reference hit rate the
	// candidate must reach (0.95).
	HitOfPooled float64
	// BucketSlack is how much worse than the baseline's a prompt-length
	// bucket's TTFT p90 may be, as a fraction (0.10).
	BucketSlack float64
	// HitTolerance is how far below a reference's hit rate still counts as
	// equal (a fraction of prompt tokens: 0.001 is a tenth of a point; 0:
	// strictly ≥, issue 19's target).
	HitTolerance float64
	// TTFTTolerance is how much slower than the best reference's a TTFT
	// percentile may be and still count as equal (a fraction: 0.01 is 1%;
	// 0: strictly ≤, issue 19's target).
	TTFTTolerance float64
}

// DefaultTargets are issue 19's targets, without tolerance.
var DefaultTargets = Targets{HitOfPooled: 0.95, BucketSlack: 0.10}

// Case is one workload and seed of the table: a column of issue 19's
// "every workload, every seed".
type Case struct {
	Workload string
	Seed     int
}

func (c Case) String() string { return fmt.Sprintf("%s s%d", c.Workload, c.Seed) }

// Runs are the summaries of one policy's runs by Case.
type Runs map[Case]measure.Summary

// Cell is one target of one Case, judged for one candidate.
type Cell struct {
	Case
	// Target names what is checked: "hit/pooled", "hit>=REF" (one per
	// reference), "ttft_p50", "ttft_p90", "ttft_p99", "p90 BUCKET" (one per
	// prompt-length bucket the baseline has requests in).
	Target string
	// Got is the candidate's value and Want the bound it must meet (hit
	// rates as fractions, latencies in ms); Against names the run the bound
	// comes from ("pooled", a reference, or the baseline).
	Got, Want float64
	Against   string
	// Won: Got meets Want (hit: Got ≥ Want; latency: Got ≤ Want).
	Won bool
	// Missing: the candidate or a run the target needs lacks the case
	// (counted as lost: a claim needs every run).
	Missing bool
}

// Margin is how far the cell is from its bound as a signed fraction of it
// (negative: lost by that much; latency cells count slower as negative).
func (c Cell) Margin() float64 {
	if c.Want == 0 {
		return 0
	}
	if strings.HasPrefix(c.Target, "hit") {
		return (c.Got - c.Want) / c.Want
	}
	return (c.Want - c.Got) / c.Want
}

// Judge judges candidate against refs (each reference profile's runs, by
// name) and baseline (least-request's runs) on every case of cases, per t,
// and returns every cell in case order, then target order.
func Judge(candidate Runs, refs map[string]Runs, baselineName string, baseline Runs, cases []Case, t Targets) []Cell {
	refNames := slices.Sorted(func(yield func(string) bool) {
		for k := range refs {
			if !yield(k) {
				return
			}
		}
	})
	var out []Cell
	for _, c := range cases {
		cand, ok := candidate[c]
		if !ok {
			out = append(out, Cell{Case: c, Target: "run", Missing: true})
			continue
		}
		// Hit rate against the pooled-cache reference.
		if cand.PooledHitRate != nil && *cand.PooledHitRate > 0 {
			want := t.HitOfPooled * *cand.PooledHitRate
			out = append(out, Cell{Case: c, Target: "hit/pooled", Got: cand.HitRate, Want: want, Against: "pooled",
				Won: cand.HitRate >= want})
		}
		// Hit rate against each reference.
		for _, name := range refNames {
			cell := Cell{Case: c, Target: "hit>=" + name, Got: cand.HitRate, Against: name}
			if r, ok := refs[name][c]; ok {
				cell.Want = r.HitRate
				cell.Won = cand.HitRate >= r.HitRate-t.HitTolerance
			} else {
				cell.Missing = true
			}
			out = append(out, cell)
		}
		// TTFT percentiles against the best of the references and the
		// baseline.
		for _, q := range []struct {
			name string
			of   func(measure.Latency) float64
		}{
			{"ttft_p50", func(l measure.Latency) float64 { return l.P50 }},
			{"ttft_p90", func(l measure.Latency) float64 { return l.P90 }},
			{"ttft_p99", func(l measure.Latency) float64 { return l.P99 }},
		} {
			cell := Cell{Case: c, Target: q.name, Got: q.of(cand.TTFT)}
			best, bestName, missing := 0.0, "", false
			for _, name := range append(refNames, baselineName) {
				runs := refs[name]
				if name == baselineName {
					runs = baseline
				}
				r, ok := runs[c]
				if !ok {
					missing = true
					continue
				}
				if v := q.of(r.TTFT); bestName == "" || v < best {
					best, bestName = v, name
				}
			}
			cell.Want, cell.Against, cell.Missing = best, bestName, missing
			cell.Won = !missing && cell.Got <= best*(1+t.TTFTTolerance)
			out = append(out, cell)
		}
		// Per prompt-length bucket TTFT p90 against the baseline's.
		base, ok := baseline[c]
		if !ok {
			out = append(out, Cell{Case: c, Target: "p90 buckets", Against: baselineName, Missing: true})
			continue
		}
		for _, b := range base.TTFTByPromptLength {
			if b.Requests == 0 {
				continue
			}
			cell := Cell{Case: c, Target: "p90 " + b.Name, Want: (1 + t.BucketSlack) * b.TTFT.P90, Against: baselineName}
			i := slices.IndexFunc(cand.TTFTByPromptLength, func(x measure.BucketLatency) bool { return x.Name == b.Name })
			if i < 0 || cand.TTFTByPromptLength[i].Requests == 0 {
				cell.Missing = true
			} else {
				cell.Got = cand.TTFTByPromptLength[i].TTFT.P90
				cell.Won = cell.Got <= cell.Want
			}
			out = append(out, cell)
		}
	}
	return out
}

// Standing is one candidate's place in a League: its cells, judged with
// every other candidate as a reference profile, and how many it lost.
type Standing struct {
	Label string
	Cells []Cell
	Lost  int
}

// League judges each candidate of cands (runs by label) with all the
// others as its reference profiles and baseline as the baseline (Judge),
// and returns the standings ordered by lost cells, fewest first (ties by
// label). It answers issue 19's "the default is the best on that table"
// when no candidate wins every cell: each is held to the same targets
// against the same rivals, itself excluded, so a policy that is a
// reference of the others is not favoured by tying with itself (as a peer
// judged with Judge against a set of references that contains it is).
// With every run present all candidates are judged on the same number of
// cells.
func League(cands map[string]Runs, baselineName string, baseline Runs, cases []Case, t Targets) []Standing {
	out := make([]Standing, 0, len(cands))
	for label, runs := range cands {
		refs := make(map[string]Runs, len(cands)-1)
		for other, r := range cands {
			if other != label {
				refs[other] = r
			}
		}
		cells := Judge(runs, refs, baselineName, baseline, cases, t)
		out = append(out, Standing{Label: label, Cells: cells, Lost: len(Lost(cells))})
	}
	slices.SortFunc(out, func(a, b Standing) int {
		if a.Lost != b.Lost {
			return a.Lost - b.Lost
		}
		return strings.Compare(a.Label, b.Label)
	})
	return out
}

// Lost returns the cells of cells that are not won.
func Lost(cells []Cell) []Cell {
	var out []Cell
	for _, c := range cells {
		if !c.Won {
			out = append(out, c)
		}
	}
	return out
}

// Versus compares two candidates' judgements of the same cases and targets:
// gained are the cells b wins and a loses, given up those a wins and b
// loses. A cell present in one only counts as lost in the other.
func Versus(a, b []Cell) (gained, givenUp []Cell) {
	key := func(c Cell) string { return c.Case.String() + "\x00" + c.Target }
	won := make(map[string]bool, len(a))
	for _, c := range a {
		won[key(c)] = c.Won
	}
	seen := make(map[string]bool, len(b))
	for _, c := range b {
		k := key(c)
		seen[k] = true
		switch {
		case c.Won && !won[k]:
			gained = append(gained, c)
		case !c.Won && won[k]:
			givenUp = append(givenUp, c)
		}
	}
	for _, c := range a {
		if c.Won && !seen[key(c)] {
			c.Won, c.Missing = false, true
			givenUp = append(givenUp, c)
		}
	}
	return gained, givenUp
}

// WriteCells writes cells as a plain table, one cell a line: case, target,
// the candidate's value, the bound and where it comes from, the margin.
// Hit rates are printed in percent, latencies in seconds.
func WriteCells(w io.Writer, cells []Cell) error {
	for _, c := range cells {
		var err error
		switch {
		case c.Missing && c.Against == "":
			_, err = fmt.Fprintf(w, "%-18s %-14s missing run\n", c.Case, c.Target)
		case c.Missing:
			_, err = fmt.Fprintf(w, "%-18s %-14s missing run (%s)\n", c.Case, c.Target, c.Against)
		case strings.HasPrefix(c.Target, "hit"):
			_, err = fmt.Fprintf(w, "%-18s %-14s %8.2f%%  want >= %8.2f%% (%s)  %+6.1f%%\n", c.Case, c.Target,
				100*c.Got, 100*c.Want, c.Against, 100*c.Margin())
		default:
			_, err = fmt.Fprintf(w, "%-18s %-14s %8.3fs  want <= %8.3fs (%s)  %+6.1f%%\n", c.Case, c.Target,
				c.Got/1000, c.Want/1000, c.Against, 100*c.Margin())
		}
		if err != nil {
			return err
		}
	}
	return nil
}
