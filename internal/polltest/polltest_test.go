package polltest

import "testing"

// TestUntil: the condition is read again until it holds, and not after.
func TestUntil(t *testing.T) {
	reads := 0
	Until(t, "the third read", func() bool {
		reads++
		return reads == 3
	})
	if reads != 3 {
		t.Fatalf("condition read %d times, want 3 (until it held)", reads)
	}
}
