package simserver

import (
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"
)

// Fleet is a set of simulated engines, each a Server on its own loopback
// listener: the embedded default fleet of `infergate up`.
type Fleet struct {
	// URLs are the engines' base URLs ("http://127.0.0.1:PORT"), in order.
	URLs []string
	// Servers are the engines, in the order of URLs.
	Servers []*Server

	// Remote is the fleet's shared remote KV tier (cfg.KVRemote), nil
	// when off: every engine writes through to it and loads from it, and
	// it publishes its own KV events (RemoteStore.KVEventEndpoints).
	Remote *RemoteStore

	https []*http.Server
	wg    sync.WaitGroup
	once  sync.Once
}

// StartFleet starts n engines configured by cfg on 127.0.0.1 ephemeral ports.
// Replicas share the seed, so a prompt gets the same output on any of them.
// With cfg.KVRemote the engines share one remote store (Fleet.Remote).
func StartFleet(n int, cfg ServerConfig) (*Fleet, error) {
	if n < 1 {
		return nil, fmt.Errorf("sim: fleet size must be >= 1, got %d", n)
	}
	f := &Fleet{}
	if cfg.KVEvents.Publishes() && cfg.KVEvents.Endpoint == "" {
		// Each engine publishes on its own loopback port, with replay.
		cfg.KVEvents.Endpoint, cfg.KVEvents.ReplayEndpoint, cfg.KVEvents.Bind = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", true
	}
	if cfg.Engine.Tiers.Remote == nil {
		r, err := newRemoteFor(cfg)
		if err != nil {
			return nil, err
		}
		if r != nil {
			f.Remote, cfg.Engine.Tiers.Remote = r, r
		}
	}
	for i := range n {
		s, err := newServer(cfg, i)
		if err != nil {
			f.Close()
			return nil, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("sim: engine %d: %w", i, err)
		}
		s.Start()
		hs := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second}
		f.Servers = append(f.Servers, s)
		f.https = append(f.https, hs)
		f.URLs = append(f.URLs, "http://"+ln.Addr().String())
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			_ = hs.Serve(ln) // http.ErrServerClosed after Close
		}()
	}
	return f, nil
}

// KVEventEndpoints returns, per engine, the addresses a subscriber dials for
// its KV events and their replay ("tcp://127.0.0.1:PORT"; "" when the
// engine publishes none or its socket connects rather than binds).
func (f *Fleet) KVEventEndpoints() (pub, replay []string) {
	pub, replay = make([]string, len(f.Servers)), make([]string, len(f.Servers))
	for i, s := range f.Servers {
		p := s.KVEventPublisher()
		if p == nil {
			continue
		}
		if a, ok := p.Addr().(*net.TCPAddr); ok {
			pub[i] = dialAddr(a)
		}
		if a, ok := p.ReplayAddr().(*net.TCPAddr); ok {
			replay[i] = dialAddr(a)
		}
	}
	return pub, replay
}

// KVBlocks is the KV capacity of each engine, in blocks.
func (f *Fleet) KVBlocks() int {
	if len(f.Servers) == 0 {
		return 0
	}
	return f.Servers[0].EngineConfig().NumBlocks
}

// BlockSize is the KV block size of each engine, in tokens.
func (f *Fleet) BlockSize() int {
	if len(f.Servers) == 0 {
		return 0
	}
	return f.Servers[0].EngineConfig().BlockSize
}

// Utilization is the engines' mean Server.Utilization (0..1).
func (f *Fleet) Utilization() float64 {
	if len(f.Servers) == 0 {
		return 0
	}
	var sum float64
	for _, s := range f.Servers {
		sum += s.Utilization()
	}
	return sum / float64(len(f.Servers))
}

// Close stops every engine (failing in-flight requests), closes the listeners
// and connections, and waits for the serving goroutines. Idempotent.
func (f *Fleet) Close() {
	f.once.Do(func() {
		for _, s := range f.Servers {
			s.Close()
		}
		for _, hs := range f.https {
			_ = hs.Close()
		}
		f.wg.Wait()
		f.Remote.close() // once no engine stores
	})
}

// dialAddr is the ZeroMQ address to dial a socket bound at a: loopback when
// it is bound to every interface.
func dialAddr(a *net.TCPAddr) string {
	if a.IP == nil || a.IP.IsUnspecified() {
		return fmt.Sprintf("tcp://127.0.0.1:%d", a.Port)
	}
	return "tcp://" + a.String()
}
