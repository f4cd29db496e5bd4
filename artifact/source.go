package artifact

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// SourceKind labels where fetched bytes came from (the "source" label of the
// cache's metrics).
type SourceKind string

// Source kinds.
const (
	SourceHTTP SourceKind = "http" // a remote origin: a registry or an HTTP file server
	SourcePeer SourceKind = "peer" // another node's cache (infergate artifacts serve)
	SourcePath SourceKind = "path" // a local or mounted folder
)

// Source is where the cache fetches manifests and blobs from.
type Source interface {
	// String names the source in logs and errors.
	String() string
	// Kind is its metrics label.
	Kind() SourceKind
	// Manifest returns a model's manifest bytes (at most MaxManifestBytes).
	Manifest(ctx context.Context, r Ref) ([]byte, error)
	// Blob opens a blob's bytes from offset on. start is the offset the
	// body actually begins at: offset, or 0 when the source ignored the
	// range. The caller closes body.
	Blob(ctx context.Context, r Ref, d Digest, offset int64) (body io.ReadCloser, start int64, err error)
}

// ErrNotFound reports that a source does not have a manifest or blob; the
// cache tries the next source without retrying this one.
var ErrNotFound = errors.New("artifact: not found")

// StatusError is an HTTP source's unexpected answer.
type StatusError struct {
	Status     int
	URL        string
	RetryAfter time.Duration // from a 429 or 503's Retry-After, 0 if none
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("artifact: GET %s: HTTP %d", e.URL, e.Status)
}

// retryable reports whether an error may pass on a retry of the same source:
// not a missing object, not a client error other than 408 and 429.
func retryable(err error) bool {
	if errors.Is(err, ErrNotFound) || errors.Is(err, ErrManifest) || errors.Is(err, ErrDigest) {
		return false
	}
	var se *StatusError
	if errors.As(err, &se) {
		return se.Status >= 500 || se.Status == http.StatusTooManyRequests || se.Status == http.StatusRequestTimeout
	}
	return true
}

// Layout says how an HTTP source names files.
type Layout int

// HTTP source layouts.
const (
	// LayoutRegistry is the OCI distribution API (spec.md v1.1, "Pulling
	// manifests" and "Pulling blobs"): GET <base>/v2/<namespace>/<model>/
	// manifests/<tag> and GET <base>/v2/<namespace>/<model>/blobs/<digest>.
	// Ollama's registry speaks it (server/images.go pullModelManifest,
	// server/download.go @v0.17.4), and so does `infergate artifacts serve`.
	LayoutRegistry Layout = iota
	// LayoutOllamaDir is a plain file server (or object-store bucket) over
	// an Ollama model store: GET <base>/manifests/<host>/<namespace>/<model>/
	// <tag> and GET <base>/blobs/sha256-<hex>.
	LayoutOllamaDir
)

// ParseLayout reads "registry" or "ollama-dir".
func ParseLayout(s string) (Layout, error) {
	switch s {
	case "registry", "":
		return LayoutRegistry, nil
	case "ollama-dir":
		return LayoutOllamaDir, nil
	}
	return 0, fmt.Errorf("artifact: layout %q: want registry or ollama-dir", s)
}

// manifestAccept lists the manifest media types a registry may answer with.
var manifestAccept = strings.Join([]string{ocispec.MediaTypeImageManifest, MediaTypeDockerManifest}, ", ")

// HTTP is a source over HTTP(S): a registry, a file server or a peer.
type HTTP struct {
	Base   *url.URL
	Layout Layout
	// Peer makes this a peer node's cache: its kind is SourcePeer and its
	// registry paths carry the host part of the Ref (<base>/v2/<host>/
	// <namespace>/<model>/...), which a peer needs to tell two origins'
	// models apart.
	Peer bool
	// Client sends the requests; its Transport should bound the wait for
	// response headers (NewHTTP's does). The cache bounds reads itself.
	Client *http.Client
	// Username and Password, if set, are sent to a registry's token realm
	// (auth.go); anonymous otherwise.
	Username, Password string

	tokens tokens
}

