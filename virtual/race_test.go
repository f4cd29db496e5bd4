//go:build race

package virtual

// raceEnabled reports whether the race detector is on (it slows the engine
// simulation about tenfold).
const raceEnabled = true
