package kvstore

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/semaphore"
)

// LMCache's lm:// protocol (docs/PROTOCOLS.md §6.2; lmcache/v1/protocol.py,
// lmcache/v1/server/__main__.py@0e65d2fc): one persistent TCP connection per
// client, requests in series. Every integer is a native (little-endian)
// int32.

// Commands of the client header.
const (
	LMPut    = 1
	LMGet    = 2
	LMExist  = 3
	LMList   = 4 // not implemented by LMCache's server either: answered FAIL
	LMHealth = 5
)

// Codes of the server reply.
const (
	LMSuccess = 200
	LMFail    = 400
)

// Sizes of the headers, in bytes.
const (
	LMKeyBytes    = 150
	LMHeaderBytes = 9*4 + LMKeyBytes // 186
	LMReplyBytes  = 9 * 4            // 36
)

// LMHeader is the client header ClientMetaMessage: command, length, fmt,
// dtype, location, shape0..3 (9 × int32 LE), then the key (150 bytes,
// UTF-8, right-padded with spaces).
type LMHeader struct {
	Command, Length, Fmt, Dtype, Location int32
	Shape                                 [4]int32
	// Key is the key with surrounding whitespace stripped (the server
	// strips it, as LMCache's does).
	Key string
}

// ParseLMHeader reads a client header from exactly LMHeaderBytes bytes. It
// fails on another length or a key that is empty after stripping; it
// reads nothing else and never panics.
func ParseLMHeader(b []byte) (LMHeader, error) {
	if len(b) != LMHeaderBytes {
		return LMHeader{}, fmt.Errorf("lm: header of %d bytes, want %d", len(b), LMHeaderBytes)
	}
	i32 := func(i int) int32 { return int32(binary.LittleEndian.Uint32(b[4*i:])) }
	h := LMHeader{Command: i32(0), Length: i32(1), Fmt: i32(2), Dtype: i32(3), Location: i32(4),
		Shape: [4]int32{i32(5), i32(6), i32(7), i32(8)}}
	h.Key = strings.TrimSpace(string(b[36:]))
	return h, nil
}

// AppendLMHeader appends h's 186 bytes (the key space-padded; a key over
// 150 bytes is cut).
func AppendLMHeader(dst []byte, h LMHeader) []byte {
	for _, v := range []int32{h.Command, h.Length, h.Fmt, h.Dtype, h.Location, h.Shape[0], h.Shape[1], h.Shape[2], h.Shape[3]} {
		dst = binary.LittleEndian.AppendUint32(dst, uint32(v))
	}
	k := h.Key
	if len(k) > LMKeyBytes {
		k = k[:LMKeyBytes]
	}
	dst = append(dst, k...)
	for range LMKeyBytes - len(k) {
		dst = append(dst, ' ')
	}
	return dst
}

// LMReply is the server reply ServerMetaMessage: code, length, fmt,
// dtype, shape0..3, location (9 × int32 LE).
type LMReply struct {
	Code, Length, Fmt, Dtype int32
	Shape                    [4]int32
	Location                 int32
}

// AppendLMReply appends r's 36 bytes.
func AppendLMReply(dst []byte, r LMReply) []byte {
	for _, v := range []int32{r.Code, r.Length, r.Fmt, r.Dtype, r.Shape[0], r.Shape[1], r.Shape[2], r.Shape[3], r.Location} {
		dst = binary.LittleEndian.AppendUint32(dst, uint32(v))
	}
	return dst
}

// ParseLMReply reads a server reply from exactly LMReplyBytes bytes.
func ParseLMReply(b []byte) (LMReply, error) {
	if len(b) != LMReplyBytes {
		return LMReply{}, fmt.Errorf("lm: reply of %d bytes, want %d", len(b), LMReplyBytes)
	}
	i32 := func(i int) int32 { return int32(binary.LittleEndian.Uint32(b[4*i:])) }
	return LMReply{Code: i32(0), Length: i32(1), Fmt: i32(2), Dtype: i32(3),
		Shape: [4]int32{i32(4), i32(5), i32(6), i32(7)}, Location: i32(8)}, nil
}

// lmEmpty is the reply LMCache's server sends with no object: length 0,
// fmt 1 (KV_2LTD), dtype 2 (float16), shape zeros.
func lmEmpty(code int32) LMReply { return LMReply{Code: code, Fmt: 1, Dtype: 2} }

// Defaults of LMConfig.
const (
	DefaultLMIdleTimeout = 5 * time.Minute
	DefaultLMIOTimeout   = 60 * time.Second
	DefaultLMMaxConns    = 64
	// DefaultLMMaxPutBytes is LMConfig.MaxPutBytes's default.
	DefaultLMMaxPutBytes = 512 << 20
)

