package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"gopkg.in/yaml.v3"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/kvstore"
)

// kvstoreFile is kvstore's -c config.yaml; flags given on the command line
// override its keys.
type kvstoreFile struct {
	Listen         string                    `yaml:"listen"`
	LMListen       *string                   `yaml:"lm_listen"`
	Model          string                    `yaml:"model"`
	MemoryBytes    string                    `yaml:"memory_bytes"`
	DiskDir        string                    `yaml:"disk_dir"`
	DiskBytes      string                    `yaml:"disk_bytes"`
	MaxObjectBytes string                    `yaml:"max_object_bytes"`
	Redis          string                    `yaml:"redis"`
	KVEvents       *kvevents.PublisherConfig `yaml:"kv_events"`
}

// kvstoreFlags are kvstore's flags (bind).
type kvstoreFlags struct {
	configPath     string
	listen         string
	lmListen       string
	model          string
	memoryBytes    string
	diskDir        string
	diskBytes      string
	maxObjectBytes string
	redis          string
	events         string
	eventsReplay   string
	eventsTopic    string
	lf             logFlags
}

func newKVStoreCmd() *cobra.Command {
	var fl kvstoreFlags
	cmd := &cobra.Command{
		Use:   "kvstore",
		Short: "Run the shared remote KV-cache tier",
		Long: `Serve a KV block store shared by engines: a byte-bounded memory tier that spills
to a byte-bounded disk tier, optionally backed by Redis in LMCache's layout.
Engines write and read it over the native HTTP API and LMCache's lm://
protocol; every block that enters or leaves the store is published as a vLLM
KV event (medium "REMOTE") on a ZeroMQ endpoint, which a gateway subscribes to
as to an engine. See kvstore/README.md.`,
		Example: `  infergate kvstore --memory-bytes 8GiB --model meta-llama/Llama-3.1-8B-Instruct
  infergate kvstore --disk-dir /var/cache/infergate-kv --disk-bytes 200GiB --redis redis://127.0.0.1:6379/0
  infergate kvstore -c kvstore.yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return fl.run(cmd) },
	}
	fl.bind(cmd.Flags())
	return cmd
}

// bind registers kvstore's flags on f.
func (fl *kvstoreFlags) bind(f *pflag.FlagSet) {
	f.StringVarP(&fl.configPath, "config", "c", "", "YAML config file (keys: listen, lm_listen, model, memory_bytes, disk_dir, disk_bytes, max_object_bytes, redis, kv_events); flags override it")
	f.StringVar(&fl.listen, "listen", "127.0.0.1:8100", "native API address (HTTP/1.1 + JSON)")
	f.StringVar(&fl.lmListen, "lm-listen", "127.0.0.1:65432", `LMCache lm:// server address ("" for none)`)
	f.StringVar(&fl.model, "model", "", `the model whose blocks the event stream carries ("" for every model's)`)
	f.StringVar(&fl.memoryBytes, "memory-bytes", "1GiB", "memory tier capacity (e.g. 8GiB)")
	f.StringVar(&fl.diskDir, "disk-dir", "", "disk tier directory (its *.kvb files are removed at start); none without it")
	f.StringVar(&fl.diskBytes, "disk-bytes", "10GiB", "disk tier capacity")
	f.StringVar(&fl.maxObjectBytes, "max-object-bytes", "64MiB", "largest block payload accepted")
	f.StringVar(&fl.redis, "redis", "", "Redis tier in LMCache's layout, redis://[user:password@]host:port[/db]")
	f.StringVar(&fl.events, "events", "tcp://127.0.0.1:5557", `KV-event PUB endpoint, bound ("" for no events)`)
	f.StringVar(&fl.eventsReplay, "events-replay", "", "KV-event replay ROUTER endpoint (none by default)")
	f.StringVar(&fl.eventsTopic, "events-topic", "", "KV-event topic (default kv@kvstore@<model>)")
	fl.lf.register(f)
}

// config reads the config file, applies the flags given and returns the
// service configuration.
func (fl *kvstoreFlags) config(cmd *cobra.Command) (kvstore.ServiceConfig, error) {
	var cfg kvstore.ServiceConfig
	changed := cmd.Flags().Changed
	pick := func(flag string, fileVal *string, flagVal string) string {
		if changed(flag) || fileVal == nil || *fileVal == "" {
			return flagVal
		}
		return *fileVal
	}
	var file kvstoreFile
	if fl.configPath != "" {
		f, err := os.Open(fl.configPath)
		if err != nil {
			return cfg, err
		}
		d := yaml.NewDecoder(f)
		d.KnownFields(true)
		err = d.Decode(&file)
		f.Close()
		if err != nil && !errors.Is(err, io.EOF) {
			return cfg, fmt.Errorf("%s: %w", fl.configPath, err)
		}
	}
	cfg.Listen = pick("listen", &file.Listen, fl.listen)
	cfg.LMListen = fl.lmListen
	if file.LMListen != nil && !changed("lm-listen") {
		cfg.LMListen = *file.LMListen
	}
	cfg.Model = pick("model", &file.Model, fl.model)
	var err error
	size := func(name, flagVal string, fileVal string) int64 {
		v := pick(name, &fileVal, flagVal)
		n, e := kvstore.ParseBytes(v)
		if e != nil && err == nil {
			err = fmt.Errorf("--%s: %w", name, e)
		}
		return n
	}
	cfg.Store.MemoryBytes = size("memory-bytes", fl.memoryBytes, file.MemoryBytes)
	cfg.Store.MaxObjectBytes = size("max-object-bytes", fl.maxObjectBytes, file.MaxObjectBytes)
	cfg.Store.DiskDir = pick("disk-dir", &file.DiskDir, fl.diskDir)
	if cfg.Store.DiskDir != "" {
		cfg.Store.DiskBytes = size("disk-bytes", fl.diskBytes, file.DiskBytes)
	}
	if err != nil {
		return cfg, err
	}
	cfg.Redis.URL = pick("redis", &file.Redis, fl.redis)
	if file.KVEvents != nil && !changed("events") {
		cfg.Events = *file.KVEvents
	} else if fl.events != "" {
		cfg.Events = kvevents.PublisherConfig{Enable: true, Endpoint: fl.events, Bind: true}
	}
	if changed("events-replay") || cfg.Events.ReplayEndpoint == "" {
		cfg.Events.ReplayEndpoint = fl.eventsReplay
	}
	if changed("events-topic") || cfg.Events.Topic == "" {
		cfg.Events.Topic = fl.eventsTopic
	}
	if cfg.Events.Enable {
		if err := cfg.Events.Validate(); err != nil {
			return cfg, err
		}
	}
	return cfg, nil
}

// run is kvstore's RunE: serve until the command's context is cancelled
// (SIGINT, SIGTERM), then shut down.
func (fl *kvstoreFlags) run(cmd *cobra.Command) error {
	cfg, err := fl.config(cmd)
	if err != nil {
		return err
	}
	log := newLogger(cmd)
	cfg.Logger = log
	ctx := cmd.Context()
	svc, err := kvstore.Start(ctx, cfg)
	if err != nil {
		return err
	}
	args := []any{"api", "http://" + svc.Addr().String(), "memory_bytes", cfg.Store.MemoryBytes, "model", cfg.Model}
	if a := svc.LMAddr(); a != nil {
		args = append(args, "lm", "lm://"+a.String())
	}
	if cfg.Store.DiskDir != "" {
		args = append(args, "disk_dir", cfg.Store.DiskDir, "disk_bytes", cfg.Store.DiskBytes)
	}
	if p := svc.Publisher(); p != nil {
		args = append(args, "events", "tcp://"+p.Addr().String(), "topic", p.Config().Topic)
		if r := p.ReplayAddr(); r != nil {
			args = append(args, "replay", "tcp://"+r.String())
		}
	}
	if cfg.Redis.URL != "" {
		args = append(args, "redis", "on")
	}
	log.Info("kvstore listening", args...)
	select {
	case <-ctx.Done():
		err = nil
	case err = <-svc.Err():
	}
	log.Info("kvstore shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if cerr := svc.Close(sctx); err == nil {
		err = cerr
	}
	log.Info("kvstore stopped")
	return err
}
