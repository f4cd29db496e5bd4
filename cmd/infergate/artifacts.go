package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/artifact"
	"github.com/infergate/infergate/kvstore"
)

// artifactsFlags are the flags every artifacts subcommand shares
// (persistent on the parent).
type artifactsFlags struct {
	dir         string
	budget      string
	from        []string
	fromDir     []string
	layout      string
	peers       []string
	concurrency int
	attempts    int
	idle        time.Duration
	minRate     string
	verifyReads bool
	lf          logFlags
}

func newArtifactsCmd() *cobra.Command {
	var fl artifactsFlags
	cmd := &cobra.Command{
		Use:   "artifacts",
		Short: "Manage the node-local cache of model artifacts (prefetch, serve to peers, list, verify)",
		Long: `A node-local, content-addressed cache of model artifacts: blobs keyed by their
sha256 digest, named by OCI (or Ollama) manifests, fetched from an origin (an
OCI registry such as Ollama's, or an HTTP file server over an Ollama model
store), a folder, or a peer node's cache; verified, deduplicated, pinned while
engines use them and evicted LRU within --budget. The folder is an Ollama
model store: OLLAMA_MODELS=<dir> (with OLLAMA_NOPRUNE=1) serves every model it
holds. See artifact/README.md.`,
		Example: `  infergate artifacts prefetch tiny --from http://10.0.0.5:8000 --layout ollama-dir
  infergate artifacts prefetch registry.ollama.ai/library/llama3.2:1b --from https://registry.ollama.ai --link /srv/engine1/models
  infergate artifacts serve --listen 0.0.0.0:8200 --from http://origin:8000 --layout ollama-dir
  infergate artifacts prefetch library/qwen3:8b --peer http://node2:8200 --from https://registry.ollama.ai
  infergate artifacts ls
  infergate artifacts verify`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	fl.bind(cmd.PersistentFlags())
	cmd.AddCommand(fl.prefetchCmd(), fl.serveCmd(), fl.lsCmd(), fl.locateCmd(), fl.verifyCmd(), fl.addCmd(), fl.linkCmd())
	return cmd
}

func defaultArtifactsDir() string {
	home, err := os.UserHomeDir()
	if err != nil || home == "" {
		home = "/root"
	}
	return filepath.Join(home, ".cache", "infergate", "artifacts")
}

func (fl *artifactsFlags) bind(f *pflag.FlagSet) {
	f.StringVar(&fl.dir, "dir", defaultArtifactsDir(), "cache folder (an Ollama model store; one process at a time)")
	f.StringVar(&fl.budget, "budget", "0", `byte budget of the blobs held, e.g. 200GiB ("0": unbounded); LRU over unpinned blobs`)
	f.StringArrayVar(&fl.from, "from", nil, "origin URL, tried in order after peers (repeatable; --layout says how it names files)")
	f.StringArrayVar(&fl.fromDir, "from-dir", nil, "origin folder in Ollama's model-store layout (repeatable; after --from)")
	f.StringVar(&fl.layout, "layout", "registry", "layout of the --from origins: registry (OCI distribution /v2/ API, e.g. Ollama's registry) or ollama-dir (a file server over an Ollama model store)")
	f.StringArrayVar(&fl.peers, "peer", nil, "a peer node's cache (the URL of its 'infergate artifacts serve'), tried before origins (repeatable)")
	f.IntVar(&fl.concurrency, "concurrency", 4, "blobs downloaded at once")
	f.IntVar(&fl.attempts, "attempts", 5, "attempts per source and blob (an attempt that received bytes resets the back-off)")
	f.DurationVar(&fl.idle, "idle-timeout", 30*time.Second, "abandon an attempt that receives no byte for this long")
	f.StringVar(&fl.minRate, "min-rate", "64KiB", `abandon an attempt that receives less than this many bytes a second over an --idle-timeout ("0": no floor)`)
	f.BoolVar(&fl.verifyReads, "verify-reads", false, "rehash a blob each time it is served (serve)")
	fl.lf.register(f)
}

// open opens the cache the flags describe.
// openRef parses a model reference and opens the cache (no scrub): what
// locate, add and link start with. The caller closes the cache.
func (fl *artifactsFlags) openRef(cmd *cobra.Command, ref string) (*artifact.Cache, artifact.Ref, error) {
	r, err := artifact.ParseRef(ref)
	if err != nil {
		return nil, r, err
	}
	c, err := fl.open(cmd, false)
	return c, r, err
}

func (fl *artifactsFlags) open(cmd *cobra.Command, scrub bool) (*artifact.Cache, error) {
	budget, err := kvstore.ParseBytes(fl.budget)
	if err != nil {
		return nil, fmt.Errorf("--budget: %w", err)
	}
	layout, err := artifact.ParseLayout(fl.layout)
	if err != nil {
		return nil, fmt.Errorf("--layout: %w", err)
	}
	minRate, err := kvstore.ParseBytes(fl.minRate)
	if err != nil {
		return nil, fmt.Errorf("--min-rate: %w", err)
	}
	if minRate == 0 {
		minRate = -1 // FetchConfig: < 0 is off, 0 the default
	}
	cfg := artifact.Config{
		Dir: fl.dir, Budget: budget, Scrub: scrub, VerifyReads: fl.verifyReads, Logger: newLogger(cmd),
		Fetch: artifact.FetchConfig{Concurrency: fl.concurrency, Attempts: fl.attempts, IdleTimeout: fl.idle, MinRate: minRate},
	}
	for _, u := range fl.peers {
		s, err := artifact.NewHTTP(u, artifact.LayoutRegistry, true)
		if err != nil {
			return nil, fmt.Errorf("--peer: %w", err)
		}
		cfg.Peers = append(cfg.Peers, s)
	}
	for _, u := range fl.from {
		s, err := artifact.NewHTTP(u, layout, false)
		if err != nil {
			return nil, fmt.Errorf("--from: %w", err)
		}
		// Credentials for registries' token realms, from the environment
		// (never a flag: command lines are visible to every local user).
		s.Username, s.Password = os.Getenv("INFERGATE_REGISTRY_USERNAME"), os.Getenv("INFERGATE_REGISTRY_PASSWORD")
		cfg.Origins = append(cfg.Origins, s)
	}
	for _, d := range fl.fromDir {
		cfg.Origins = append(cfg.Origins, artifact.Dir{Path: d})
	}
	return artifact.Open(cfg)
}

func (fl *artifactsFlags) prefetchCmd() *cobra.Command {
	var (
		offline bool
		link    string
		as      string
	)
	cmd := &cobra.Command{
		Use:   "prefetch REF|MANIFEST.json...",
		Short: "Fetch models into the cache before an engine starts",
		Long: `Fetch each model's manifest and missing blobs into the cache (each blob once,
verified by digest and size; partial downloads resume) and print what came
from where. A REF is [host/][namespace/]model[:tag] (Ollama's names); a path to
a manifest file fetches the blobs it names (its model name is --as).`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := fl.open(cmd, false)
			if err != nil {
				return err
			}
			defer c.Close()
			out := cmd.OutOrStdout()
			for _, a := range args {
				r, opts, err := prefetchTarget(a, as)
				if err != nil {
					return err
				}
				opts.Offline = offline
				rep, err := c.Prefetch(cmd.Context(), r, opts)
				if err != nil {
					return err
				}
				fmt.Fprintf(out, "%s: %d blobs, %s (%s already cached); fetched", r, rep.Blobs, human(rep.Bytes), human(rep.HitBytes))
				kinds := make([]string, 0, len(rep.Fetched))
				for k := range rep.Fetched {
					kinds = append(kinds, string(k))
				}
				sort.Strings(kinds)
				for _, k := range kinds {
					fmt.Fprintf(out, " %s from %s", human(rep.Fetched[artifact.SourceKind(k)]), k)
				}
				if len(kinds) == 0 {
					fmt.Fprint(out, " nothing")
				}
				secs := rep.Duration.Seconds()
				fmt.Fprintf(out, " in %.2fs", secs)
				if n := rep.Bytes - rep.HitBytes; n > 0 && secs > 0 {
					fmt.Fprintf(out, " (%.0f MB/s)", float64(n)/secs/1e6)
				}
				fmt.Fprintf(out, "; manifest from %s\n", rep.ManifestFrom)
				if link != "" {
					if err := c.Link(r, link); err != nil {
						return err
					}
					fmt.Fprintf(out, "%s: linked into %s (OLLAMA_MODELS)\n", r, link)
				}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.BoolVar(&offline, "offline", false, "use the cached manifest; ask no source for one")
	f.StringVar(&link, "link", "", "then hard-link the model into this Ollama model store (an engine's OLLAMA_MODELS)")
	f.StringVar(&as, "as", "", "model name of a manifest file argument (default local/<file name>:latest)")
	return cmd
}

// prefetchTarget reads a prefetch argument: a manifest file, or a ref.
func prefetchTarget(a, as string) (artifact.Ref, artifact.AcquireOptions, error) {
	if st, err := os.Stat(a); err == nil && st.Mode().IsRegular() && (strings.HasSuffix(a, ".json") || strings.ContainsRune(a, os.PathSeparator)) {
		if st.Size() > artifact.MaxManifestBytes {
			return artifact.Ref{}, artifact.AcquireOptions{}, fmt.Errorf("%s: over %d bytes", a, artifact.MaxManifestBytes)
		}
		raw, err := os.ReadFile(a)
		if err != nil {
			return artifact.Ref{}, artifact.AcquireOptions{}, err
		}
		name := as
		if name == "" {
			base := strings.TrimSuffix(filepath.Base(a), ".json")
			name = "local/" + strings.Map(func(r rune) rune {
				if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.' {
					return r
				}
				return '_'
			}, base)
		}
		r, err := artifact.ParseRef(name)
		return r, artifact.AcquireOptions{Manifest: raw}, err
	}
	r, err := artifact.ParseRef(a)
	return r, artifact.AcquireOptions{}, err
}

func (fl *artifactsFlags) serveCmd() *cobra.Command {
	var (
		listen   string
		prefetch []string
		scrub    bool
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Serve the cache to peers and engines (read-only OCI distribution API)",
		Long: `Serve the cache read-only over HTTP: the OCI distribution API's pull endpoints
(GET/HEAD /v2/<name>/manifests/<tag>, /v2/<name>/blobs/<digest> with ranges),
GET /v1/artifacts (the models held), /metrics and /health. Other nodes name it
with --peer; an OCI client or Ollama (ollama pull --insecure) can pull from it.
--prefetch models are fetched first.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := fl.open(cmd, scrub)
			if err != nil {
				return err
			}
			defer c.Close()
			log := newLogger(cmd)
			ctx := cmd.Context()
			for _, a := range prefetch {
				r, err := artifact.ParseRef(a)
				if err != nil {
					return err
				}
				rep, err := c.Prefetch(ctx, r, artifact.AcquireOptions{})
				if err != nil {
					return err
				}
				log.Info("artifacts: prefetched", "model", r.String(), "bytes", rep.Bytes, "hit_bytes", rep.HitBytes, "seconds", rep.Duration.Seconds())
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return err
			}
			srv := artifact.NewHTTPServer(listen, artifact.NewServer(c, artifact.ServerConfig{Logger: log}))
			errc := make(chan error, 1)
			go func() { errc <- srv.Serve(ln) }()
			log.Info("artifacts serving", "url", "http://"+ln.Addr().String(), "dir", c.Dir(), "models", len(c.Models()))
			select {
			case <-ctx.Done():
				err = nil
			case err = <-errc:
			}
			sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if serr := srv.Shutdown(sctx); err == nil && !errors.Is(serr, http.ErrServerClosed) {
				err = serr
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", "127.0.0.1:8200", "address to serve on")
	f.StringArrayVar(&prefetch, "prefetch", nil, "model to fetch before serving (repeatable)")
	f.BoolVar(&scrub, "scrub", false, "rehash every blob at start; delete the bad ones")
	return cmd
}

func (fl *artifactsFlags) lsCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List the models the cache holds",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := fl.open(cmd, false)
			if err != nil {
				return err
			}
			defer c.Close()
			models := c.Models()
			sort.Slice(models, func(i, j int) bool { return models[i].Ref.String() < models[j].Ref.String() })
			if asJSON {
				type row struct {
					Model  string `json:"model"`
					Digest string `json:"digest"`
					Size   int64  `json:"size"`
					Blobs  int    `json:"blobs"`
				}
				out := struct {
					Models []row               `json:"models"`
					Stats  artifact.IndexStats `json:"stats"`
				}{Models: []row{}, Stats: c.Stats()}
				for _, m := range models {
					out.Models = append(out.Models, row{m.Ref.String(), string(m.Manifest.Digest), m.Size, len(m.Manifest.Blobs())})
				}
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(out)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "MODEL\tMANIFEST\tSIZE\tBLOBS")
			for _, m := range models {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\n", m.Ref, m.Manifest.Digest.Short(), human(m.Size), len(m.Manifest.Blobs()))
			}
			s := c.Stats()
			budget := "unbounded"
			if s.Budget > 0 {
				budget = human(s.Budget)
			}
			fmt.Fprintf(tw, "\n%d blobs, %s of %s\n", s.Blobs, human(s.Used), budget)
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func (fl *artifactsFlags) locateCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "locate REF",
		Short: "Say where each blob of a model would come from if an engine started now (local, peer, remote)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, r, err := fl.openRef(cmd, args[0])
			if err != nil {
				return err
			}
			defer c.Close()
			p, err := c.Locate(cmd.Context(), r)
			if err != nil {
				return err
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "BLOB\tMEDIA TYPE\tSIZE\tTIER\tIN PAGE CACHE")
			for _, b := range p.Blobs {
				tier := b.Tier.String()
				if b.Tier == artifact.TierPeer {
					tier += " " + fl.peers[b.Peer]
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", b.Digest.Short(), b.MediaType, human(b.Size), tier, human(b.Resident))
			}
			fmt.Fprintf(tw, "\nlocal %s (page cache %s), peer %s, remote %s\n", human(p.TierBytes(artifact.TierLocal)),
				human(p.ResidentBytes()), human(p.TierBytes(artifact.TierPeer)), human(p.TierBytes(artifact.TierRemote)))
			return tw.Flush()
		},
	}
}

func (fl *artifactsFlags) verifyCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "verify",
		Short: "Rehash every blob; delete the bad ones and the manifests naming them (exit 1 if any)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := fl.open(cmd, false)
			if err != nil {
				return err
			}
			defer c.Close()
			bad, err := c.Scrub(cmd.Context())
			if err != nil {
				return err
			}
			s := c.Stats()
			fmt.Fprintf(cmd.OutOrStdout(), "%d blobs (%s) verified, %d bad and deleted\n", s.Blobs, human(s.Used), len(bad))
			if len(bad) > 0 {
				return fmt.Errorf("%d corrupt blobs deleted", len(bad))
			}
			return nil
		},
	}
}

func (fl *artifactsFlags) addCmd() *cobra.Command {
	var mediaType string
	cmd := &cobra.Command{
		Use:   "add REF FILE...",
		Short: "Add local files to the cache as a model (an OCI artifact manifest, one layer a file)",
		Args:  cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, r, err := fl.openRef(cmd, args[0])
			if err != nil {
				return err
			}
			defer c.Close()
			var files []artifact.File
			for _, p := range args[1:] {
				files = append(files, artifact.File{Path: p, MediaType: mediaType})
			}
			m, err := c.Add(cmd.Context(), r, files)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: manifest %s, %d blobs, %s\n", r, m.Digest, len(m.Blobs()), human(m.Size()))
			return nil
		},
	}
	cmd.Flags().StringVar(&mediaType, "media-type", "application/octet-stream", "media type of the layers")
	return cmd
}

func (fl *artifactsFlags) linkCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "link REF OLLAMA_MODELS",
		Short: "Hard-link a cached model into an Ollama model store (an engine's OLLAMA_MODELS)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, r, err := fl.openRef(cmd, args[0])
			if err != nil {
				return err
			}
			defer c.Close()
			return c.Link(r, args[1])
		},
	}
}

// human prints a byte count with a binary unit.
func human(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
