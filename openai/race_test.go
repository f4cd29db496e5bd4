//go:build race

package openai

// raceEnabled: the race detector makes sync.Pool drop items, so allocation
// counts are not meaningful under it.
const raceEnabled = true
