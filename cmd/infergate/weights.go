package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/artifact"
	"github.com/infergate/infergate/simserver"
)

// weightsFlags make a simulated engine's start-up read its weights through
// the node's artifact cache (sim and up --engines MIN..MAX; simserver
// startupweights.go): --weights names the model, the --artifact-* flags
// are `infergate artifacts`' cache flags under another prefix.
type weightsFlags struct {
	ref      string
	noVerify bool
	cache    artifactsFlags
}

// weightsFlagNames are the flags that need --weights.
var weightsFlagNames = []string{"artifact-dir", "artifact-budget", "artifact-from", "artifact-from-dir", "artifact-layout", "artifact-peer", "artifact-min-rate", "weights-no-verify"}

func (w *weightsFlags) register(f *pflag.FlagSet, scope string) {
	f.StringVar(&w.ref, "weights", "", scope+"the model (an artifact reference, e.g. local/llama-70b:1) whose weights the engine's start-up reads through the node's artifact cache: fetched from --artifact-from/--artifact-peer when missing (the start-up then modelled from the remote or peer tier), read and verified from the cache when present (page cache or NVMe tier, by residency); pinned while the engine runs (simserver README, \"Weights through the artifact cache\")")
	f.BoolVar(&w.noVerify, "weights-no-verify", false, "with --weights, read the cached bytes at start-up without rehashing them (a fetch verifies what it downloads either way)")
	f.StringVar(&w.cache.dir, "artifact-dir", defaultArtifactsDir(), "with --weights, the node's artifact cache folder (as infergate artifacts --dir; one process at a time)")
	f.StringVar(&w.cache.budget, "artifact-budget", "0", "with --weights, the cache's byte budget (as infergate artifacts --budget)")
	f.StringArrayVar(&w.cache.from, "artifact-from", nil, "with --weights, an origin URL of the cache (repeatable; as infergate artifacts --from)")
	f.StringArrayVar(&w.cache.fromDir, "artifact-from-dir", nil, "with --weights, an origin folder in Ollama's layout (repeatable)")
	f.StringVar(&w.cache.layout, "artifact-layout", "registry", "with --weights, the layout of the --artifact-from origins: registry or ollama-dir")
	f.StringArrayVar(&w.cache.peers, "artifact-peer", nil, "with --weights, a peer node's cache (its infergate artifacts serve URL; repeatable)")
	f.StringVar(&w.cache.minRate, "artifact-min-rate", "64KiB", `with --weights, abandon a fetch attempt that receives less than this many bytes a second (as infergate artifacts --min-rate; "0": no floor)`)
	w.cache.concurrency, w.cache.attempts, w.cache.idle = 4, 5, 30*time.Second
}

// unused refuses the cache flags without --weights.
func (w *weightsFlags) unused(cmd *cobra.Command) error {
	for _, n := range weightsFlagNames {
		if f := cmd.Flags().Lookup(n); f != nil && f.Changed {
			return fmt.Errorf("--%s needs --weights", n)
		}
	}
	return nil
}

// open opens the node's cache and returns the start-up's Weights, or nil
// without --weights; the caller closes the cache after the engines.
func (w *weightsFlags) open(cmd *cobra.Command) (*simserver.Weights, *artifact.Cache, error) {
	if w.ref == "" {
		return nil, nil, w.unused(cmd)
	}
	r, err := artifact.ParseRef(w.ref)
	if err != nil {
		return nil, nil, fmt.Errorf("--weights: %w", err)
	}
	c, err := w.cache.open(cmd, false)
	if err != nil {
		return nil, nil, fmt.Errorf("--weights: %w", err)
	}
	if len(w.cache.from)+len(w.cache.fromDir)+len(w.cache.peers) == 0 && c.Manifest(r) == nil {
		c.Close()
		return nil, nil, errors.New("--weights " + r.String() + ": not in the cache and no --artifact-from, --artifact-from-dir or --artifact-peer to fetch it from")
	}
	return &simserver.Weights{Cache: c, Ref: r, NoVerify: w.noVerify}, c, nil
}