// NewHTTP makes an HTTP source for base (http or https) with a client whose
// dials time out after 10 s, TLS handshakes after 10 s and response headers
// after 30 s (the body's idle timeout is the cache's, FetchConfig).
func NewHTTP(base string, layout Layout, peer bool) (*HTTP, error) {
	u, err := url.Parse(base)
	if err != nil {
		return nil, fmt.Errorf("artifact: source %q: %w", base, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("artifact: source %q: want an http or https URL", base)
	}
	u.Path = strings.TrimRight(u.Path, "/")
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.ResponseHeaderTimeout = 30 * time.Second
	tr.TLSHandshakeTimeout = 10 * time.Second
	tr.MaxIdleConnsPerHost = 16
	// Blobs are weights: compressed transfer gains nothing and would hide
	// Content-Length and break ranges.
	tr.DisableCompression = true
	return &HTTP{Base: u, Layout: layout, Peer: peer, Client: &http.Client{Transport: tr}}, nil
}

func (h *HTTP) String() string { return h.Base.Redacted() }

// Kind is SourcePeer for a peer, else SourceHTTP.
func (h *HTTP) Kind() SourceKind {
	if h.Peer {
		return SourcePeer
	}
	return SourceHTTP
}

func (h *HTTP) repo(r Ref) string {
	if h.Peer {
		return r.Host + "/" + r.Repository()
	}
	return r.Repository()
}

func (h *HTTP) manifestURL(r Ref) string {
	if h.Layout == LayoutOllamaDir {
		return h.Base.JoinPath(manifestsDir, r.Host, r.Namespace, r.Model, r.Tag).String()
	}
	return h.Base.JoinPath("v2", h.repo(r), "manifests", r.Tag).String()
}

func (h *HTTP) blobURL(r Ref, d Digest) string {
	if h.Layout == LayoutOllamaDir {
		return h.Base.JoinPath(blobsDir, d.FileName()).String()
	}
	return h.Base.JoinPath("v2", h.repo(r), "blobs", string(d)).String()
}

func (h *HTTP) get(ctx context.Context, method, u string, hdr http.Header) (*http.Response, error) {
	resp, err := h.do(ctx, method, u, hdr, "")
	if err != nil {
		return nil, err
	}
	if resp.StatusCode == http.StatusUnauthorized {
		// A registry's token challenge (auth.go): fetch a token for its
		// scope (or reuse one) and try once more.
		params, ok := parseChallenge(resp.Header.Get("WWW-Authenticate"))
		drain(resp)
		if !ok {
			return nil, &StatusError{Status: resp.StatusCode, URL: u}
		}
		scope := params["realm"] + " " + params["service"] + " " + params["scope"]
		tok := h.tokens.get(scope, time.Now())
		if tok == "" {
			var exp time.Time
			if tok, exp, err = h.fetchToken(ctx, params); err != nil {
				return nil, err
			}
			h.tokens.put(scope, tok, exp)
		}
		if resp, err = h.do(ctx, method, u, hdr, tok); err != nil {
			return nil, err
		}
	}
	switch {
	case resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusPartialContent:
		return resp, nil
	case resp.StatusCode == http.StatusNotFound:
		drain(resp)
		return nil, fmt.Errorf("%w: %s %s", ErrNotFound, method, u)
	}
	drain(resp)
	se := &StatusError{Status: resp.StatusCode, URL: u}
	if s := resp.Header.Get("Retry-After"); s != "" {
		if n, err := strconv.Atoi(s); err == nil && n >= 0 {
			se.RetryAfter = time.Duration(min(n, 3600)) * time.Second
		}
	}
	return nil, se
}

// do sends one request, with a bearer token if given. net/http drops the
// Authorization header on a redirect to another host (a registry's CDN).
func (h *HTTP) do(ctx context.Context, method, u string, hdr http.Header, bearer string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, u, nil)
	if err != nil {
		return nil, err
	}
	for k, v := range hdr {
		req.Header[k] = v
	}
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	return h.Client.Do(req)
}

