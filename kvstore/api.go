package kvstore

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"strconv"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/infergate/infergate/jsonscan"
)

// The native API: HTTP/1.1 and JSON, for engines (the simulated engines
// write and read through Client). Hashes are JSON numbers read as uint64
// exactly; payloads are base64 (encoding/json's []byte).
//
//	POST   /v1/blocks   PutRequest → PutResponse          batched put
//	POST   /v1/lookup   LookupRequest → LookupResponse    longest held prefix
//	GET    /v1/blocks?model=&adapter=&hash=|key=[&data=0] → BlockInfo (404 when not held)
//	DELETE /v1/blocks?model=&adapter=&hash=|key=          → DeleteResponse
//	POST   /v1/delete   DeleteRequest → DeleteResponse    batched delete
//	GET    /v1/stats    → ServiceStats
//	GET    /health      → {"status":"ok"}
//
// Errors: {"error":{"message":"…","status":N}} with 400 (malformed or
// invalid), 404, 405, 413 (body, blocks or object over a bound), 415, 503
// (busy or closing), 502 (the remote tier failed).

// Block is one block of a PutRequest, or of a BlockInfo.
type Block struct {
	// Hash is the block's chained hash (the native key with the request's
	// model and adapter), unless Key is set.
	Hash uint64 `json:"hash"`
	// Key, when set, is an opaque string key (an LMCache key) used instead
	// of model, adapter and hash.
	Key string `json:"key,omitempty"`
	// ParentBlockHash is the hash of the block before it (nil: the first
	// block of its sequence, or unknown), published as parent_block_hash.
	ParentBlockHash *uint64 `json:"parent_block_hash,omitempty"`
	// TokenIDs are its tokens (published as token_ids; at most the
	// store's MaxTokenIDs); BlockSize its block_size (0: len(TokenIDs)).
	TokenIDs  TokenIDs `json:"token_ids,omitempty"`
	BlockSize int      `json:"block_size,omitempty"`
	// Size is the declared size in bytes of a metadata-only block (Data
	// empty); with Data it must be 0 or len(Data).
	Size int64 `json:"size,omitempty"`
	// Data is the payload (base64 in JSON); empty for a metadata-only block.
	Data []byte `json:"data,omitempty"`
	// Fmt, Dtype, Shape: LMCache's tensor description, echoed (§6.2).
	Fmt   int32    `json:"fmt,omitempty"`
	Dtype int32    `json:"dtype,omitempty"`
	Shape [4]int32 `json:"shape,omitzero"`
}

// PutRequest stores blocks of one model and adapter ("" for the base model).
type PutRequest struct {
	Model   string  `json:"model"`
	Adapter string  `json:"adapter,omitempty"`
	Blocks  []Block `json:"blocks"`
}

// PutResponse counts new and replaced blocks.
type PutResponse struct {
	Stored   int `json:"stored"`
	Replaced int `json:"replaced"`
}

// LookupRequest asks how many leading blocks of a chain are held: Hashes
// (native keys under Model and Adapter) or Keys (opaque keys), in order.
type LookupRequest struct {
	Model   string   `json:"model"`
	Adapter string   `json:"adapter,omitempty"`
	Hashes  []uint64 `json:"hashes,omitempty"`
	Keys    []string `json:"keys,omitempty"`
}

// LookupResponse: Held leading blocks of the request's chain are held.
type LookupResponse struct {
	Held int `json:"held"`
}

// DeleteRequest removes blocks: Hashes under Model and Adapter, and Keys.
type DeleteRequest = LookupRequest

// DeleteResponse counts blocks that were held.
type DeleteResponse struct {
	Deleted int `json:"deleted"`
}

// BlockInfo is a GET's answer: the block's key, hash (when known) and
// metadata; Data holds its bytes unless data=0 or it has none.
type BlockInfo struct {
	Key    string `json:"key"`
	Hash   uint64 `json:"hash"`
	Hashed bool   `json:"hashed"`
	Meta
	Data []byte `json:"data,omitempty"`
}

// APIError is the native API's error body.
type APIError struct {
	Message string `json:"message"`
	Status  int    `json:"status"`
}

func (e *APIError) Error() string { return fmt.Sprintf("kvstore: %d: %s", e.Status, e.Message) }

