package simserver

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	segjson "github.com/segmentio/encoding/json"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sim"
)

// The simulated side channel between prefill (P) and decode (D) servers.
// vLLM's NIXL connector handshakes over ZMQ (msgpack get_meta_msg) and
// then moves the KV by RDMA reads; its Mooncake connector and SGLang run a
// bootstrap HTTP server; a gateway speaks none of the engine-to-engine
// part. Here the data never moves (the engines are simulated: D's read
// takes the time the engine model gives it), so the side channel only
// carries what decides the read — does P still hold the blocks — and the
// end of it, on HTTP endpoints served by P's main listener and its
// bootstrap listener alike:
//
//	POST /infergate/pd/v1/read     {"remote_engine_id","remote_request_id","remote_block_ids"}
//	     → 200 {"blocks":n} when this engine (the id matches) holds exactly those blocks for that request, else 404
//	GET  /infergate/pd/v1/transfer?transfer_id=ID|room=N[&wait_ms=MS]
//	     → 200 {"remote_engine_id","remote_request_id","remote_block_ids"} once a prefill
//	       keyed so holds its blocks (a long poll, at most wait_ms, ≤ maxPDWait), else 404;
//	       503 with Retry-After at once when PDConfig.MaxWaiters polls wait already
//	POST /infergate/pd/v1/release  {"remote_engine_id"?, one of "remote_request_id","transfer_id","bootstrap_room"}
//	     → 200 {"released_blocks":n} after Engine.Release, 404 when nothing is held so
//	       (D's notification after its read: vLLM's finished-sending notification;
//	       or a gateway's, for a hold whose D never came)
//	GET  /infergate/pd/v1/info     → {"engine_id","role","bootstrap_addr","tp_size"}
//	GET  /query (bootstrap listener; main with BootstrapOnMain)
//	     → {"0":{"engine_id":"<uuid>"}} (vLLM MooncakeConnector's bootstrap query)
//
// Bodies are bounded (maxPDBody; /read's by the engine's block count,
// pdReadBodyLimit) and must arrive within PDConfig.BodyTimeout; waits are
// bounded (maxPDWait) and so is the number of waiters (PDConfig.MaxWaiters,
// beyond it 503 with Retry-After); with API keys the
// /infergate/pd/ paths need one as /v1 does (auth.go), and D sends the
// Authorization header of the request it serves.

const (
	// pdPathPrefix is the side channel's path prefix.
	pdPathPrefix = "/infergate/pd/"
	// maxPDBody bounds a side-channel body without block ids (/release):
	// a few ids of at most maxPDString bytes, JSON-escaped.
	maxPDBody = 64 << 10
	// maxPDBlockIDBytes is what one of remote_block_ids may take in a
	// /read body: an int32 and a comma (pdReadBodyLimit).
	maxPDBlockIDBytes = 12
	// serverIdleTimeout closes a keep-alive connection idle that long
	// (the fleet's and the bootstrap listener's http.Servers).
	serverIdleTimeout = 120 * time.Second
	// pdRetryAfter is the Retry-After of a 503 for too many waiters (seconds).
	pdRetryAfter = "1"
	// maxPDWait bounds a transfer long poll, whatever wait_ms asks.
	maxPDWait = 10 * time.Minute
	// maxPDAnswer bounds what D reads of P's answers.
	maxPDAnswer = 1 << 20
)

// pdHold is a finished prefill leg's blocks as the registry knows them.
type pdHold struct {
	reqID  string
	blocks []int32
	keys   []string // registry keys: reqKey(reqID) and the leg's others
}

// pdRegistry is what P holds for decode engines, by key, for the side
// channel: the driver adds holds as prefill legs finish and drops them
// when the engine no longer holds them; handlers read it and wait on it.
type pdRegistry struct {
	mu    sync.Mutex
	byKey map[string]*pdHold
	holds map[string]*pdHold // by request id
	// waits are the keys that handlers wait on; an add closes and deletes
	// the entries of its keys only, so that it wakes their waiters alone.
	waits      map[string]*pdWaitKey
	waiters    int // handlers in wait, at most maxWaiters
	maxWaiters int
}

// pdWaitKey is one key's waiters: ch is closed when a hold is added
// under the key.
type pdWaitKey struct {
	ch chan struct{}
	n  int // waiters on ch
}

func newPDRegistry(maxWaiters int) *pdRegistry {
	return &pdRegistry{byKey: map[string]*pdHold{}, holds: map[string]*pdHold{}, waits: map[string]*pdWaitKey{}, maxWaiters: maxWaiters}
}

