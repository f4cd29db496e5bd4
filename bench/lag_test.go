package bench

import (
	"testing"
	"time"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/simserver"
)

// TestFleetLag: a fleet's step lags convert to a Lag in ms; no steps, none.
func TestFleetLag(t *testing.T) {
	if l := FleetLag(simserver.LagStats{}); l != nil {
		t.Errorf("no steps: FleetLag %+v", l)
	}
	l := FleetLag(simserver.LagStats{Steps: 7, P50: 1500 * time.Microsecond, P99: 2 * time.Second, Max: 3 * time.Second})
	if *l != (measure.Lag{Samples: 7, P50: 1.5, P99: 2000, Max: 3000}) {
		t.Errorf("FleetLag %+v", *l)
	}
}