// Defaults of APIConfig.
const (
	DefaultMaxBodyBytes      = 128 << 20
	DefaultMaxBodyBytesTotal = 512 << 20
	DefaultMaxBlocks         = 4096
	DefaultMaxInflight       = 32
	DefaultInflightWait      = 5 * time.Second
	DefaultReadHeaderTimeout = 10 * time.Second
	DefaultReadTimeout       = 60 * time.Second
	DefaultWriteTimeout      = 60 * time.Second
	DefaultIdleTimeout       = 120 * time.Second
	DefaultMaxHeaderBytes    = 64 << 10
)

// APIConfig bounds the native API. Zero fields take defaults.
type APIConfig struct {
	// MaxBodyBytes bounds a request body (base64 payloads included).
	MaxBodyBytes int64
	// MaxBodyBytesTotal bounds the bodies held in memory at once, being
	// read or served (a request is charged the bytes it has sent, as they
	// arrive); a read that finds it full waits
	// up to InflightWait, then the request gets 503. Bodies are read whole
	// before a serving slot is taken, so a slow sender holds only the bytes
	// it sent, neither a slot nor the length it announced.
	MaxBodyBytesTotal int64
	// MaxBlocks bounds the blocks, hashes or keys of one request.
	MaxBlocks int
	// MaxInflight bounds requests served at once; one more waits up to
	// InflightWait, then gets 503.
	MaxInflight  int
	InflightWait time.Duration
	// Server timeouts (http.Server's), and its header bound.
	ReadHeaderTimeout, ReadTimeout, WriteTimeout, IdleTimeout time.Duration
	MaxHeaderBytes                                            int
	Logger                                                    *slog.Logger
}

