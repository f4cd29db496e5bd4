package gateway

import (
	"slices"
	"testing"
)

// TestReslottedForgetsRenumbered: past the slot limit (a policy without
// per-slot state) the vacant slots are removed and the endpoints
// renumbered; every slot whose endpoint changed is to be forgotten, the
// renumbered ones included, and no slot that kept its endpoint is.
func TestReslottedForgetsRenumbered(t *testing.T) {
	eps := make([]*endpoint, 6)
	for i := range eps {
		eps[i] = &endpoint{}
	}
	olds := slices.Clone(eps[:5]) // slots 0..4
	// Endpoint 1 leaves, 5 arrives: within the limit it takes slot 1.
	slots, forget := reslotted(olds, []*endpoint{eps[0], eps[2], eps[3], eps[4], eps[5]}, 8)
	if want := []*endpoint{eps[0], eps[5], eps[2], eps[3], eps[4]}; !slices.Equal(slots, want) || !slices.Equal(forget, []int{1}) {
		t.Fatalf("within the limit: slots %v forget %v", slots, forget)
	}
	// Past the limit, endpoint 1 leaves: 2, 3 and 4 move to slots 1, 2
	// and 3, and slot 1 (vacated) and 2, 3 (renumbered) change.
	many := slices.Clone(eps[:5])
	slots, forget = reslotted(many, []*endpoint{eps[0], eps[2], eps[3], eps[4]}, 2)
	if want := []*endpoint{eps[0], eps[2], eps[3], eps[4]}; !slices.Equal(slots, want) {
		t.Fatalf("past the limit: slots %v", slots)
	}
	for i, ep := range slots {
		if changed := many[i] != ep; changed != slices.Contains(forget, i) {
			t.Errorf("slot %d: endpoint changed %v, forgotten %v (forget %v)", i, changed, slices.Contains(forget, i), forget)
		}
	}
	if !slices.IsSorted(forget) || len(slices.Compact(slices.Clone(forget))) != len(forget) {
		t.Errorf("forget %v: want sorted, without repeats", forget)
	}
}
