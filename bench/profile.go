package bench

import (
	"github.com/infergate/infergate/data"
	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/sim"
)

// NewProfileInfo describes the profile of engines configured by cfg (its
// defaults applied: KV blocks and block size as the engines use them),
// read from file ("" for the built-in profile of that name; then Source is
// data.Embedded + "sim/profiles/NAME.yaml" and File nil).
func NewProfileInfo(cfg sim.Config, file string) (*measure.ProfileInfo, error) {
	cfg = cfg.WithDefaults()
	p := cfg.Profile
	pi := &measure.ProfileInfo{Name: p.Name, Model: p.Model, GPU: p.GPU, TensorParallel: p.TensorParallel,
		KVBlocks: cfg.NumBlocks, BlockSize: cfg.BlockSize, MaxModelLen: p.MaxModelLen,
		Source: data.Embedded + "sim/profiles/" + p.Name + ".yaml"}
	if file != "" {
		sf, err := measure.DescribeFile(file)
		if err != nil {
			return nil, err
		}
		pi.Source, pi.File = file, &sf
	}
	return pi, nil
}
