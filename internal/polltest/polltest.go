// Package polltest waits in tests for a condition that another goroutine or
// process makes true: one implementation of the loop that every package's
// tests had a copy of (seven, with deadlines from 10 s to a minute and
// polls from 1 to 10 ms).
package polltest

import (
	"testing"
	"time"
)

// Deadline bounds a wait: a guard against a hang on a loaded machine, not a
// timing claim (a health probe or a reflector's back-off can take seconds
// there).
const Deadline = time.Minute

// Every is how often the condition is read.
const Every = 5 * time.Millisecond

// Until reads cond every Every until it holds; it fails t with "timed out
// waiting for " + what after Deadline.
func Until(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(Deadline)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(Every)
	}
}
