//go:build twin

package e2e

// wallClockChecks turns on the assertions on wall-clock times, which
// depend on what else the machine runs: only with -tags twin (.ci/run's
// wall-clock step). The default build checks on-CPU times instead.
const wallClockChecks = true