func (c APIConfig) withDefaults() APIConfig {
	def := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.MaxBodyBytesTotal <= 0 {
		c.MaxBodyBytesTotal = max(DefaultMaxBodyBytesTotal, c.MaxBodyBytes)
	}
	if c.MaxBlocks <= 0 {
		c.MaxBlocks = DefaultMaxBlocks
	}
	if c.MaxInflight <= 0 {
		c.MaxInflight = DefaultMaxInflight
	}
	def(&c.InflightWait, DefaultInflightWait)
	def(&c.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	def(&c.ReadTimeout, DefaultReadTimeout)
	def(&c.WriteTimeout, DefaultWriteTimeout)
	def(&c.IdleTimeout, DefaultIdleTimeout)
	if c.MaxHeaderBytes <= 0 {
		c.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// API is the native API's handler over a Store.
type API struct {
	store  *Store
	cfg    APIConfig
	sem    chan struct{}
	bodies *semaphore.Weighted // MaxBodyBytesTotal
	stats  func() any
}

// NewAPI returns the native API over store; stats, when set, gives
// GET /v1/stats's body (default: the store's Stats).
func NewAPI(store *Store, cfg APIConfig, stats func() any) *API {
	cfg = cfg.withDefaults()
	if stats == nil {
		stats = func() any { return store.Stats() }
	}
	return &API{store: store, cfg: cfg, sem: make(chan struct{}, cfg.MaxInflight), bodies: semaphore.NewWeighted(cfg.MaxBodyBytesTotal), stats: stats}
}

// Server returns an http.Server for the API with its timeouts and header
// bound (Serve it on a listener).
func (a *API) Server() *http.Server {
	return &http.Server{
		Handler:           a,
		ReadHeaderTimeout: a.cfg.ReadHeaderTimeout,
		ReadTimeout:       a.cfg.ReadTimeout,
		WriteTimeout:      a.cfg.WriteTimeout,
		IdleTimeout:       a.cfg.IdleTimeout,
		MaxHeaderBytes:    a.cfg.MaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(a.cfg.Logger.Handler(), slog.LevelWarn),
	}
}

// ServeHTTP routes a request.
func (a *API) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/health":
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			apiError(w, http.StatusMethodNotAllowed, "use GET")
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
		return
	case "/v1/stats":
		if r.Method != http.MethodGet {
			apiError(w, http.StatusMethodNotAllowed, "use GET")
			return
		}
		writeJSON(w, http.StatusOK, a.stats())
		return
	}
	var h func(http.ResponseWriter, *http.Request)
	switch r.URL.Path {
	case "/v1/blocks":
		switch r.Method {
		case http.MethodPost, http.MethodPut:
			h = a.put
		case http.MethodGet:
			h = a.get
		case http.MethodDelete:
			h = a.deleteOne
		default:
			apiError(w, http.StatusMethodNotAllowed, "use POST, PUT, GET or DELETE")
			return
		}
	case "/v1/lookup":
		h = a.lookup
	case "/v1/delete":
		h = a.deleteMany
	default:
		apiError(w, http.StatusNotFound, "no such path: "+r.URL.Path)
		return
	}
	if r.URL.Path != "/v1/blocks" && r.Method != http.MethodPost {
		apiError(w, http.StatusMethodNotAllowed, "use POST")
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodDelete {
		body, release, ok := a.readBody(w, r)
		if !ok {
			return
		}
		defer release()
		if overElems(body, a.cfg.MaxBlocks) {
			apiError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("a list of over %d blocks, hashes or keys; at most %d a request", a.cfg.MaxBlocks, a.cfg.MaxBlocks))
			return
		}
	}
	t := time.NewTimer(a.cfg.InflightWait)
	select {
	case a.sem <- struct{}{}:
		t.Stop()
	case <-t.C:
		w.Header().Set("Retry-After", "1")
		apiError(w, http.StatusServiceUnavailable, "busy: too many requests in flight")
		return
	case <-r.Context().Done():
		t.Stop()
		return
	}
	defer func() { <-a.sem }()
	h(w, r)
}

// readBody reads r's body whole into memory within the byte budget
// (MaxBodyBytesTotal) and gives it back to r; release returns the budget.
// The budget is charged as the bytes arrive (budgetReader), not for the
// Content-Length announced: charged up front, four connections announcing
// 128 MiB and sending nothing held the whole 512 MiB, and every other
// writer got 503 until the server's read timeout cut them.
func (a *API) readBody(w http.ResponseWriter, r *http.Request) (body []byte, release func(), ok bool) {
	n := a.cfg.MaxBodyBytes
	if r.ContentLength >= 0 {
		if r.ContentLength > a.cfg.MaxBodyBytes {
			apiError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body over %d bytes", a.cfg.MaxBodyBytes))
			return nil, nil, false
		}
		n = r.ContentLength
	}
	br := &budgetReader{r: r.Body, sem: a.bodies, ctx: r.Context(), wait: a.cfg.InflightWait}
	release = func() {
		if br.held > 0 {
			a.bodies.Release(br.held)
			br.held = 0
		}
	}
	b, err := io.ReadAll(http.MaxBytesReader(w, io.NopCloser(br), n))
	if err != nil {
		release()
		var mb *http.MaxBytesError
		switch {
		case errors.Is(err, errBodyBudget):
			w.Header().Set("Retry-After", "1")
			apiError(w, http.StatusServiceUnavailable, "busy: too many request bodies in memory")
		case errors.As(err, &mb):
			apiError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body over %d bytes", n))
		default:
			apiError(w, http.StatusBadRequest, "reading the body: "+err.Error())
		}
		return nil, nil, false
	}
	r.Body = io.NopCloser(bytes.NewReader(b))
	return b, release, true
}

// overElems reports whether a JSON object body has a member that is an
// array of more than limit elements (the blocks, hashes or keys), counted
// in the raw bytes before anything is decoded (jsonscan's walks: linear,
// allocation-free): a body of empty elements ({"blocks":[{},{},…]}: 3
// bytes each) was decoded into structs many times their size before
// len(req.Blocks) was checked (one 120 MiB put grew the process past 16
// GB). Arrays nested deeper (token_ids) are not counted here (TokenIDs
// bounds its own). A body that is not valid JSON, or nests past
// maxBodyDepth, is left to the decoder, which refuses it.
func overElems(b []byte, limit int) bool {
	over := false
	_ = jsonscan.Object(b, maxBodyDepth, func(m jsonscan.Member) bool {
		if len(m.Value) == 0 || m.Value[0] != '[' {
			return true
		}
		n := 0
		_ = jsonscan.Array(m.Value, maxBodyDepth, func([]byte) bool { n++; return n <= limit })
		over = n > limit
		return !over
	})
	return over
}

// maxBodyDepth bounds the nesting overElems walks (a request nests 4
// deep: the body, its list, an element, its token ids).
const maxBodyDepth = 32

// errBodyBudget is budgetReader's error when the body budget stayed full
// for the wait.
var errBodyBudget = errors.New("kvstore: request bodies' budget full")

// budgetReaderStep is the most budgetReader reads at once.
const budgetReaderStep = 64 << 10

// budgetReader charges sem for the bytes read through it, after each read
// of at most budgetReaderStep (waiting at most wait for them), so that a
// sender blocked mid-body holds no budget for bytes it has not sent; held
// is what it has charged. io.ReadAll holds at most twice what it read, so
// the budget bounds the memory of the bodies being read within a factor of
// two.
type budgetReader struct {
	r    io.Reader
	sem  *semaphore.Weighted
	ctx  context.Context
	wait time.Duration
	held int64
}

func (b *budgetReader) Read(p []byte) (int, error) {
	n, err := b.r.Read(p[:min(len(p), budgetReaderStep)])
	if n > 0 && !b.sem.TryAcquire(int64(n)) {
		ctx, cancel := context.WithTimeout(b.ctx, b.wait)
		aerr := b.sem.Acquire(ctx, int64(n))
		cancel()
		if aerr != nil {
			return 0, errBodyBudget
		}
	}
	b.held += int64(n)
	return n, err
}

// decode reads r's JSON body into v, bounded.
func (a *API) decode(w http.ResponseWriter, r *http.Request, v any) bool {
	if ct := r.Header.Get("Content-Type"); ct != "" && !isJSON(ct) {
		apiError(w, http.StatusUnsupportedMediaType, "body must be application/json")
		return false
	}
	body := http.MaxBytesReader(w, r.Body, a.cfg.MaxBodyBytes)
	d := json.NewDecoder(body)
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		var mb *http.MaxBytesError
		if errors.As(err, &mb) {
			apiError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body over %d bytes", a.cfg.MaxBodyBytes))
			return false
		}
		apiError(w, http.StatusBadRequest, "malformed JSON body: "+err.Error())
		return false
	}
	if _, err := d.Token(); err != io.EOF {
		apiError(w, http.StatusBadRequest, "data after the JSON body")
		return false
	}
	return true
}