// drain reads a little of an unwanted body, so the connection can be reused,
// and closes it.
func drain(resp *http.Response) {
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
}

// Manifest GETs the manifest, at most MaxManifestBytes.
func (h *HTTP) Manifest(ctx context.Context, r Ref) ([]byte, error) {
	resp, err := h.get(ctx, http.MethodGet, h.manifestURL(r), http.Header{"Accept": {manifestAccept}})
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.ContentLength > MaxManifestBytes {
		return nil, fmt.Errorf("%w: %d bytes, over %d", ErrManifest, resp.ContentLength, MaxManifestBytes)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, MaxManifestBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > MaxManifestBytes {
		return nil, fmt.Errorf("%w: over %d bytes", ErrManifest, MaxManifestBytes)
	}
	return b, nil
}

// Blob GETs the blob, with "Range: bytes=<offset>-" past 0. A 200 answer to a
// range request starts at 0; a 206 must start at offset.
func (h *HTTP) Blob(ctx context.Context, r Ref, d Digest, offset int64) (io.ReadCloser, int64, error) {
	hdr := http.Header{}
	if offset > 0 {
		hdr.Set("Range", "bytes="+strconv.FormatInt(offset, 10)+"-")
	}
	u := h.blobURL(r, d)
	resp, err := h.get(ctx, http.MethodGet, u, hdr)
	if err != nil {
		return nil, 0, err
	}
	if resp.StatusCode == http.StatusOK {
		return resp.Body, 0, nil
	}
	// 206: "bytes <first>-<last>/<size or *>".
	cr := resp.Header.Get("Content-Range")
	first, ok := strings.CutPrefix(cr, "bytes ")
	if ok {
		first, _, ok = strings.Cut(first, "-")
	}
	n, err := strconv.ParseInt(first, 10, 64)
	if !ok || err != nil || n != offset {
		resp.Body.Close()
		return nil, 0, fmt.Errorf("artifact: GET %s: Content-Range %.60q does not start at %d", u, cr, offset)
	}
	return resp.Body, offset, nil
}

// Holder answers, for Locate, whether this source holds r's blobs: a HEAD
// of each blob within 2 s. A 404 is "no"; any other failure is "no" for
// this blob and every later one (a source that is down is not asked 1,000
// times for a model of 1,000 tensor layers).
func (h *HTTP) Holder(r Ref) Holder { return &httpHolder{h: h, r: r} }

type httpHolder struct {
	h    *HTTP
	r    Ref
	down bool
}

func (x *httpHolder) Has(d Digest) bool {
	if x.down {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := x.h.get(ctx, http.MethodHead, x.h.blobURL(x.r, d), nil)
	if err != nil {
		x.down = !errors.Is(err, ErrNotFound)
		return false
	}
	resp.Body.Close()
	return true
}

// Dir is a source over a local or mounted folder in Ollama's model-store
// layout (another cache's folder, an NFS share, a baked image path).
type Dir struct{ Path string }

func (s Dir) String() string { return s.Path }

// Kind is SourcePath.
func (s Dir) Kind() SourceKind { return SourcePath }

// Manifest reads <path>/manifests/<host>/<namespace>/<model>/<tag>.
func (s Dir) Manifest(_ context.Context, r Ref) ([]byte, error) {
	b, err := readBounded(filepath.Join(s.Path, manifestsDir, r.Path()), MaxManifestBytes)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s in %s", ErrNotFound, r, s.Path)
	}
	return b, err
}

// Blob opens <path>/blobs/sha256-<hex> at offset.
func (s Dir) Blob(_ context.Context, _ Ref, d Digest, offset int64) (io.ReadCloser, int64, error) {
	return s.open(filepath.Join(s.Path, blobsDir, d.FileName()), offset)
}

// open opens a file at offset.
func (Dir) open(p string, offset int64) (io.ReadCloser, int64, error) {
	f, err := os.Open(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, 0, fmt.Errorf("%w: %s", ErrNotFound, p)
	}
	if err != nil {
		return nil, 0, err
	}
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		f.Close()
		return nil, 0, err
	}
	return f, offset, nil
}