// LMConfig configures an LMServer. Zero fields take defaults.
type LMConfig struct {
	// IdleTimeout bounds the wait for the next request's header on a
	// connection (LMCache keeps its connection open between requests);
	// IOTimeout bounds reading the rest of a request (header and payload)
	// once it began, and writing a reply.
	IdleTimeout, IOTimeout time.Duration
	// MaxConns bounds concurrent connections. One more takes the place of
	// the connection idle the longest, and is closed at accept when none is
	// idle (all are being served).
	MaxConns int
	// MaxPutBytes bounds the PUT payloads being received at once over all
	// connections (default 512 MiB, and never more than the store's memory
	// tier): a PUT waits up to IOTimeout for its length's share, then its
	// connection is closed, so that connections announcing large objects
	// cannot together hold more memory than the store has.
	MaxPutBytes int64
	Logger      *slog.Logger
}

// LMStats are an LMServer's counters.
type LMStats struct {
	// Evicted counts idle connections closed to make room for a new one
	// (MaxConns reached); Rejected new ones refused when none was idle.
	Conns, Rejected, Evicted, Requests, Puts, Gets, GetHits, Exists, Health, Failed, Panics uint64
}

// LMServer serves LMCache's lm:// protocol over a Store: PUT stores the
// payload with its fmt/dtype/shape/location (no reply), GET returns them
// with the bytes (FAIL for a key not held or held without bytes), EXIST
// answers SUCCESS for a key held with bytes, HEALTH SUCCESS; LIST and
// unknown commands FAIL (LMCache's server sends nothing for them, leaving its
// client waiting). A PUT whose length is negative or over the store's
// object bound, or a connection that idles or stalls past its timeouts,
// is closed; a panic ends its connection only.
type LMServer struct {
	store *Store
	cfg   LMConfig

	mu sync.Mutex
	ln net.Listener
	// conns maps each connection to when it began waiting for its next
	// request (its idle time; 0 while it is being served).
	conns  map[net.Conn]*atomic.Int64
	closed bool
	wg     sync.WaitGroup

	putBytes *semaphore.Weighted // MaxPutBytes

	conn, rejected, evicted, requests, puts, gets, getHits, exists, health, failed, panics atomic.Uint64
}

// NewLMServer returns a server over store.
func NewLMServer(store *Store, cfg LMConfig) *LMServer {
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = DefaultLMIdleTimeout
	}
	if cfg.IOTimeout <= 0 {
		cfg.IOTimeout = DefaultLMIOTimeout
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = DefaultLMMaxConns
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.MaxPutBytes <= 0 {
		cfg.MaxPutBytes = DefaultLMMaxPutBytes
	}
	// Never more than the memory tier, where every PUT lands first.
	cfg.MaxPutBytes = min(cfg.MaxPutBytes, max(store.cfg.MemoryBytes, 1<<20))
	return &LMServer{store: store, cfg: cfg, conns: map[net.Conn]*atomic.Int64{}, putBytes: semaphore.NewWeighted(cfg.MaxPutBytes)}
}

// Stats returns the server's counters.
func (s *LMServer) Stats() LMStats {
	return LMStats{Conns: s.conn.Load(), Rejected: s.rejected.Load(), Evicted: s.evicted.Load(), Requests: s.requests.Load(), Puts: s.puts.Load(),
		Gets: s.gets.Load(), GetHits: s.getHits.Load(), Exists: s.exists.Load(), Health: s.health.Load(),
		Failed: s.failed.Load(), Panics: s.panics.Load()}
}

// Serve accepts connections on ln until Close; it returns nil after Close.
func (s *LMServer) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = ln.Close()
		return nil
	}
	s.ln = ln
	s.mu.Unlock()
	var backoff time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, syscallEMFILE) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				time.Sleep(backoff)
				continue
			}
			return err
		}
		backoff = 0
		s.mu.Lock()
		if !s.closed && len(s.conns) >= s.cfg.MaxConns {
			s.evictIdle()
		}
		if s.closed || len(s.conns) >= s.cfg.MaxConns {
			s.mu.Unlock()
			s.rejected.Add(1)
			_ = c.Close()
			continue
		}
		idle := new(atomic.Int64)
		s.conns[c] = idle
		s.wg.Add(1)
		s.mu.Unlock()
		s.conn.Add(1)
		go s.handle(c, idle)
	}
}

