package kvstore

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Defaults of ClientConfig.
const (
	DefaultClientTimeout          = 30 * time.Second
	DefaultClientMaxResponseBytes = 256 << 20
)

// ClientConfig configures a Client. Zero fields take defaults.
type ClientConfig struct {
	// Timeout bounds each call, body included (default 30 s); a caller's
	// context may end it sooner.
	Timeout time.Duration
	// MaxResponseBytes bounds a response body (default 256 MiB).
	MaxResponseBytes int64
	// HTTPClient, when set, sends the requests (its own Timeout applies
	// too); the default has its own transport with dial, TLS-less
	// header and idle timeouts.
	HTTPClient *http.Client
}

// Client calls a kvstore's native API (the simulated engines' writer and
// reader). Safe for concurrent use.
type Client struct {
	base string
	cfg  ClientConfig
	hc   *http.Client
}

// NewClient returns a client of the native API at baseURL
// ("http://host:port").
func NewClient(baseURL string, cfg ClientConfig) (*Client, error) {
	u, err := url.Parse(baseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("kvstore: client base URL %q: want http://host:port", baseURL)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultClientTimeout
	}
	if cfg.MaxResponseBytes <= 0 {
		cfg.MaxResponseBytes = DefaultClientMaxResponseBytes
	}
	hc := cfg.HTTPClient
	if hc == nil {
		hc = &http.Client{Transport: &http.Transport{
			DialContext:           (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConnsPerHost:   16,
			IdleConnTimeout:       90 * time.Second,
			ResponseHeaderTimeout: cfg.Timeout,
		}}
	}
	return &Client{base: strings.TrimRight(baseURL, "/"), cfg: cfg, hc: hc}, nil
}

// Close releases the client's idle connections.
func (c *Client) Close() { c.hc.CloseIdleConnections() }

// Put stores blocks of model and adapter ("" for the base model) in one
// call: with Data for blocks with bytes, with Size alone for
// metadata-only ones.
func (c *Client) Put(ctx context.Context, model, adapter string, blocks []Block) (PutResponse, error) {
	var out PutResponse
	err := c.do(ctx, http.MethodPost, "/v1/blocks", PutRequest{Model: model, Adapter: adapter, Blocks: blocks}, &out)
	return out, err
}

// Lookup returns how many leading hashes of a chain (model, adapter) the
// store holds.
func (c *Client) Lookup(ctx context.Context, model, adapter string, hashes []uint64) (int, error) {
	var out LookupResponse
	err := c.do(ctx, http.MethodPost, "/v1/lookup", LookupRequest{Model: model, Adapter: adapter, Hashes: hashes}, &out)
	return out.Held, err
}

// LookupKeys is Lookup for opaque keys.
func (c *Client) LookupKeys(ctx context.Context, keys []string) (int, error) {
	var out LookupResponse
	err := c.do(ctx, http.MethodPost, "/v1/lookup", LookupRequest{Keys: keys}, &out)
	return out.Held, err
}

// Get returns the block k (its bytes too with withData); found false when
// it is not held.
func (c *Client) Get(ctx context.Context, k Key, withData bool) (BlockInfo, bool, error) {
	q := url.Values{"model": {k.Model}, "hash": {strconv.FormatUint(k.Hash, 10)}}
	if k.Adapter != "" {
		q.Set("adapter", k.Adapter)
	}
	return c.get(ctx, q, withData)
}

// GetKey is Get for an opaque key.
func (c *Client) GetKey(ctx context.Context, key string, withData bool) (BlockInfo, bool, error) {
	return c.get(ctx, url.Values{"key": {key}}, withData)
}

func (c *Client) get(ctx context.Context, q url.Values, withData bool) (BlockInfo, bool, error) {
	if !withData {
		q.Set("data", "0")
	}
	var out BlockInfo
	err := c.do(ctx, http.MethodGet, "/v1/blocks?"+q.Encode(), nil, &out)
	var ae *APIError
	if errors.As(err, &ae) && ae.Status == http.StatusNotFound {
		return BlockInfo{}, false, nil
	}
	return out, err == nil, err
}

// Delete removes blocks of model and adapter; it returns how many were held.
func (c *Client) Delete(ctx context.Context, model, adapter string, hashes []uint64) (int, error) {
	var out DeleteResponse
	err := c.do(ctx, http.MethodPost, "/v1/delete", DeleteRequest{Model: model, Adapter: adapter, Hashes: hashes}, &out)
	return out.Deleted, err
}

// Stats returns the service's statistics.
func (c *Client) Stats(ctx context.Context) (ServiceStats, error) {
	var out ServiceStats
	err := c.do(ctx, http.MethodGet, "/v1/stats", nil, &out)
	return out, err
}

// Health checks that the service answers.
func (c *Client) Health(ctx context.Context) error {
	var out map[string]string
	return c.do(ctx, http.MethodGet, "/health", nil, &out)
}

// do sends one request and decodes the answer into out; an error answer
// is an *APIError.
func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return err
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("kvstore: %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, c.cfg.MaxResponseBytes+1))
	if err != nil {
		return fmt.Errorf("kvstore: %s %s: reading the answer: %w", method, path, err)
	}
	if int64(len(b)) > c.cfg.MaxResponseBytes {
		return fmt.Errorf("kvstore: %s %s: answer over %d bytes", method, path, c.cfg.MaxResponseBytes)
	}
	if resp.StatusCode != http.StatusOK {
		var e struct {
			Error *APIError `json:"error"`
		}
		if json.Unmarshal(b, &e) == nil && e.Error != nil {
			e.Error.Status = resp.StatusCode
			return e.Error
		}
		return &APIError{Status: resp.StatusCode, Message: strings.TrimSpace(string(b[:min(len(b), 512)]))}
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("kvstore: %s %s: decoding the answer: %w", method, path, err)
	}
	return nil
}
