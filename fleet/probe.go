package fleet

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/infergate/infergate/openai"
)

// ErrAuthRefused marks an engine read answered 401 or 403.
var ErrAuthRefused = errors.New("the engine refused the gateway's credentials (check the endpoint's api_key, api_key_env or headers)")

// AuthRefused is the error of an engine read answered 401 or 403 (the
// status): the engine refused the gateway's credentials. It wraps
// ErrAuthRefused.
type AuthRefused int

func (s AuthRefused) Error() string { return fmt.Sprintf("status %d: %v", int(s), ErrAuthRefused) }

// Unwrap returns ErrAuthRefused.
func (AuthRefused) Unwrap() error { return ErrAuthRefused }

// IsAuthRefusal reports whether an engine's status refuses the gateway's
// credentials (401, 403).
func IsAuthRefusal(status int) bool {
	return status == http.StatusUnauthorized || status == http.StatusForbidden
}

// Prober makes the gateway's own reads of an engine besides inference and
// the metrics scrape: its health check and what is discovered from it at
// start and at a reload (KV capacity, context length). Every read carries
// the endpoint's header (its credentials and configured headers), is
// bounded by Timeout, and tells a refusal of those credentials
// (AuthRefused) from other failures.
type Prober struct {
	// Transport sends the reads (the gateway's net/http Transport).
	Transport http.RoundTripper
	// Timeout bounds each read, the body included (health_check_timeout).
	Timeout time.Duration
}

// get sends GET url with header and returns the response when its status
// passes ok; what names the read in errors ("health check <endpoint>",
// "read <url>"). The caller closes the body; on an error the body is
// drained (64 KiB at most, to keep the connection) and closed.
func (p Prober) get(ctx context.Context, url string, header http.Header, what string, ok func(int) bool) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	for k, vs := range header {
		req.Header[k] = vs // shared, never modified
	}
	resp, err := p.Transport.RoundTrip(req)
	if err != nil {
		return nil, unanswered{fmt.Errorf("%s: %w", what, err)}
	}
	if IsAuthRefusal(resp.StatusCode) || !ok(resp.StatusCode) {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // keep the connection reusable
		_ = resp.Body.Close()
		if IsAuthRefusal(resp.StatusCode) {
			return nil, fmt.Errorf("%s: %w", what, AuthRefused(resp.StatusCode))
		}
		return nil, fmt.Errorf("%s: status %d", what, resp.StatusCode)
	}
	return resp, nil
}

// unanswered is the error of a read that got no HTTP answer: the
// connection refused or reset, or no response headers within the timeout
// (a black-holed or stopped engine).
type unanswered struct{ err error }

func (e unanswered) Error() string { return e.err.Error() }
func (e unanswered) Unwrap() error { return e.err }

// Unanswered reports whether err is a Prober read's that got no HTTP answer
// from the engine (refused, reset, or no response headers within Timeout):
// the reads after it would fare no better, and whoever makes several in a
// row stops there, so that an engine that does not answer costs one
// Timeout, not one per read. An HTTP status, even 5xx, is an answer.
func Unanswered(err error) bool {
	var u unanswered
	return errors.As(err, &u)
}

func is2xx(status int) bool { return status/100 == 2 }
func is200(status int) bool { return status == http.StatusOK }

// Health sends GET url (the endpoint's base URL and its kind's health path,
// Kind.Info().HealthPath) and returns nil for a 2xx answer; name is the
// endpoint in errors.
func (p Prober) Health(ctx context.Context, name, url string, header http.Header) error {
	ctx, cancel := context.WithTimeout(ctx, p.Timeout)
	defer cancel()
	resp, err := p.get(ctx, url, header, "health check "+name, is2xx)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // keep the connection reusable
	_ = resp.Body.Close()
	return nil
}

