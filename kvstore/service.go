package kvstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/kvevents/kvevent"
)

// ServiceConfig configures a Service: the store, its listeners, its event
// stream and its optional Redis tier.
type ServiceConfig struct {
	// Store configures the store (its Events and Remote are the
	// service's).
	Store Config
	// Listen is the native API's address (host:port; port 0 picks one).
	Listen string
	API    APIConfig
	// LMListen, when set, is the lm:// listener's address.
	LMListen string
	LM       LMConfig
	// Events is the event publisher (vLLM's --kv-events-config fields).
	// With Enable unset no events are published. Topic defaults to
	// DefaultTopic(Model).
	Events kvevents.PublisherConfig
	// Redis, when its URL is set, is the shared Redis tier.
	Redis RedisConfig
	// Model is the model whose keys the event stream carries ("" for
	// every key with a known hash; Store.EventModel).
	Model  string
	Logger *slog.Logger
}

// DefaultTopic is the event topic of a store serving model, in llm-d's
// convention kv@<pod>@<model> with "kvstore" for the pod.
func DefaultTopic(model string) string { return "kv@kvstore@" + model }

// ServiceStats are a service's counters: the store's, the lm:// server's,
// the publisher's and the Redis tier's.
type ServiceStats struct {
	Store  Stats                    `json:"store"`
	LM     *LMStats                 `json:"lm,omitempty"`
	Events *kvevents.PublisherStats `json:"events,omitempty"`
	Redis  *RedisStats              `json:"redis,omitempty"`
}

// Service runs a Store with the native API, the lm:// server, the event
// publisher and the Redis indexer.
type Service struct {
	cfg   ServiceConfig
	Store *Store
	pub   *kvevents.Publisher
	redis *Redis
	lm    *LMServer
	http  *http.Server
	apiLn net.Listener
	lmLn  net.Listener

	cancel context.CancelFunc
	wg     sync.WaitGroup
	errc   chan error
	once   sync.Once
}

// Start opens the service's listeners and starts serving.
func Start(ctx context.Context, cfg ServiceConfig) (_ *Service, err error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &Service{cfg: cfg, errc: make(chan error, 3)}
	defer func() {
		if err != nil {
			s.closeAll()
		}
	}()
	sc := cfg.Store
	sc.Logger = cfg.Logger
	sc.EventModel = cfg.Model
	if cfg.Events.Enable {
		ec := cfg.Events
		if ec.Topic == "" {
			ec.Topic = DefaultTopic(cfg.Model)
		}
		if s.pub, err = kvevents.NewPublisher(ec); err != nil {
			return nil, err
		}
		pub := s.pub
		sc.Events = func(evs []kvevent.Event) {
			publishSplit(pub, float64(time.Now().UnixNano())/1e9, evs)
		}
	}
	if cfg.Redis.URL != "" {
		rc := cfg.Redis
		if rc.Logger == nil {
			rc.Logger = cfg.Logger
		}
		if rc.MaxObjectBytes <= 0 {
			rc.MaxObjectBytes = sc.withDefaults().MaxObjectBytes
		}
		if s.redis, err = NewRedis(ctx, rc); err != nil {
			return nil, err
		}
		sc.Remote = s.redis
	}
	if s.Store, err = New(sc); err != nil {
		return nil, err
	}
	if s.apiLn, err = net.Listen("tcp", cfg.Listen); err != nil {
		return nil, fmt.Errorf("kvstore: listen %s: %w", cfg.Listen, err)
	}
	if cfg.LMListen != "" {
		if s.lmLn, err = net.Listen("tcp", cfg.LMListen); err != nil {
			return nil, fmt.Errorf("kvstore: lm:// listen %s: %w", cfg.LMListen, err)
		}
	}
	ac := cfg.API
	if ac.Logger == nil {
		ac.Logger = cfg.Logger
	}
	s.http = NewAPI(s.Store, ac, func() any { return s.Stats() }).Server()
	rctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := s.http.Serve(s.apiLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.errc <- fmt.Errorf("kvstore: native API: %w", err)
		}
	}()
	if s.lmLn != nil {
		lc := cfg.LM
		if lc.Logger == nil {
			lc.Logger = cfg.Logger
		}
		s.lm = NewLMServer(s.Store, lc)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			if err := s.lm.Serve(s.lmLn); err != nil {
				s.errc <- fmt.Errorf("kvstore: lm:// server: %w", err)
			}
		}()
	}
	if s.redis != nil {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			_ = s.redis.Run(rctx, s.Store)
		}()
	}
	return s, nil
}

// Addr is the native API's address.
func (s *Service) Addr() net.Addr { return s.apiLn.Addr() }

// LMAddr is the lm:// listener's address, or nil.
func (s *Service) LMAddr() net.Addr {
	if s.lmLn == nil {
		return nil
	}
	return s.lmLn.Addr()
}

// Publisher is the event publisher, or nil.
func (s *Service) Publisher() *kvevents.Publisher { return s.pub }

// Redis is the Redis tier, or nil.
func (s *Service) Redis() *Redis { return s.redis }

// Err receives a server's failure (a listener that stopped accepting).
func (s *Service) Err() <-chan error { return s.errc }

// Stats returns the service's counters.
func (s *Service) Stats() ServiceStats {
	st := ServiceStats{Store: s.Store.Stats()}
	if s.lm != nil {
		l := s.lm.Stats()
		st.LM = &l
	}
	if s.pub != nil {
		p := s.pub.Stats()
		st.Events = &p
	}
	if s.redis != nil {
		r := s.redis.Stats()
		st.Redis = &r
	}
	return st
}

// Close shuts the service down: the native API finishes its requests
// within ctx (then its connections are closed), lm:// connections are
// closed, the indexer stops, the publisher sends what it queued and the
// store is closed (the disk tier's files removed). Idempotent.
func (s *Service) Close(ctx context.Context) error {
	var err error
	s.once.Do(func() {
		if s.http != nil {
			if e := s.http.Shutdown(ctx); e != nil {
				_ = s.http.Close()
			}
		}
		err = s.closeAll()
	})
	return err
}

func (s *Service) closeAll() error {
	if s.http == nil && s.apiLn != nil {
		_ = s.apiLn.Close()
	}
	if s.lm != nil {
		_ = s.lm.Close()
	} else if s.lmLn != nil {
		_ = s.lmLn.Close()
	}
	if s.cancel != nil {
		s.cancel()
	}
	if s.redis != nil {
		_ = s.redis.Close()
	}
	s.wg.Wait()
	var err error
	if s.Store != nil {
		err = s.Store.Close()
	}
	if s.pub != nil {
		_ = s.pub.Close()
	}
	return err
}

// maxBatchTokens bounds the token ids of one published batch: a put of
// thousands of blocks with thousands of token ids each would otherwise be
// one message of tens of MiB, over what subscribers accept (the gateway's
// default kv_events max_message_bytes is 8 MiB) and heavy in the replay
// buffer. 256k token ids are at most ~1.3 MiB on the wire.
const maxBatchTokens = 256 << 10

// publishSplit publishes evs in batches of at most maxBatchTokens token ids
// (a single event over it alone), in order.
func publishSplit(pub *kvevents.Publisher, ts float64, evs []kvevent.Event) {
	start, tokens := 0, 0
	for i := range evs {
		n := len(evs[i].TokenIDs)
		if i > start && tokens+n > maxBatchTokens {
			pub.Publish(ts, evs[start:i])
			start, tokens = i, 0
		}
		tokens += n
	}
	if start < len(evs) {
		pub.Publish(ts, evs[start:])
	}
}
