package bench

import (
	"time"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/simserver"
)

// FleetLag converts a simulated fleet's step lags (simserver.Fleet.Lag) to a
// measure.Lag (ms of engine time); nil when no step ran.
func FleetLag(st simserver.LagStats) *measure.Lag {
	if st.Steps == 0 {
		return nil
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	return &measure.Lag{Samples: st.Steps, P50: ms(st.P50), P99: ms(st.P99), Max: ms(st.Max)}
}