// IsSleeping sends GET <base>/is_sleeping (vLLM's sleep mode, served with
// VLLM_SERVER_DEV_MODE=1) and returns its {"is_sleeping": bool}; the answer
// is read up to 4 KiB.
func (p Prober) IsSleeping(ctx context.Context, base string, header http.Header) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, p.Timeout)
	defer cancel()
	what := "read " + base + "/is_sleeping"
	resp, err := p.get(ctx, base+"/is_sleeping", header, what, is200)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	var v struct {
		IsSleeping *bool `json:"is_sleeping"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 4<<10)).Decode(&v); err != nil || v.IsSleeping == nil {
		return false, fmt.Errorf("%s: not {\"is_sleeping\": bool}", what)
	}
	return *v.IsSleeping, nil
}

// CacheConfig is an engine's KV cache as vllm:cache_config_info reports it.
type CacheConfig struct {
	NumGPUBlocks int // blocks
	BlockSize    int // tokens per block
}

// CacheConfig reads vllm:cache_config_info{num_gpu_blocks,block_size} from
// <base>/metrics (at most 32 MiB of it).
func (p Prober) CacheConfig(ctx context.Context, base string, header http.Header) (CacheConfig, error) {
	ctx, cancel := context.WithTimeout(ctx, p.Timeout)
	defer cancel()
	what := "read " + base + "/metrics"
	resp, err := p.get(ctx, base+"/metrics", header, what, is200)
	if err != nil {
		return CacheConfig{}, err
	}
	defer resp.Body.Close()
	cc, err := ParseCacheConfig(io.LimitReader(resp.Body, 32<<20))
	if err != nil {
		return CacheConfig{}, fmt.Errorf("%s: %w", what, err)
	}
	return cc, nil
}

// ParseCacheConfig scans Prometheus text exposition for the first
// vllm:cache_config_info sample with positive num_gpu_blocks and block_size
// labels.
func ParseCacheConfig(r io.Reader) (CacheConfig, error) {
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
			return CacheConfig{NumGPUBlocks: blocks, BlockSize: size}, nil
		}
	}
	if err := sc.Err(); err != nil {
		return CacheConfig{}, err
	}
	return CacheConfig{}, fmt.Errorf("no vllm:cache_config_info with num_gpu_blocks and block_size")
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

// ModelsPath is the OpenAI model list's path.
const ModelsPath = "/v1/models"

// maxModelsBody bounds the GET /v1/models answer read (bytes).
const maxModelsBody = 1 << 20

// MaxModelLenLimit bounds a discovered max_model_len (2^30 tokens: beyond
// any model, and small enough that token estimates stay exact in a
// float64).
const MaxModelLenLimit = 1 << 30

// MaxModelLen reads the context length an engine reports in
// GET <base>/v1/models: the largest max_model_len of its entries (vLLM's
// and the simulator's model cards carry it; LoRA adapters' cards do not,
// they share the base model's). 0 and an error when it reports none. The
// read carries the credentials: vLLM's --api-key guards every /v1 path, so
// it also checks them.
func (p Prober) MaxModelLen(ctx context.Context, base string, header http.Header) (int, error) {
	body, err := p.ReadModels(ctx, base, header)
	if err != nil {
		return 0, err
	}
	n, err := ParseMaxModelLen(body)
	if err != nil {
		return 0, fmt.Errorf("read %s%s: %w", base, ModelsPath, err)
	}
	return n, nil
}

// ParseMaxModelLen returns the largest positive max_model_len (at most
// MaxModelLenLimit) in a model list (openai.ModelList), an error when there
// is none. The body is an engine's: held to openai.MaxDepth like any.
func ParseMaxModelLen(body []byte) (int, error) {
	if openai.TooDeep(body) {
		return 0, fmt.Errorf("nested more than %d levels deep", openai.MaxDepth)
	}
	var list struct {
		Data []struct {
			MaxModelLen int64 `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil {
		return 0, err
	}
	n := 0
	for _, m := range list.Data {
		if m.MaxModelLen > 0 && m.MaxModelLen <= MaxModelLenLimit {
			n = max(n, int(m.MaxModelLen))
		}
	}
	if n == 0 {
		return 0, fmt.Errorf("no max_model_len in the model list")
	}
	return n, nil
}