func (r *pdRegistry) add(h *pdHold) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.holds[h.reqID] = h
	for _, k := range h.keys {
		r.byKey[k] = h // a reused transfer id or room names the latest
		if w := r.waits[k]; w != nil {
			close(w.ch)
			delete(r.waits, k)
		}
	}
}

func (r *pdRegistry) lookup(key string) *pdHold {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.byKey[key]
}

func (r *pdRegistry) dropLocked(h *pdHold) {
	delete(r.holds, h.reqID)
	for _, k := range h.keys {
		if r.byKey[k] == h {
			delete(r.byKey, k)
		}
	}
}

func (r *pdRegistry) drop(reqID string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if h := r.holds[reqID]; h != nil {
		r.dropLocked(h)
	}
}

// sweep drops the holds the engine no longer has (expired, aborted).
func (r *pdRegistry) sweep(holds func(id string) bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, h := range r.holds {
		if !holds(id) {
			r.dropLocked(h)
		}
	}
}

func (r *pdRegistry) numWaiters() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.waiters
}

// numWaitKeys returns how many keys have waiters (tests watch it).
func (r *pdRegistry) numWaitKeys() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.waits)
}

func (r *pdRegistry) len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.holds)
}

// errPDWaitersFull is wait's answer when maxWaiters handlers wait already.
var errPDWaitersFull = errors.New("too many transfer waiters")

// waitOnLocked registers a waiter on key and returns its channel, or nil when
// maxWaiters wait already. The caller holds r.mu and calls unwaitLocked
// once.
func (r *pdRegistry) waitOnLocked(key string) *pdWaitKey {
	if r.waiters >= r.maxWaiters {
		return nil
	}
	r.waiters++
	w := r.waits[key]
	if w == nil {
		w = &pdWaitKey{ch: make(chan struct{})}
		r.waits[key] = w
	}
	w.n++
	return w
}

// unwaitLocked ends a waiter on key registered on w (the caller holds r.mu).
func (r *pdRegistry) unwaitLocked(key string, w *pdWaitKey) {
	r.waiters--
	w.n--
	if w.n == 0 && r.waits[key] == w {
		delete(r.waits, key) // no hold came for it: no entry stays behind
	}
}

// wait returns the hold under key, waiting up to d for one to be added
// (nil when none came, or ctx or quit ended first). A wait counts against
// maxWaiters while it lasts; beyond it wait returns errPDWaitersFull at
// once. A hold already there is returned without waiting.
func (r *pdRegistry) wait(ctx context.Context, quit <-chan struct{}, key string, d time.Duration) (*pdHold, error) {
	r.mu.Lock()
	if h := r.byKey[key]; h != nil || d <= 0 {
		r.mu.Unlock()
		return h, nil
	}
	w := r.waitOnLocked(key)
	r.mu.Unlock()
	if w == nil {
		return nil, errPDWaitersFull
	}
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-w.ch:
		case <-t.C:
		case <-ctx.Done():
		case <-quit:
		}
		r.mu.Lock()
		r.unwaitLocked(key, w)
		h := r.byKey[key]
		if h != nil || ctx.Err() != nil || !isClosed(w.ch) {
			// Held; or the timer, ctx or quit ended the wait (a hold
			// added at the same moment is still taken).
			r.mu.Unlock()
			return h, nil
		}
		// Woken, but the hold was dropped before this waiter looked:
		// wait again, on a fresh entry (the slot was just freed).
		w = r.waitOnLocked(key)
		r.mu.Unlock()
		if w == nil {
			return nil, errPDWaitersFull
		}
	}
}

// isClosed reports whether ch is closed.
func isClosed(ch chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// pdRoutes registers the side channel on mux.
func (s *Server) pdRoutes(mux *http.ServeMux, bootstrap bool) {
	mux.HandleFunc("POST "+pdPathPrefix+"v1/read", s.pdRunning(s.handlePDRead))
	mux.HandleFunc("GET "+pdPathPrefix+"v1/transfer", s.pdRunning(s.handlePDTransfer))
	mux.HandleFunc("POST "+pdPathPrefix+"v1/release", s.pdRunning(s.handlePDRelease))
	mux.HandleFunc("GET "+pdPathPrefix+"v1/info", s.handlePDInfo)
	if bootstrap {
		mux.HandleFunc("GET /query", s.handleBootstrapQuery)
	}
}

// pdRunning answers 503 for h while the engine is not running (nothing
// it holds can be read then).
func (s *Server) pdRunning(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-s.done:
			openai.WriteError(w, errShutdown)
			return
		default:
		}
		if !s.started.Load() {
			openai.WriteError(w, openai.NewError(http.StatusServiceUnavailable, "the simulated engine is not running", "", ""))
			return
		}
		h(w, r)
	}
}

