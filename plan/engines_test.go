package plan

import (
	"slices"
	"strings"
	"testing"
)

func TestParseEngines(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []int
	}{
		{"4..32", []int{4, 8, 16, 32}},
		{"3..20", []int{3, 6, 12, 20}},
		{"1..1", []int{1}},
		{"5..5/2", []int{5}},
		{"4..16/4", []int{4, 8, 12, 16}},
		{"2..9/3", []int{2, 5, 8, 9}},
		{"4..30/8", []int{4, 12, 20, 28, 30}},
		{"16", []int{16}},
		{"4,6,8", []int{4, 6, 8}},
		{"8,4,4", []int{4, 8}},
		{"4..8/2,16", []int{4, 6, 8, 16}},
		{" 4 .. 8 , 2 ", []int{2, 4, 8}},
		{"1..4096", []int{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096}},
	} {
		got, err := ParseEngines(tc.in)
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("ParseEngines(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

func TestParseEnginesErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", "empty engine range"},
		{"0", "must be in [1, 4096]"},
		{"-1", "must be in [1, 4096]"},
		{"5000", "must be in [1, 4096]"},
		{"1..5000", "must be in [1, 4096]"},
		{"a", `"a" is not an engine count`},
		{"4.5", "is not an engine count"},
		{"8..4", "start 8 is above end 4"},
		{"4..", `"" is not an engine count`},
		{"..8", `"" is not an engine count`},
		{"4...8", `".8" is not an engine count`},
		{"4..8/0", "want an integer >= 1"},
		{"4..8/x", "want an integer >= 1"},
		{"4..8/", "want an integer >= 1"},
		{"4/2", "a step needs a range"},
		{"4,,8", "empty item"},
		{"4,", "empty item"},
	} {
		_, err := ParseEngines(tc.in)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseEngines(%q) = %v, want an error containing %q", tc.in, err, tc.want)
		}
	}
}
