package plan

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// MaxEngines bounds a fleet size ParseEngines accepts.
const MaxEngines = 4096

// ParseEngines parses the fleet sizes to sweep: a comma-separated list whose
// items are
//
//	N        one size
//	a..b     a geometric sweep: a, 2a, 4a, ... while ≤ b, then b itself
//	         (4..32 → 4, 8, 16, 32; 3..20 → 3, 6, 12, 20)
//	a..b/s   a linear sweep: a, a+s, a+2s, ... while ≤ b, then b itself
//	         (4..16/4 → 4, 8, 12, 16; 2..9/3 → 2, 5, 8, 9)
//
// Sizes are in [1, MaxEngines]; a ≤ b, s ≥ 1. The result is the union of the
// items, ascending and without duplicates ("4..8/2,16" → 4, 6, 8, 16).
func ParseEngines(s string) ([]int, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("empty engine range: want e.g. 4..32, 4..32/4 or 4,8,16")
	}
	var out []int
	for item := range strings.SplitSeq(s, ",") {
		item = strings.TrimSpace(item)
		sizes, err := parseEngineItem(item)
		if err != nil {
			return nil, fmt.Errorf("engine range %q: %w", item, err)
		}
		out = append(out, sizes...)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

func parseEngineItem(item string) ([]int, error) {
	if item == "" {
		return nil, errors.New("empty item")
	}
	lo, hi, isRange := strings.Cut(item, "..")
	if !isRange {
		if strings.Contains(item, "/") {
			return nil, errors.New("a step needs a range, e.g. 4..32/4")
		}
		n, err := parseSize(item)
		if err != nil {
			return nil, err
		}
		return []int{n}, nil
	}
	hi, stepStr, hasStep := strings.Cut(hi, "/")
	a, err := parseSize(lo)
	if err != nil {
		return nil, err
	}
	b, err := parseSize(hi)
	if err != nil {
		return nil, err
	}
	if a > b {
		return nil, fmt.Errorf("start %d is above end %d", a, b)
	}
	var sizes []int
	if hasStep {
		step, err := strconv.Atoi(strings.TrimSpace(stepStr))
		if err != nil || step < 1 {
			return nil, fmt.Errorf("step %q: want an integer >= 1", stepStr)
		}
		for n := a; n <= b; n += step {
			sizes = append(sizes, n)
		}
	} else {
		for n := a; n <= b; n *= 2 {
			sizes = append(sizes, n)
		}
	}
	if sizes[len(sizes)-1] != b {
		sizes = append(sizes, b)
	}
	return sizes, nil
}

// parseSize parses one fleet size in [1, MaxEngines].
func parseSize(s string) (int, error) {
	s = strings.TrimSpace(s)
	n, err := strconv.Atoi(s)
	if err != nil {
		return 0, fmt.Errorf("%q is not an engine count", s)
	}
	if n < 1 || n > MaxEngines {
		return 0, fmt.Errorf("engine count %d: must be in [1, %d]", n, MaxEngines)
	}
	return n, nil
}