func (a *API) put(w http.ResponseWriter, r *http.Request) {
	var req PutRequest
	if !a.decode(w, r, &req) {
		return
	}
	if len(req.Blocks) > a.cfg.MaxBlocks {
		apiError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("%d blocks, at most %d a request", len(req.Blocks), a.cfg.MaxBlocks))
		return
	}
	items := make([]Item, len(req.Blocks))
	for i := range req.Blocks {
		b := &req.Blocks[i]
		key, err := blockKey(req.Model, req.Adapter, b.Key, b.Hash)
		if err != nil {
			apiError(w, http.StatusBadRequest, fmt.Sprintf("block %d: %v", i, err))
			return
		}
		it := Item{Key: key, Meta: Meta{Size: b.Size, TokenIDs: b.TokenIDs, BlockSize: b.BlockSize,
			Fmt: b.Fmt, Dtype: b.Dtype, Shape: b.Shape}}
		if b.ParentBlockHash != nil {
			it.Meta.ParentHash, it.Meta.HasParent = *b.ParentBlockHash, true
		}
		if len(b.Data) > 0 {
			it.Data = b.Data
		}
		items[i] = it
	}
	res, err := a.store.Put(r.Context(), items)
	if err != nil {
		status := http.StatusBadRequest
		switch {
		case errors.Is(err, ErrTooLarge):
			status = http.StatusRequestEntityTooLarge
		case errors.Is(err, errStoreClose):
			status = http.StatusServiceUnavailable
		case !errors.Is(err, ErrInvalid):
			status = http.StatusBadGateway // the remote write-through
		}
		apiError(w, status, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, PutResponse(res))
}

func (a *API) keys(w http.ResponseWriter, req *LookupRequest) ([]string, bool) {
	if n := len(req.Hashes) + len(req.Keys); n > a.cfg.MaxBlocks {
		apiError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("%d hashes and keys, at most %d a request", n, a.cfg.MaxBlocks))
		return nil, false
	}
	keys := make([]string, 0, len(req.Hashes)+len(req.Keys))
	if len(req.Hashes) > 0 {
		k := Key{Model: req.Model, Adapter: req.Adapter}
		if err := k.Validate(); err != nil {
			apiError(w, http.StatusBadRequest, err.Error())
			return nil, false
		}
		for _, h := range req.Hashes {
			k.Hash = h
			keys = append(keys, k.String())
		}
	}
	for _, k := range req.Keys {
		if k == "" || len(k) > MaxKeyBytes {
			apiError(w, http.StatusBadRequest, fmt.Sprintf("key of %d bytes (want 1..%d)", len(k), MaxKeyBytes))
			return nil, false
		}
		keys = append(keys, k)
	}
	return keys, true
}

