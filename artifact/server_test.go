package artifact

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
)

// servedCache is a cache holding tinyRef, served by a Server.
func servedCache(t *testing.T, o *origin) (*Cache, *httptest.Server) {
	t.Helper()
	c := openCache(t, Config{Origins: []Source{o.source(t)}})
	if _, err := c.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{}); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(NewServer(c, ServerConfig{}))
	t.Cleanup(srv.Close)
	return c, srv
}

func do(t *testing.T, method, url string, hdr map[string]string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(testCtx(t), method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func TestServerRegistryAPI(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {70_000}})
	_, srv := servedCache(t, o)
	m := o.models[tinyRef]
	big := o.biggest(tinyRef)

	if resp, b := do(t, "GET", srv.URL+"/v2/", nil); resp.StatusCode != 200 || string(b) != "{}" {
		t.Fatalf("/v2/: %d %s", resp.StatusCode, b)
	}
	for _, name := range []string{"library/tiny", "registry.ollama.ai/library/tiny"} {
		resp, b := do(t, "GET", srv.URL+"/v2/"+name+"/manifests/latest", nil)
		if resp.StatusCode != 200 || string(b) != string(m.Raw) || resp.Header.Get("Docker-Content-Digest") != string(m.Digest) ||
			resp.Header.Get("Content-Type") != m.MediaType() {
			t.Fatalf("manifest by %s: %d %v", name, resp.StatusCode, resp.Header)
		}
	}
	if resp, b := do(t, "GET", srv.URL+"/v2/library/tiny/manifests/"+string(m.Digest), nil); resp.StatusCode != 200 || string(b) != string(m.Raw) {
		t.Fatalf("manifest by digest: %d", resp.StatusCode)
	}
	resp, b := do(t, "GET", srv.URL+"/v2/library/tiny/blobs/"+string(big.Digest), map[string]string{"Range": "bytes=1000-1999"})
	if resp.StatusCode != http.StatusPartialContent || string(b) != string(o.blobs[big.Digest][1000:2000]) ||
		resp.Header.Get("Content-Range") != "bytes 1000-1999/70000" {
		t.Fatalf("range: %d %v", resp.StatusCode, resp.Header)
	}
	if resp, _ := do(t, "HEAD", srv.URL+"/v2/x/y/blobs/"+string(big.Digest), nil); resp.StatusCode != 200 || resp.ContentLength != big.Size {
		t.Fatalf("HEAD: %d %d", resp.StatusCode, resp.ContentLength)
	}
	for path, want := range map[string]int{
		"/v2/library/tiny/manifests/nope":                         404,
		"/v2/library/nope/manifests/latest":                       404,
		"/v2/library/tiny/blobs/" + string(dg(77)):                404,
		"/v2/library/tiny/blobs/sha256:..%2F..%2Fetc%2Fpasswd":    404, // the last part holds a slash
		"/v2/library/tiny/blobs/sha256-" + big.Digest.Hex() + "0": 400,
		"/v2/library/tiny/manifests/..":                           404, // cleaned by the mux
		"/v2/library/tiny/manifests/.x":                           400,
		"/v2/a/b/c/d/manifests/latest":                            404,
		"/v2/library/tiny/tags/list":                              404,
		"/nothing":                                                404,
		"/v2/" + strings.Repeat("a/", 600) + "blobs/x":            400,
	} {
		resp, b := do(t, "GET", srv.URL+path, nil)
		var e struct {
			Errors []struct{ Code, Message string }
			Error  struct {
				Message, Type, Code string
				Param               *string
			}
		}
		if resp.StatusCode != want || json.Unmarshal(b, &e) != nil || len(e.Errors) != 1 || e.Error.Message == "" || e.Error.Type == "" {
			t.Errorf("GET %s: %d %s, want %d with both error forms", path, resp.StatusCode, b, want)
		}
	}
	if resp, _ := do(t, "PUT", srv.URL+"/v2/library/tiny/blobs/uploads/", nil); resp.StatusCode != 405 {
		t.Errorf("PUT: %d", resp.StatusCode)
	}
	resp, b = do(t, "GET", srv.URL+"/v1/artifacts", nil)
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"model":"registry.ollama.ai/library/tiny:latest"`) {
		t.Errorf("list: %s", b)
	}
	resp, b = do(t, "GET", srv.URL+"/metrics", nil)
	if resp.StatusCode != 200 || !strings.Contains(string(b), "infergate_artifact_fetched_bytes_total") {
		t.Errorf("metrics: %d", resp.StatusCode)
	}
}

// TestPeerFetch: node B fetches from node A's cache (a peer, loopback)
// instead of the origin, and Locate says so before and after.
func TestPeerFetch(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {300_000, 4_000}})
	_, srvA := servedCache(t, o)
	before := o.blobGets()
	peer, err := NewHTTP(srvA.URL, LayoutRegistry, true)
	if err != nil {
		t.Fatal(err)
	}
	b := openCache(t, Config{Peers: []Source{peer}, Origins: []Source{o.source(t)}})
	r := mustRef(t, tinyRef)
	m := o.models[tinyRef]
	plan, err := b.Locate(testCtx(t), r)
	if err != nil {
		t.Fatal(err)
	}
	if plan.TierBytes(TierPeer) != m.Size() || plan.TierBytes(TierLocal) != 0 {
		t.Fatalf("before: %+v", plan.Bytes)
	}
	rep, err := b.Prefetch(testCtx(t), r, AcquireOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Fetched[SourcePeer] != m.Size() || rep.Fetched[SourceHTTP] != 0 || o.blobGets() != before {
		t.Fatalf("report %+v; origin blob GETs %d → %d", rep, before, o.blobGets())
	}
	checkHeld(t, b, o, m)
	plan, err = b.Locate(testCtx(t), r)
	if err != nil || plan.TierBytes(TierLocal) != m.Size() || plan.ResidentBytes() > m.Size() {
		t.Fatalf("after: %+v %v", plan.Bytes, err)
	}
	// A peer without the model: B falls through to the origin (but for the
	// empty config blob "{}", which the peer holds).
	c := openCache(t, Config{Peers: []Source{peer}, Origins: []Source{o.source(t)}})
	other := "registry.ollama.ai/library/other:latest"
	o2 := newOrigin(t, map[string][]int{other: {5_000}})
	c.cfg.Origins = []Source{o2.source(t)}
	if rep, err := c.Prefetch(testCtx(t), mustRef(t, other), AcquireOptions{}); err != nil || rep.Fetched[SourceHTTP] != o2.models[other].Size()-2 || rep.Fetched[SourcePeer] != 2 {
		t.Fatalf("fallthrough %+v %v", rep, err)
	}
}

func TestServerBlobRedirect(t *testing.T) {
	o := newOrigin(t, map[string][]int{tinyRef: {5_000}})
	c, _ := servedCache(t, o)
	direct, _ := url.Parse("http://node1.local:8200/base")
	srv := httptest.NewServer(NewServer(c, ServerConfig{BlobRedirect: direct}))
	defer srv.Close()
	big := o.biggest(tinyRef)
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Get(srv.URL + "/v2/library/tiny/blobs/" + string(big.Digest))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusTemporaryRedirect || resp.Header.Get("Location") != "http://node1.local:8200/base/v2/library/tiny/blobs/"+string(big.Digest) {
		t.Fatalf("%d %v", resp.StatusCode, resp.Header)
	}
	// Under the direct host name the blob is served; an unknown blob is 404
	// either way.
	req, _ := http.NewRequest("GET", srv.URL+"/v2/library/tiny/blobs/"+string(big.Digest), nil)
	req.Host = "node1.local:8200"
	resp, err = client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != string(o.blobs[big.Digest]) {
		t.Fatalf("direct: %d", resp.StatusCode)
	}
	if resp, _ := do(t, "GET", srv.URL+"/v2/library/tiny/blobs/"+string(dg(3)), nil); resp.StatusCode != 404 {
		t.Fatalf("unknown blob: %d", resp.StatusCode)
	}
}

// TestTagFromOriginBlobsFromPeer: a peer holding an older "latest" does not
// decide what the tag names; the origin does, and the blobs the peer holds
// still come from the peer.
func TestTagFromOriginBlobsFromPeer(t *testing.T) {
	old := newOrigin(t, map[string][]int{tinyRef: {10_000}})
	_, srvA := servedCache(t, old)
	peer, _ := NewHTTP(srvA.URL, LayoutRegistry, true)
	cur := newOrigin(t, map[string][]int{tinyRef: {12_000}})
	b := openCache(t, Config{Peers: []Source{peer}, Origins: []Source{cur.source(t)}})
	rep, err := b.Prefetch(testCtx(t), mustRef(t, tinyRef), AcquireOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if m := b.Manifest(mustRef(t, tinyRef)); m == nil || m.Digest != cur.models[tinyRef].Digest {
		t.Fatalf("manifest is not the origin's current one")
	}
	if rep.Fetched[SourcePeer] != 2 || rep.Fetched[SourceHTTP] != 12_000 { // the shared {} config from the peer
		t.Fatalf("fetched %v", rep.Fetched)
	}
}