func pdNotFound(msg string) *openai.Error {
	return openai.NewError(http.StatusNotFound, msg, "", "not_found")
}

// readPDBody decodes a side-channel body of at most limit bytes into v.
// The body must arrive within PDConfig.BodyTimeout (a per-request read
// deadline: the main listener's other handlers read longer bodies), else
// 408 and the connection is closed.
func (s *Server) readPDBody(w http.ResponseWriter, r *http.Request, limit int64, v any) *openai.Error {
	rc := http.NewResponseController(w)
	deadline := rc.SetReadDeadline(time.Now().Add(s.pd.BodyTimeout)) == nil
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if deadline && err == nil {
		// Read in full: the connection's background read (its client gone)
		// must not time out while the handler works.
		_ = rc.SetReadDeadline(time.Time{})
	}
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return openai.NewError(http.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds %d bytes", tooBig.Limit), "", openai.CodeRequestTooLarge)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			w.Header().Set("Connection", "close")
			return openai.NewError(http.StatusRequestTimeout, fmt.Sprintf("request body not received within %v", s.pd.BodyTimeout), "", "request_timeout")
		}
		return openai.NewError(http.StatusBadRequest, "reading request body: "+err.Error(), "", "")
	}
	if b := bytes.TrimSpace(body); len(b) == 0 || b[0] != '{' {
		return openai.NewError(http.StatusBadRequest, "request body must be a JSON object", "", openai.CodeInvalidJSON)
	}
	if openai.TooDeep(body) {
		return openai.NewError(http.StatusBadRequest, "request body nests too deep", "", openai.CodeInvalidJSON)
	}
	if _, err := segjson.Parse(body, v, segjson.DontMatchCaseInsensitiveStructFields); err != nil {
		return openai.NewError(http.StatusBadRequest, "invalid request body: "+err.Error(), "", openai.CodeInvalidJSON)
	}
	return nil
}

// pdReadBodyLimit bounds a /read body on an engine of numBlocks KV
// blocks: a hold names at most that many (each an int32), besides the
// ids maxPDBody allows for.
func pdReadBodyLimit(numBlocks int) int64 {
	return maxPDBody + maxPDBlockIDBytes*int64(min(max(numBlocks, 0), MaxRemoteBlockIDs))
}

// pdKeyBody names a hold: the fields of /read and /release.
type pdKeyBody struct {
	RemoteEngineID  json.RawMessage `json:"remote_engine_id"`
	RemoteRequestID json.RawMessage `json:"remote_request_id"`
	RemoteBlockIDs  json.RawMessage `json:"remote_block_ids"`
	TransferID      json.RawMessage `json:"transfer_id"`
	BootstrapRoom   json.RawMessage `json:"bootstrap_room"`
}

// key returns the registry key b names and its engine id ("" if none).
func (b *pdKeyBody) key() (key, engineID string, e *openai.Error) {
	if engineID, e = optString(b.RemoteEngineID, "remote_engine_id"); e != nil {
		return "", "", e
	}
	reqID, e := optString(b.RemoteRequestID, "remote_request_id")
	if e != nil {
		return "", "", e
	}
	xfer, e := optString(b.TransferID, "transfer_id")
	if e != nil {
		return "", "", e
	}
	room, e := optInt(b.BootstrapRoom, "bootstrap_room", 0, 1<<63-1)
	if e != nil {
		return "", "", e
	}
	switch {
	case reqID != "":
		return reqKey(reqID), engineID, nil
	case xfer != "":
		return xferKey(xfer), engineID, nil
	case !isNull(b.BootstrapRoom):
		return roomKey(strconv.Itoa(room)), engineID, nil
	}
	return "", "", openai.Errorf("remote_request_id", "one of remote_request_id, transfer_id, bootstrap_room is required")
}

func (s *Server) handlePDRead(w http.ResponseWriter, r *http.Request) {
	var b pdKeyBody
	if e := s.readPDBody(w, r, s.pdReadBody, &b); e != nil {
		openai.WriteError(w, e)
		return
	}
	key, engineID, e := b.key()
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	blocks, e := parseBlockIDs(b.RemoteBlockIDs, "remote_block_ids")
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	if engineID != s.pd.EngineID {
		openai.WriteError(w, pdNotFound("remote_engine_id names another engine"))
		return
	}
	h := s.pdReg.lookup(key)
	if h == nil {
		openai.WriteError(w, pdNotFound("no KV blocks are held for that request"))
		return
	}
	if !slices.Equal(h.blocks, blocks) {
		openai.WriteError(w, pdNotFound("the request holds other KV blocks"))
		return
	}
	writeJSON(w, http.StatusOK, map[string]int{"blocks": len(h.blocks)})
}

