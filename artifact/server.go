package artifact

import (
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// ServerConfig bounds a Server.
type ServerConfig struct {
	// MaxConcurrent is how many requests are served at once (64); more are
	// answered 503 with Retry-After: 1.
	MaxConcurrent int
	// WriteIdle is how long one write to a client may block (30 s): a
	// client that stops reading loses its connection, however large the
	// blob.
	WriteIdle time.Duration
	// BlobRedirect, when set, answers blob GETs that arrive under another
	// host name with a 307 to the same path under this base URL (the OCI
	// distribution spec lets a registry redirect blob GETs). Ollama's pull
	// needs it: it asks for a blob expecting a 307 to a different host
	// name, then fetches ranges there (server/download.go Prepare,
	// @v0.17.4) — e.g. serve on 0.0.0.0:8200, clients use
	// http://node1:8200, BlobRedirect http://node1.local:8200.
	BlobRedirect *url.URL
	// Logger (nil: slog.Default()).
	Logger *slog.Logger
}

// Server serves a cache to peers and engines, read-only, with the OCI
// distribution API's pull endpoints (spec.md v1.1): a peer node's cache
// fetches through it (HTTP with Peer set), and so can an OCI client or
// Ollama (`ollama pull --insecure`), since the layout is its registry's.
//
//	GET  /v2/                                          200 {} (API check)
//	GET|HEAD /v2/<name>/manifests/<tag or digest>      the manifest, as fetched
//	GET|HEAD /v2/<name>/blobs/<digest>                 the blob; Range requests
//	GET  /v1/artifacts                                 the models held (JSON)
//	GET  /metrics                                      Prometheus metrics
//	GET  /health                                       {"status":"ok"}
//
// <name> is namespace/model (a model of the default host) or
// host/namespace/model. Blobs are served whatever the name, only if held
// (no fetch through). Errors carry both the OCI error list ({"errors":
// [{"code","message"}]}, which registry clients read) and the OpenAI-style
// object ({"error":{"message","type","param","code"}}).
type Server struct {
	c   *Cache
	cfg ServerConfig
	sem chan struct{}
	mux *http.ServeMux
}

// NewServer makes a Server of c.
func NewServer(c *Cache, cfg ServerConfig) *Server {
	if cfg.MaxConcurrent <= 0 {
		cfg.MaxConcurrent = 64
	}
	if cfg.WriteIdle <= 0 {
		cfg.WriteIdle = 30 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &Server{c: c, cfg: cfg, sem: make(chan struct{}, cfg.MaxConcurrent), mux: http.NewServeMux()}
	s.mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"status":"ok"}`))
	})
	s.mux.Handle("GET /metrics", promhttp.HandlerFor(c.Gatherer(), promhttp.HandlerOpts{}))
	s.mux.HandleFunc("GET /v1/artifacts", s.list)
	s.mux.HandleFunc("/v2/", s.registry)
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "NAME_UNKNOWN", "no such endpoint: "+r.URL.Path)
	})
	return s
}

// ServeHTTP bounds concurrency and serves.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	select {
	case s.sem <- struct{}{}:
		defer func() { <-s.sem }()
	default:
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, "TOOMANYREQUESTS", "too many requests in progress")
		return
	}
	s.mux.ServeHTTP(w, r)
}

// NewHTTPServer is an http.Server for s with bounded headers and header
// reads; writes are bounded per write (ServerConfig.WriteIdle), not per
// response, so large blobs stream.
func NewHTTPServer(addr string, s *Server) *http.Server {
	return &http.Server{
		Addr:              addr,
		Handler:           s,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
}

// Error codes of the OCI distribution spec (spec.md, "Error Codes").
func writeError(w http.ResponseWriter, status int, code, msg string) {
	typ := "invalid_request_error"
	if status >= 500 {
		typ = "server_error"
	} else if status == http.StatusNotFound {
		typ = "not_found_error"
	}
	body := struct {
		Errors []ociError `json:"errors"`
		Error  apiError   `json:"error"`
	}{
		Errors: []ociError{{Code: code, Message: msg}},
		Error:  apiError{Message: msg, Type: typ, Code: strings.ToLower(code)},
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(body)
}

type ociError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    string  `json:"code"`
}

// maxPathBytes bounds the registry path read.
const maxPathBytes = 1024

func (s *Server) registry(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		writeError(w, http.StatusMethodNotAllowed, "UNSUPPORTED", "the cache is read-only")
		return
	}
	p := r.URL.Path
	if p == "/v2/" || p == "/v2" {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Docker-Distribution-API-Version", "registry/2.0")
		w.Write([]byte("{}"))
		return
	}
	if len(p) > maxPathBytes {
		writeError(w, http.StatusBadRequest, "NAME_INVALID", "path too long")
		return
	}
	rest := strings.TrimPrefix(p, "/v2/")
	if name, ref, ok := cutKind(rest, "/manifests/"); ok {
		s.manifest(w, r, name, ref)
		return
	}
	if _, dg, ok := cutKind(rest, "/blobs/"); ok {
		s.blob(w, r, dg)
		return
	}
	writeError(w, http.StatusNotFound, "NAME_UNKNOWN", "want /v2/<name>/manifests/<reference> or /v2/<name>/blobs/<digest>")
}

// cutKind splits "<name><sep><last>" at the last sep; last has no slash.
func cutKind(s, sep string) (name, last string, ok bool) {
	i := strings.LastIndex(s, sep)
	if i <= 0 {
		return "", "", false
	}
	name, last = s[:i], s[i+len(sep):]
	return name, last, last != "" && !strings.Contains(last, "/")
}

func (s *Server) manifest(w http.ResponseWriter, r *http.Request, name, reference string) {
	parts := strings.Split(name, "/")
	var cands []Ref
	switch len(parts) {
	case 2:
		cands = append(cands, Ref{Host: DefaultHost, Namespace: parts[0], Model: parts[1]})
	case 3:
		cands = append(cands, Ref{Host: parts[0], Namespace: parts[1], Model: parts[2]})
	default:
		writeError(w, http.StatusNotFound, "NAME_UNKNOWN", "name must be namespace/model or host/namespace/model")
		return
	}
	var m *Manifest
	if d, err := ParseDigest(reference); err == nil {
		// By digest: any tag of the repository whose manifest has it.
		for _, mod := range s.c.Models() {
			if mod.Manifest.Digest == d && mod.Ref.Namespace == cands[0].Namespace && mod.Ref.Model == cands[0].Model &&
				(len(parts) == 2 || mod.Ref.Host == cands[0].Host) {
				m = mod.Manifest
				break
			}
		}
	} else {
		cands[0].Tag = reference
		if err := cands[0].Validate(); err != nil {
			writeError(w, http.StatusBadRequest, "NAME_INVALID", err.Error())
			return
		}
		m = s.c.Manifest(cands[0])
		if m == nil && len(parts) == 2 {
			// namespace/model of another host: the only one, if unique.
			for _, mod := range s.c.Models() {
				if mod.Ref.Namespace == cands[0].Namespace && mod.Ref.Model == cands[0].Model && mod.Ref.Tag == reference {
					if m != nil {
						writeError(w, http.StatusNotFound, "MANIFEST_UNKNOWN", "ambiguous: name the host, /v2/<host>/<namespace>/<model>/...")
						return
					}
					m = mod.Manifest
				}
			}
		}
	}
	if m == nil {
		writeError(w, http.StatusNotFound, "MANIFEST_UNKNOWN", "manifest unknown: "+name+":"+reference)
		return
	}
	w.Header().Set("Content-Type", m.MediaType())
	w.Header().Set("Docker-Content-Digest", string(m.Digest))
	w.Header().Set("Content-Length", strconv.Itoa(len(m.Raw)))
	if r.Method == http.MethodHead {
		return
	}
	w.Write(m.Raw)
}

func (s *Server) blob(w http.ResponseWriter, r *http.Request, dg string) {
	d, err := ParseDigest(dg)
	if err != nil {
		writeError(w, http.StatusBadRequest, "DIGEST_INVALID", err.Error())
		return
	}
	if rd := s.cfg.BlobRedirect; rd != nil && r.Method == http.MethodGet && !strings.EqualFold(r.Host, rd.Host) {
		if !s.c.Has(d) {
			writeError(w, http.StatusNotFound, "BLOB_UNKNOWN", "blob unknown: "+string(d))
			return
		}
		u := *rd
		u.Path = strings.TrimRight(rd.Path, "/") + r.URL.Path
		http.Redirect(w, r, u.String(), http.StatusTemporaryRedirect)
		return
	}
	f, err := s.c.OpenBlob(d)
	if err != nil {
		if errors.Is(err, ErrNotFound) || errors.Is(err, ErrIntegrity) {
			writeError(w, http.StatusNotFound, "BLOB_UNKNOWN", "blob unknown: "+string(d))
			return
		}
		s.cfg.Logger.Warn("artifact: open blob", "digest", d.Short(), "err", err)
		writeError(w, http.StatusInternalServerError, "UNKNOWN", "cannot read the blob")
		return
	}
	defer f.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Docker-Content-Digest", string(d))
	w.Header().Set("ETag", `"`+string(d)+`"`)
	w.Header().Set("Cache-Control", "max-age=31536000, immutable")
	// ServeContent answers HEAD, Range and If-Range; the blob is immutable,
	// so its modification time is irrelevant.
	http.ServeContent(&idleWriter{ResponseWriter: w, rc: http.NewResponseController(w), idle: s.cfg.WriteIdle}, r, "", time.Time{}, f)
}

// idleWriter extends the connection's write deadline before every write,
// so a stream of any length is bounded per write, not in total.
type idleWriter struct {
	http.ResponseWriter
	rc   *http.ResponseController
	idle time.Duration
}

func (w *idleWriter) Write(b []byte) (int, error) {
	_ = w.rc.SetWriteDeadline(time.Now().Add(w.idle))
	return w.ResponseWriter.Write(b)
}

// listEntry is one model in GET /v1/artifacts.
type listEntry struct {
	Model    string `json:"model"`
	Digest   string `json:"digest"`
	Size     int64  `json:"size"`
	Blobs    int    `json:"blobs"`
	Resident int64  `json:"resident_bytes"`
}

func (s *Server) list(w http.ResponseWriter, _ *http.Request) {
	models := s.c.Models()
	sort.Slice(models, func(i, j int) bool { return models[i].Ref.String() < models[j].Ref.String() })
	out := struct {
		Models []listEntry `json:"models"`
		Stats  IndexStats  `json:"stats"`
	}{Models: []listEntry{}, Stats: s.c.Stats()}
	for _, m := range models {
		e := listEntry{Model: m.Ref.String(), Digest: string(m.Manifest.Digest), Size: m.Size, Blobs: len(m.Manifest.Blobs())}
		for _, b := range m.Manifest.Blobs() {
			if n, err := residentBytes(s.c.BlobPath(b.Digest)); err == nil {
				e.Resident += n
			}
		}
		out.Models = append(out.Models, e)
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}
