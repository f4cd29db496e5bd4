// Command infergate is an LLM inference gateway: an OpenAI-compatible front
// door that routes each request to the engine most likely to hold its prompt's
// KV cache. Subcommands: up (gateway plus a simulated fleet), serve (gateway in
// front of real engines), sim (one simulated vLLM-compatible engine), bench
// (trace replay and policy comparison), plan (fleet sizing in virtual time),
// kvstore (the shared remote KV-cache tier), artifacts (the node-local model
// artifact cache),
// version.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"

	"github.com/spf13/cobra"
)

// version is set at link time (-ldflags "-X main.version=v1.2.3"); otherwise
// the module version or VCS revision from the build info is reported.
var version = ""

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		// The first signal starts a graceful shutdown; with the handler
		// gone, a second one ends the process at once.
		<-ctx.Done()
		stop()
	}()
	if err := newRoot().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "infergate:", err)
		os.Exit(1)
	}
}

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:   "infergate",
		Short: "Cache-aware, OpenAI-compatible LLM inference gateway",
		Long: `infergate routes OpenAI-compatible requests to LLM engines (vLLM, SGLang,
llama.cpp, Ollama, TGI, or its own simulator), sending each request to the
engine most likely to hold its prompt prefix in KV cache, balanced against load.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       buildVersion(),
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			// One log format for every package (the gateway logs through
			// slog's default); serve applies its config's log keys later.
			_, err := setupLogging(cmd, nil)
			return err
		},
	}
	root.CompletionOptions.DisableDefaultCmd = true
	root.AddCommand(newUpCmd(), newServeCmd(), newEPPCmd(), newSimCmd(), newBenchCmd(), newPlanCmd(), newKVStoreCmd(), newArtifactsCmd(), newKeysCmd(), newVersionCmd())
	return root
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the infergate version",
		Args:  cobra.NoArgs,
		Run: func(cmd *cobra.Command, _ []string) {
			fmt.Fprintln(cmd.OutOrStdout(), "infergate", buildVersion())
		},
	}
}

func buildVersion() string {
	if version != "" {
		return version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "(devel)"
	}
	v := bi.Main.Version
	rev, dirty := "", false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev != "" {
		if len(rev) > 12 {
			rev = rev[:12]
		}
		if dirty {
			rev += "-dirty"
		}
		return fmt.Sprintf("%s (%s, %s)", v, rev, bi.GoVersion)
	}
	return fmt.Sprintf("%s (%s)", v, bi.GoVersion)
}