// Close stops accepting, closes every connection and waits for their
// goroutines.
func (s *LMServer) Close() error {
	s.mu.Lock()
	s.closed = true
	if s.ln != nil {
		_ = s.ln.Close()
	}
	for c := range s.conns {
		_ = c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

// evictIdle closes the connection idle the longest, if one is idle (not
// being served), to make room for a new one: connections that only hold
// their place cannot keep clients out (as a proxy reuses its oldest idle
// keep-alive connection). s.mu is held.
func (s *LMServer) evictIdle() {
	var oldest net.Conn
	var since int64
	for c, idle := range s.conns {
		if t := idle.Load(); t != 0 && (oldest == nil || t < since) {
			oldest, since = c, t
		}
	}
	if oldest != nil {
		_ = oldest.Close() // its handler sees the close and deletes it
		delete(s.conns, oldest)
		s.evicted.Add(1)
	}
}

func (s *LMServer) handle(c net.Conn, idle *atomic.Int64) {
	defer func() {
		if r := recover(); r != nil {
			s.panics.Add(1)
			s.cfg.Logger.Error("kvstore: lm:// connection panicked", "remote", c.RemoteAddr(), "panic", r, "stack", string(debug.Stack()))
		}
		_ = c.Close()
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		s.wg.Done()
	}()
	r := bufio.NewReaderSize(c, 64<<10)
	hdr := make([]byte, LMHeaderBytes)
	out := make([]byte, 0, LMReplyBytes)
	for {
		_ = c.SetReadDeadline(time.Now().Add(s.cfg.IdleTimeout))
		idle.Store(time.Now().UnixNano())
		if _, err := r.Peek(1); err != nil {
			return // EOF, idle timeout or a closed connection
		}
		idle.Store(0)
		_ = c.SetReadDeadline(time.Now().Add(s.cfg.IOTimeout))
		if _, err := io.ReadFull(r, hdr); err != nil {
			return // a short header
		}
		h, _ := ParseLMHeader(hdr) // cannot fail on LMHeaderBytes bytes
		s.requests.Add(1)
		reply, data, ok := s.serve(r, c, &h)
		if !ok {
			return
		}
		if reply == nil {
			continue // PUT: no reply
		}
		_ = c.SetWriteDeadline(time.Now().Add(s.cfg.IOTimeout))
		out = AppendLMReply(out[:0], *reply)
		if _, err := c.Write(out); err != nil {
			return
		}
		if len(data) > 0 {
			if _, err := c.Write(data); err != nil {
				return
			}
		}
	}
}

// serve answers one request: the reply (nil for none) and its payload;
// ok false closes the connection.
func (s *LMServer) serve(r io.Reader, c net.Conn, h *LMHeader) (*LMReply, []byte, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.IOTimeout)
	defer cancel()
	fail := func() (*LMReply, []byte, bool) {
		s.failed.Add(1)
		rep := lmEmpty(LMFail)
		return &rep, nil, true
	}
	switch h.Command {
	case LMPut:
		s.puts.Add(1)
		if h.Length < 0 || int64(h.Length) > min(s.store.cfg.MaxObjectBytes, s.cfg.MaxPutBytes) {
			s.failed.Add(1)
			s.cfg.Logger.Warn("kvstore: lm:// PUT over the object bound; connection closed", "remote", c.RemoteAddr(),
				"length", h.Length, "max", min(s.store.cfg.MaxObjectBytes, s.cfg.MaxPutBytes))
			return nil, nil, false
		}
		if err := s.putBytes.Acquire(ctx, int64(h.Length)); err != nil {
			s.failed.Add(1)
			s.cfg.Logger.Warn("kvstore: lm:// PUT waited too long for memory to receive it; connection closed", "remote", c.RemoteAddr(),
				"length", h.Length)
			return nil, nil, false
		}
		data, err := readN(r, int(h.Length))
		s.putBytes.Release(int64(h.Length))
		if err != nil {
			return nil, nil, false
		}
		it := Item{Key: h.Key, Data: data, Meta: Meta{Fmt: h.Fmt, Dtype: h.Dtype, Shape: h.Shape, Location: h.Location}}
		if _, err := s.store.Put(ctx, []Item{it}); err != nil {
			// No reply in the protocol: the client learns of it on GET.
			s.failed.Add(1)
			s.cfg.Logger.Warn("kvstore: lm:// PUT not stored", "key", h.Key, "err", err)
		}
		return nil, nil, true
	case LMGet:
		s.gets.Add(1)
		m, data, found, err := s.store.Get(ctx, h.Key, true)
		if err != nil || !found || !m.HasData || int64(len(data)) != m.Size || m.Size > 1<<31-1 {
			return fail()
		}
		s.getHits.Add(1)
		return &LMReply{Code: LMSuccess, Length: int32(len(data)), Fmt: m.Fmt, Dtype: m.Dtype, Shape: m.Shape}, data, true
	case LMExist:
		s.exists.Add(1)
		if !s.store.HeldWithData(h.Key) {
			return fail()
		}
		rep := lmEmpty(LMSuccess)
		return &rep, nil, true
	case LMHealth:
		s.health.Add(1)
		rep := lmEmpty(LMSuccess)
		return &rep, nil, true
	}
	return fail() // LIST, unknown commands
}

// readN reads exactly n bytes, growing its buffer as they arrive (a client
// that announces much and sends little holds little).
func readN(r io.Reader, n int) ([]byte, error) {
	const chunk = 1 << 20
	buf := make([]byte, 0, min(n, chunk))
	for len(buf) < n {
		if len(buf) == cap(buf) {
			buf = append(buf[:cap(buf)], make([]byte, min(n-len(buf), max(cap(buf), chunk)))...)[:len(buf)]
		}
		k, err := io.ReadFull(r, buf[len(buf):min(cap(buf), n)])
		buf = buf[:len(buf)+k]
		if err != nil {
			return nil, err
		}
	}
	return buf, nil
}
