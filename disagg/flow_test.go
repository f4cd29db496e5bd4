package disagg

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

func sender(url string) Send {
	return func(ctx context.Context, body []byte) (*http.Response, error) {
		method := http.MethodPost
		if body == nil {
			method = http.MethodGet
		}
		req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
		if err != nil {
			return nil, err
		}
		return http.DefaultClient.Do(req)
	}
}

func TestRunPrefill(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/ok":
			io.WriteString(w, `{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_request_id":"r","remote_block_ids":[1],"remote_host":"h","remote_port":1}}`)
		case "/503":
			w.WriteHeader(503)
		case "/400":
			w.WriteHeader(400)
		case "/sse":
			io.WriteString(w, "data: {\"choices\":[{\"text\":\"x\"}],\"usage\":null}\n\n"+
				"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\ndata: [DONE]\n\n")
		case "/bad":
			io.WriteString(w, `{"choices":[]}`)
		case "/slow":
			select {
			case <-r.Context().Done():
			case <-release:
			}
		case ReleasePath:
			w.WriteHeader(404)
		}
	}))
	defer srv.Close()
	defer close(release)
	ctx := context.Background()
	if p, le := RunPrefill(ctx, time.Minute, sender(srv.URL+"/ok"), []byte(`{}`)); le != nil || !p.Holds() {
		t.Fatalf("%+v %v", p, le)
	}
	for path, reason := range map[string]string{"/503": Reason5xx, "/400": ReasonStatus, "/bad": ReasonBadParams} {
		if _, le := RunPrefill(ctx, time.Minute, sender(srv.URL+path), []byte(`{}`)); le == nil || le.Reason != reason {
			t.Errorf("%s: %v, want %s", path, le, reason)
		}
	}
	if _, le := RunPrefill(ctx, time.Millisecond, sender(srv.URL+"/slow"), []byte(`{}`)); le == nil || le.Reason != ReasonTimeout {
		t.Errorf("slow: %v", le)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, le := RunPrefill(cctx, time.Minute, sender(srv.URL+"/ok"), []byte(`{}`)); le == nil || le.Reason != ReasonCanceled {
		t.Errorf("canceled: %v", le)
	}
	if _, le := RunPrefill(ctx, time.Minute, sender("http://127.0.0.1:1"), []byte(`{}`)); le == nil || le.Reason != ReasonConnect {
		t.Errorf("refused: %v", le)
	}
	if ok, err := Release(ctx, time.Minute, sender(srv.URL+ReleasePath), &Prefill{EngineID: "e", RequestID: "r"}); ok || err != nil {
		t.Errorf("release 404: %v %v", ok, err)
	}
	// A concurrent leg: canceled, its goroutine ends.
	l := StartLeg(ctx, 0, sender(srv.URL+"/slow"), []byte(`{}`))
	if le := l.Cancel(); le == nil || le.Reason != ReasonCanceled {
		t.Errorf("canceled leg: %v", le)
	}
	if le := StartLeg(ctx, 0, sender(srv.URL+"/ok"), []byte(`{}`)).Wait(); le != nil {
		t.Errorf("leg: %v", le)
	}
	// P's cached tokens, from a whole answer or a stream.
	if c, ok := StartLeg(ctx, 0, sender(srv.URL+"/sse"), []byte(`{}`)).Cached(); c != 7 || !ok {
		t.Errorf("streamed leg's cached tokens %d %v", c, ok)
	}
	if c, ok := StartLeg(ctx, 0, sender(srv.URL+"/bad"), []byte(`{}`)).Cached(); c != 0 || ok {
		t.Errorf("no usage: cached tokens %d %v", c, ok)
	}
	if _, ok := StartLeg(ctx, 0, sender(srv.URL+"/503"), []byte(`{}`)).Cached(); ok {
		t.Error("a failed leg's cached tokens")
	}
	var le *LegError
	if _, err := QueryBootstrap(ctx, time.Minute, sender(srv.URL+"/bad"), 0); !errors.As(error(err), &le) {
		t.Errorf("query: %v", err)
	}
}