// pdTransfer is /transfer's answer.
type pdTransfer struct {
	RemoteEngineID  string  `json:"remote_engine_id"`
	RemoteRequestID string  `json:"remote_request_id"`
	RemoteBlockIDs  []int32 `json:"remote_block_ids"`
}

func (s *Server) handlePDTransfer(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	xfer, room := q.Get("transfer_id"), q.Get("room")
	var key string
	switch {
	case xfer != "" && room == "" && len(xfer) <= maxPDString:
		key = xferKey(xfer)
	case room != "" && xfer == "":
		v, err := strconv.ParseInt(room, 10, 64)
		if err != nil || v < 0 {
			openai.WriteError(w, openai.Errorf("room", "room must be an integer in [0, 2^63-1]"))
			return
		}
		key = roomKey(strconv.FormatInt(v, 10))
	default:
		openai.WriteError(w, openai.Errorf("transfer_id", "one of transfer_id (at most 512 bytes) and room is required"))
		return
	}
	wait := time.Duration(0)
	if ms := q.Get("wait_ms"); ms != "" {
		v, err := strconv.ParseInt(ms, 10, 64)
		if err != nil || v < 0 {
			openai.WriteError(w, openai.Errorf("wait_ms", "wait_ms must be a non-negative integer"))
			return
		}
		wait = time.Duration(min(v, int64(maxPDWait/time.Millisecond))) * time.Millisecond
	}
	h, err := s.pdReg.wait(r.Context(), s.quit, key, wait)
	if err != nil {
		s.metrics.pdWaitRejects.Inc()
		w.Header().Set("Retry-After", pdRetryAfter)
		openai.WriteError(w, openai.NewError(http.StatusServiceUnavailable,
			fmt.Sprintf("too many transfer long polls wait on this engine (at most %d)", s.pd.MaxWaiters), "", "overloaded"))
		return
	}
	if h == nil {
		openai.WriteError(w, pdNotFound("no KV blocks are held for that transfer"))
		return
	}
	writeJSON(w, http.StatusOK, pdTransfer{RemoteEngineID: s.pd.EngineID, RemoteRequestID: h.reqID, RemoteBlockIDs: h.blocks})
}

func (s *Server) handlePDRelease(w http.ResponseWriter, r *http.Request) {
	var b pdKeyBody
	if e := s.readPDBody(w, r, maxPDBody, &b); e != nil {
		openai.WriteError(w, e)
		return
	}
	key, engineID, e := b.key()
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	if engineID != "" && engineID != s.pd.EngineID {
		openai.WriteError(w, pdNotFound("remote_engine_id names another engine"))
		return
	}
	h := s.pdReg.lookup(key)
	if h == nil {
		openai.WriteError(w, pdNotFound("no KV blocks are held for that request"))
		return
	}
	released := false
	ran := s.withEngine(func(e *sim.Engine, _ time.Duration) {
		released = e.Release(h.reqID)
		st := e.Stats()
		s.snap.Store(&st)
	})
	s.pdReg.drop(h.reqID)
	if !ran || !released {
		openai.WriteError(w, pdNotFound("no KV blocks are held for that request"))
		return
	}
	writeJSON(w, http.StatusOK, map[string]int{"released_blocks": len(h.blocks)})
}

// PDInfo is what a server advertises of its P/D side (GET
// /infergate/pd/v1/info).
type PDInfo struct {
	EngineID string `json:"engine_id"`
	Role     Role   `json:"role"`
	// BootstrapAddr is the bootstrap listener's host:port, "" when none.
	BootstrapAddr string `json:"bootstrap_addr"`
	TPSize        int    `json:"tp_size"`
}

// PDInfo returns what the server advertises of its P/D side.
func (s *Server) PDInfo() PDInfo {
	return PDInfo{EngineID: s.pd.EngineID, Role: s.pd.Role, BootstrapAddr: s.BootstrapAddr(), TPSize: max(1, s.eng.Profile.TensorParallel)}
}

func (s *Server) handlePDInfo(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.PDInfo())
}

// handleBootstrapQuery is vLLM MooncakeConnector's bootstrap query: the
// engine id per data-parallel rank (one rank here).
func (s *Server) handleBootstrapQuery(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]map[string]string{"0": {"engine_id": s.pd.EngineID}})
}

// BootstrapAddr returns the bootstrap listener's address (host:port, the
// port chosen when PDConfig.BootstrapAddr asked for 0), "" when it has
// none.
func (s *Server) BootstrapAddr() string {
	if s.bootLn == nil {
		return ""
	}
	return s.bootLn.Addr().String()
}