// ModelList is what an engine's GET /v1/models tells the gateway: every
// model id it serves and, for LoRA adapters, the base model each runs on.
type ModelList struct {
	// IDs are the ids listed (base models and adapters), in the engine's
	// order, at most MaxListedModels of them.
	IDs []string
	// Adapters are the entries with a non-null parent: LoRA adapters, as
	// vLLM lists them (vllm/entrypoints/openai/serving_models.py
	// OpenAIServingModels.show_available_models, in every version read, later
	// models/serving.py: ModelCard(id=
	// lora_name, root=lora_path, parent=base model name)); the simulator
	// lists its --lora-modules the same way.
	Adapters []ListedAdapter
}

// ListedAdapter is one adapter of a ModelList: its id (the name a request
// sends as model) and its parent (the base model's id).
type ListedAdapter struct {
	Name, Parent string
}

// Lists reports whether l lists id (a base model or an adapter).
func (l *ModelList) Lists(id string) bool {
	for _, m := range l.IDs {
		if m == id {
			return true
		}
	}
	return false
}

// Bounds of what ParseModelList keeps of an engine's model list: at most
// MaxListedModels entries (vLLM with --max-cpu-loras in the hundreds lists
// that many adapters; the rest are dropped), ids and parents of at most
// MaxModelIDBytes bytes (an entry with a longer one is skipped).
const (
	MaxListedModels = 1024
	MaxModelIDBytes = 256
)

// ParseModelList reads an engine's model list (openai.ModelList, at most
// 1 MiB, held to openai.MaxDepth): the ids and adapters within the bounds
// above. Entries with an empty id are skipped, and so is an adapter's
// parent that is empty or its own id.
func ParseModelList(body []byte) (ModelList, error) {
	if len(body) > maxModelsBody {
		return ModelList{}, fmt.Errorf("model list over %d bytes", maxModelsBody)
	}
	if openai.TooDeep(body) {
		return ModelList{}, fmt.Errorf("nested more than %d levels deep", openai.MaxDepth)
	}
	var list struct {
		Data []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil {
		return ModelList{}, err
	}
	var l ModelList
	for _, m := range list.Data {
		if len(l.IDs) == MaxListedModels {
			break
		}
		if m.ID == "" || len(m.ID) > MaxModelIDBytes {
			continue
		}
		l.IDs = append(l.IDs, m.ID)
		if p := m.Parent; p != nil && *p != "" && *p != m.ID && len(*p) <= MaxModelIDBytes {
			l.Adapters = append(l.Adapters, ListedAdapter{Name: m.ID, Parent: *p})
		}
	}
	return l, nil
}

// ModelList reads GET <base>/v1/models (ParseModelList), with the
// endpoint's header.
func (p Prober) ModelList(ctx context.Context, base string, header http.Header) (ModelList, error) {
	body, err := p.ReadModels(ctx, base, header)
	if err != nil {
		return ModelList{}, err
	}
	l, err := ParseModelList(body)
	if err != nil {
		return ModelList{}, fmt.Errorf("read %s%s: %w", base, ModelsPath, err)
	}
	return l, nil
}

// ReadModels returns the body of GET <base>/v1/models (at most 1 MiB), for
// ParseMaxModelLen and ParseModelList. The read carries the endpoint's
// header and is bounded by Timeout.
func (p Prober) ReadModels(ctx context.Context, base string, header http.Header) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, p.Timeout)
	defer cancel()
	what := "read " + base + ModelsPath
	resp, err := p.get(ctx, base+ModelsPath, header, what, is200)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxModelsBody+1))
	if err != nil || len(body) > maxModelsBody {
		return nil, fmt.Errorf("%s: %v (at most %d bytes)", what, err, maxModelsBody)
	}
	return body, nil
}