func (a *API) lookup(w http.ResponseWriter, r *http.Request) {
	var req LookupRequest
	if !a.decode(w, r, &req) {
		return
	}
	if len(req.Hashes) > 0 && len(req.Keys) > 0 {
		apiError(w, http.StatusBadRequest, "a lookup takes hashes or keys, not both")
		return
	}
	keys, ok := a.keys(w, &req)
	if !ok {
		return
	}
	writeJSON(w, http.StatusOK, LookupResponse{Held: a.store.Lookup(keys)})
}

func (a *API) deleteMany(w http.ResponseWriter, r *http.Request) {
	var req DeleteRequest
	if !a.decode(w, r, &req) {
		return
	}
	keys, ok := a.keys(w, &req)
	if !ok {
		return
	}
	a.deleteKeys(w, r, keys)
}

func (a *API) deleteKeys(w http.ResponseWriter, r *http.Request, keys []string) {
	n, err := a.store.Delete(r.Context(), keys)
	if err != nil {
		status := http.StatusBadGateway
		if errors.Is(err, errStoreClose) {
			status = http.StatusServiceUnavailable
		}
		apiError(w, status, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, DeleteResponse{Deleted: n})
}

// queryKey reads model, adapter and hash, or key, from the query.
func queryKey(w http.ResponseWriter, r *http.Request) (string, bool) {
	q := r.URL.Query()
	hash := uint64(0)
	if q.Get("key") == "" {
		h, err := strconv.ParseUint(q.Get("hash"), 10, 64)
		if err != nil {
			apiError(w, http.StatusBadRequest, "want hash=<uint64> (with model= and adapter=) or key=<string>")
			return "", false
		}
		hash = h
	}
	key, err := blockKey(q.Get("model"), q.Get("adapter"), q.Get("key"), hash)
	if err != nil {
		apiError(w, http.StatusBadRequest, err.Error())
		return "", false
	}
	return key, true
}

func (a *API) get(w http.ResponseWriter, r *http.Request) {
	key, ok := queryKey(w, r)
	if !ok {
		return
	}
	withData := r.URL.Query().Get("data") != "0"
	m, data, found, err := a.store.Get(r.Context(), key, withData)
	switch {
	case err != nil:
		apiError(w, http.StatusBadGateway, err.Error())
		return
	case !found:
		apiError(w, http.StatusNotFound, "not held: "+key)
		return
	}
	ki := ParseKey(key)
	writeJSON(w, http.StatusOK, BlockInfo{Key: key, Hash: ki.Hash, Hashed: ki.Hashed, Meta: m, Data: data})
}

func (a *API) deleteOne(w http.ResponseWriter, r *http.Request) {
	key, ok := queryKey(w, r)
	if !ok {
		return
	}
	a.deleteKeys(w, r, []string{key})
}

// blockKey is the string key of a block: key when set, else the native
// key of model, adapter and hash.
func blockKey(model, adapter, key string, hash uint64) (string, error) {
	if key != "" {
		if len(key) > MaxKeyBytes {
			return "", fmt.Errorf("key of %d bytes, at most %d", len(key), MaxKeyBytes)
		}
		return key, nil
	}
	k := Key{Model: model, Adapter: adapter, Hash: hash}
	if err := k.Validate(); err != nil {
		return "", err
	}
	return k.String(), nil
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status, b = http.StatusInternalServerError, []byte(`{"error":{"message":"encoding the answer failed","status":500}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

func apiError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, map[string]*APIError{"error": {Message: msg, Status: status}})
}

// isJSON reports whether a Content-Type is application/json, parameters
// (charset=utf-8) allowed.
func isJSON(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && mt == "application/json"
}

// TokenIDs are a block's token ids on the wire. Decoding counts the array's
// elements in the raw bytes before it allocates for them, and refuses more
// than MaxWireTokenIDs: a body of small numbers would otherwise decode into
// slices many times its size before the store's own bound (MaxTokenIDs)
// is checked.
type TokenIDs []uint32

// MaxWireTokenIDs bounds the token ids of one block a request may carry.
const MaxWireTokenIDs = 1 << 16

// UnmarshalJSON implements json.Unmarshaler.
func (t *TokenIDs) UnmarshalJSON(b []byte) error {
	if n := bytes.Count(b, []byte{','}) + 1; n > MaxWireTokenIDs {
		return fmt.Errorf("%d token ids, at most %d a block", n, MaxWireTokenIDs)
	}
	var v []uint32
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*t = v
	return nil
}