// EngineID returns the engine id the server names in kv_transfer_params
// and /query.
func (s *Server) EngineID() string { return s.pd.EngineID }

// Role returns the server's P/D role.
func (s *Server) Role() Role { return s.pd.Role }

// advertise returns the host and port a prefill response names:
// PDConfig.AdvertiseAddr, else the local address r came in on.
func (s *Server) advertise(r *http.Request) (string, int) {
	addr := s.pd.AdvertiseAddr
	if addr == "" {
		if a, ok := r.Context().Value(http.LocalAddrContextKey).(net.Addr); ok {
			addr = a.String()
		}
	}
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "127.0.0.1", 0
	}
	port, _ := strconv.Atoi(p)
	return host, port
}

// newPDClient returns the HTTP client of the side channel: no proxy (the
// side channel is engine to engine), bounded connections.
func newPDClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 8,
		IdleConnTimeout:     30 * time.Second,
	}}
}

// pdCall sends one side-channel request and decodes a 200 answer into
// out; it returns the status (0 when P could not be reached).
func (s *Server) pdCall(ctx context.Context, method, u, auth string, body, out any, timeout time.Duration) int {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return 0
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := s.pdClient.Do(req)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxPDAnswer))
	if err != nil {
		return 0
	}
	if resp.StatusCode == http.StatusOK && out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			return 0
		}
	}
	return resp.StatusCode
}

// pdAcquire asks P whether it holds src's blocks — for the concurrent
// flows, waiting up to PDConfig.Wait for it to — and reports whether D may
// read them, or why not (the recompute metric's reason). It fills in
// src.requestID and src.engineID from P's answer.
func (s *Server) pdAcquire(ctx context.Context, src *pdSource, auth string) (ok bool, reason string) {
	status := 0
	switch src.flow {
	case "nixl":
		body := map[string]any{"remote_engine_id": src.engineID, "remote_request_id": src.requestID, "remote_block_ids": src.blockIDs}
		status = s.pdCall(ctx, http.MethodPost, src.base+pdPathPrefix+"v1/read", auth, body, nil, s.pd.SideChannelTimeout)
	default:
		q := url.Values{"wait_ms": {strconv.FormatInt(s.pd.Wait.Milliseconds(), 10)}}
		if src.flow == "mooncake" {
			q.Set("transfer_id", src.transferID)
		} else {
			q.Set("room", src.room)
		}
		var t pdTransfer
		status = s.pdCall(ctx, http.MethodGet, src.base+pdPathPrefix+"v1/transfer?"+q.Encode(), auth, nil, &t, s.pd.Wait+s.pd.SideChannelTimeout)
		if status == http.StatusOK {
			if src.engineID != "" && t.RemoteEngineID != src.engineID {
				return false, "engine_mismatch"
			}
			src.engineID, src.requestID, src.blockIDs = t.RemoteEngineID, t.RemoteRequestID, t.RemoteBlockIDs
		}
	}
	switch status {
	case http.StatusOK:
		return true, ""
	case 0, http.StatusServiceUnavailable:
		return false, "unreachable"
	case http.StatusNotFound:
		return false, "not_held"
	}
	return false, "side_channel_error"
}

// pdRelease tells P that D read src's blocks (vLLM's finished-sending
// notification), so that P frees them.
func (s *Server) pdRelease(ctx context.Context, src *pdSource, auth string) {
	body := map[string]string{"remote_engine_id": src.engineID, "remote_request_id": src.requestID}
	if st := s.pdCall(ctx, http.MethodPost, src.base+pdPathPrefix+"v1/release", auth, body, nil, s.pd.SideChannelTimeout); st != http.StatusOK {
		s.metrics.pdNotifyFailures.Inc()
		slog.Warn("sim: P/D release notification failed", "prefill", src.base, "request", src.requestID, "status", st)
	}
}

// startBootstrap binds the bootstrap listener PDConfig.BootstrapAddr names
// (none when empty).
func (s *Server) startBootstrap() error {
	if s.pd.BootstrapAddr == "" {
		return nil
	}
	ln, err := net.Listen("tcp", s.pd.BootstrapAddr)
	if err != nil {
		return fmt.Errorf("sim: bootstrap listener: %w", err)
	}
	mux := http.NewServeMux()
	s.pdRoutes(mux, true)
	mux.HandleFunc("/", handleNotFound)
	s.bootLn = ln
	s.bootSrv = &http.Server{Handler: withAPIKeys(mux, s.cfg.APIKeys), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: serverIdleTimeout}
	return nil
}
