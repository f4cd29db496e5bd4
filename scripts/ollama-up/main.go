// Command ollama-up starts N Ollama instances on loopback, each serving the
// generated tiny model (package gguf), prints a gateway configuration for
// them, and stops them all (process groups included) on SIGINT/SIGTERM or
// when one of them dies, leaving nothing running. It is the real-engine
// harness behind `scripts/ollama.sh up`; the e2e tests use the same code
// (package e2e).
//
//	go run ./scripts/ollama-up -n 2 > gateway.yaml   # Ctrl-C to stop
//	infergate serve -c gateway.yaml                     # in another shell
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/infergate/infergate/e2e"
	"github.com/infergate/infergate/gguf"
)

func main() {
	n := flag.Int("n", 2, "instances to start (keep at most 2 busy on 2 cores)")
	seed := flag.Uint64("seed", 0, "model weight seed")
	flag.Parse()
	if err := run(*n, *seed); err != nil {
		fmt.Fprintln(os.Stderr, "ollama-up:", err)
		os.Exit(1)
	}
}

func run(n int, seed uint64) error {
	if n < 1 {
		return fmt.Errorf("-n %d: want at least 1", n)
	}
	bin, err := e2e.OllamaBinary()
	if err != nil {
		return fmt.Errorf("%w (build it with scripts/ollama.sh build)", err)
	}
	dir, err := os.MkdirTemp("", "ollama-up-model-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if _, err := e2e.WriteModelDir(dir, gguf.Options{Seed: seed}); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var insts []*e2e.Instance
	defer func() {
		for _, in := range insts {
			if err := in.Stop(); err != nil {
				fmt.Fprintln(os.Stderr, "ollama-up: stop", in.URL+":", err)
			}
		}
		fmt.Fprintf(os.Stderr, "ollama-up: stopped %d instances\n", len(insts))
	}()
	for range n {
		sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		in, err := e2e.StartOllama(sctx, bin, dir, e2e.Options{})
		cancel()
		if err != nil {
			return err
		}
		insts = append(insts, in)
		fmt.Fprintf(os.Stderr, "ollama-up: %s serving model %q (log %s)\n", in.URL, in.Model, in.LogPath)
	}
	fmt.Println("# infergate serve -c this-file: the Ollama instances of scripts/ollama.sh up")
	fmt.Println("listen: 127.0.0.1:8080")
	fmt.Println("endpoints:")
	for _, in := range insts {
		fmt.Printf("  - {url: %s, model: %s, kind: ollama, kv_blocks: %d}\n", in.URL, in.Model, e2e.OllamaKVBlocks)
	}
	fmt.Fprintln(os.Stderr, "ollama-up: ready; Ctrl-C stops every instance")
	died := make(chan *e2e.Instance, len(insts))
	for _, in := range insts {
		go func() {
			<-in.Exited()
			died <- in
		}()
	}
	select {
	case <-ctx.Done():
		return nil
	case in := <-died:
		return fmt.Errorf("instance %s exited; see %s", in.URL, in.LogPath)
	}
}
