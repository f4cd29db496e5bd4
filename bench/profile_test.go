package bench

import (
	"path/filepath"
	"testing"

	"github.com/infergate/infergate/data"
	"github.com/infergate/infergate/sim"
)

func TestNewProfileInfo(t *testing.T) {
	pi, err := NewProfileInfo(sim.Config{Profile: sim.DefaultProfile()}, "")
	ec := sim.Config{Profile: sim.DefaultProfile()}.WithDefaults()
	if err != nil || pi.Name != sim.DefaultProfileName || pi.KVBlocks != ec.NumBlocks || pi.BlockSize != ec.BlockSize ||
		pi.Source != data.Embedded+"sim/profiles/"+sim.DefaultProfileName+".yaml" || pi.File != nil || pi.TensorParallel != 4 || pi.GPU == "" {
		t.Errorf("built-in profile: %+v %v", pi, err)
	}
	if _, err := NewProfileInfo(sim.Config{Profile: sim.DefaultProfile()}, filepath.Join(t.TempDir(), "none.yaml")); err == nil {
		t.Error("missing profile file described")
	}
}
