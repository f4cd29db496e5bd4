package simserver

import (
	"fmt"
	"net"
	"net/http"
	"strconv"
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
	// Members describe the engines for a gateway's configuration, in the
	// order of URLs: URL, P/D role, bootstrap address, engine id.
	Members []FleetMember

	// Remote is the fleet's shared remote KV tier (cfg.KVRemote), nil
	// when off: every engine writes through to it and loads from it, and
	// it publishes its own KV events (RemoteStore.KVEventEndpoints).
	Remote *RemoteStore

	https []*http.Server
	wg    sync.WaitGroup
	once  sync.Once
}

// FleetEngine is what varies between the engines of StartFleetEngines.
type FleetEngine struct {
	// Role is the engine's P/D role (PDConfig.Role).
	Role Role
	// BootstrapAddr is the listen address of its bootstrap listener
	// (PDConfig.BootstrapAddr); a prefill engine without one gets one on
	// a free loopback port ("127.0.0.1:0"), as SGLang's and vLLM
	// Mooncake's prefill servers run theirs.
	BootstrapAddr string
}

// FleetMember is one engine of a fleet as a gateway is configured with it.
type FleetMember struct {
	// URL is the engine's base URL, "http://127.0.0.1:PORT".
	URL string
	// Role is its P/D role.
	Role Role
	// BootstrapAddr is its bootstrap listener's host:port ("" when it has
	// none): SGLang's bootstrap_host/bootstrap_port, vLLM Mooncake's
	// remote_bootstrap_addr (as "http://" + it).
	BootstrapAddr string
	// EngineID is its engine id (kv_transfer_params remote_engine_id).
	EngineID string
}

// StartFleet starts n engines configured by cfg on 127.0.0.1 ephemeral ports.
// Replicas share the seed, so a prompt gets the same output on any of them.
// With cfg.KVRemote the engines share one remote store (Fleet.Remote).
// Each engine has cfg.PD's role; a non-zero bootstrap port is offset by
// the engine's index.
func StartFleet(n int, cfg ServerConfig) (*Fleet, error) {
	if n < 1 {
		return nil, fmt.Errorf("sim: fleet size must be >= 1, got %d", n)
	}
	engines := make([]FleetEngine, n)
	for i := range engines {
		engines[i] = FleetEngine{Role: cfg.PD.Role, BootstrapAddr: offsetAddrPort(cfg.PD.BootstrapAddr, i)}
	}
	return StartFleetEngines(cfg, engines)
}

// StartPDFleet starts prefill engines then decode engines (roles
// RolePrefill and RoleDecode; the prefill engines with bootstrap
// listeners on free loopback ports), as `infergate up --pd P:D` runs them.
func StartPDFleet(prefill, decode int, cfg ServerConfig) (*Fleet, error) {
	if prefill < 1 || decode < 1 {
		return nil, fmt.Errorf("sim: a P/D fleet needs at least one prefill and one decode engine, got %d:%d", prefill, decode)
	}
	engines := make([]FleetEngine, 0, prefill+decode)
	for range prefill {
		engines = append(engines, FleetEngine{Role: RolePrefill})
	}
	for range decode {
		engines = append(engines, FleetEngine{Role: RoleDecode})
	}
	return StartFleetEngines(cfg, engines)
}

// StartFleetEngines starts one engine configured by cfg per element of
// engines, with that element's role and bootstrap listener, on 127.0.0.1
// ephemeral ports (as StartFleet).
func StartFleetEngines(cfg ServerConfig, engines []FleetEngine) (*Fleet, error) {
	n := len(engines)
	if n < 1 {
		return nil, fmt.Errorf("sim: fleet size must be >= 1, got %d", n)
	}
	cfg, err := loadTokenizerOnce(cfg)
	if err != nil {
		return nil, err
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
	engineID := cfg.PD.EngineID
	for i := range n {
		cfg.PD.Role, cfg.PD.BootstrapAddr = engines[i].Role, engines[i].BootstrapAddr
		if cfg.PD.Role == RolePrefill && cfg.PD.BootstrapAddr == "" {
			cfg.PD.BootstrapAddr = "127.0.0.1:0"
		}
		cfg.PD.AdvertiseAddr = "" // each its own listener's
		if engineID != "" && n > 1 {
			cfg.PD.EngineID = fmt.Sprintf("%s-%d", engineID, i)
		}
		ecfg := cfg
		if cfg.PD.Role == RoleDecode {
			ecfg.Engine = cfg.Engine.ForDecode() // its own token budget (sim.PDConfig)
		}
		s, err := newServer(ecfg, i)
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
		hs := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: serverIdleTimeout}
		f.Servers = append(f.Servers, s)
		f.https = append(f.https, hs)
		f.URLs = append(f.URLs, "http://"+ln.Addr().String())
		f.Members = append(f.Members, FleetMember{URL: f.URLs[i], Role: s.Role(), BootstrapAddr: s.BootstrapAddr(), EngineID: s.EngineID()})
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

// offsetAddrPort returns host:port with the port moved up by i (a port 0,
// or an empty or unparsable address, unchanged).
func offsetAddrPort(addr string, i int) string {
	host, p, err := net.SplitHostPort(addr)
	if err != nil || i == 0 {
		return addr
	}
	port, err := strconv.Atoi(p)
	if err != nil || port == 0 {
		return addr
	}
	return net.JoinHostPort(host, strconv.Itoa(port+i))
}

// dialAddr is the ZeroMQ address to dial a socket bound at a: loopback when
// it is bound to every interface.
func dialAddr(a *net.TCPAddr) string {
	if a.IP == nil || a.IP.IsUnspecified() {
		return fmt.Sprintf("tcp://127.0.0.1:%d", a.Port)
	}
	return "tcp://" + a.String()
}
