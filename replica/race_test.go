//go:build race

package replica

// raceEnabled: allocation counts are not asserted under the race
// detector, whose instrumentation may allocate.
const raceEnabled = true
