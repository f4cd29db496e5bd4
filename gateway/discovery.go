package gateway

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// cacheConfig is what vllm:cache_config_info reports.
type cacheConfig struct {
	numGPUBlocks int // blocks
	blockSize    int // tokens per block
}

// fetchCacheConfig reads vllm:cache_config_info{num_gpu_blocks,block_size}
// from the endpoint's /metrics, sending header (the endpoint's credentials
// and configured headers: endpointSpec.header).
func (g *Gateway) fetchCacheConfig(ctx context.Context, base string, header http.Header) (cacheConfig, error) {
	ctx, cancel := context.WithTimeout(ctx, g.cfg.HealthCheckTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return cacheConfig{}, fmt.Errorf("read %s/metrics: %w", base, err)
	}
	addHeader(req.Header, header)
	resp, err := g.transport.RoundTrip(req)
	if err != nil {
		return cacheConfig{}, fmt.Errorf("read %s/metrics: %w", base, err)
	}
	defer resp.Body.Close()
	if isAuthRefusal(resp.StatusCode) {
		return cacheConfig{}, fmt.Errorf("read %s/metrics: %w", base, authStatus(resp.StatusCode))
	}
	if resp.StatusCode != http.StatusOK {
		return cacheConfig{}, fmt.Errorf("read %s/metrics: status %d", base, resp.StatusCode)
	}
	cc, err := parseCacheConfig(io.LimitReader(resp.Body, 32<<20))
	if err != nil {
		return cacheConfig{}, fmt.Errorf("read %s/metrics: %w", base, err)
	}
	return cc, nil
}

// parseCacheConfig scans Prometheus text exposition for the first
// vllm:cache_config_info sample with positive num_gpu_blocks and block_size
// labels.
func parseCacheConfig(r io.Reader) (cacheConfig, error) {
	const name = "vllm:cache_config_info{"
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name) {
			continue
		}
		labels := parseLabels(line[len(name):])
		blocks, err1 := strconv.Atoi(labels["num_gpu_blocks"])
		size, err2 := strconv.Atoi(labels["block_size"])
		if err1 == nil && err2 == nil && blocks > 0 && size > 0 {
			return cacheConfig{numGPUBlocks: blocks, blockSize: size}, nil
		}
	}
	if err := sc.Err(); err != nil {
		return cacheConfig{}, err
	}
	return cacheConfig{}, fmt.Errorf("no vllm:cache_config_info with num_gpu_blocks and block_size")
}

// parseLabels parses `k="v",k2="v2"}` (the text after a metric's "{") into a
// map, unescaping \\, \" and \n. It stops at the closing brace.
func parseLabels(s string) map[string]string {
	out := map[string]string{}
	for {
		s = strings.TrimLeft(s, " ,")
		if s == "" || s[0] == '}' {
			return out
		}
		eq := strings.IndexByte(s, '=')
		if eq < 0 || eq+1 >= len(s) || s[eq+1] != '"' {
			return out
		}
		key := strings.TrimSpace(s[:eq])
		s = s[eq+2:]
		var v strings.Builder
		i := 0
		for ; i < len(s) && s[i] != '"'; i++ {
			if s[i] == '\\' && i+1 < len(s) {
				i++
				switch s[i] {
				case 'n':
					v.WriteByte('\n')
				default:
					v.WriteByte(s[i])
				}
				continue
			}
			v.WriteByte(s[i])
		}
		if i >= len(s) {
			return out
		}
		out[key] = v.String()
		s = s[i+1:]
	}
}
