package kvstore

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

func newTestClient(t *testing.T, svc *Service) *Client {
	t.Helper()
	c, err := NewClient("http://"+svc.Addr().String(), ClientConfig{Timeout: wait})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

func TestAPIClient(t *testing.T) {
	ctx := context.Background()
	svc := startService(t, ServiceConfig{Store: Config{MemoryBytes: 64 << 20, MaxTokenIDs: 16}, API: APIConfig{MaxBlocks: 8}, Model: "m"})
	c := newTestClient(t, svc)
	if err := c.Health(ctx); err != nil {
		t.Fatal(err)
	}
	// A chain of metadata-only blocks with tokens and parents, and one
	// block of real bytes.
	var blocks []Block
	for i := range uint64(4) {
		b := Block{Hash: 100 + i, Size: 1 << 20, TokenIDs: []uint32{uint32(i), 1, 2, 3}}
		if i > 0 {
			p := 100 + i - 1
			b.ParentBlockHash = &p
		}
		blocks = append(blocks, b)
	}
	data := make([]byte, 1<<20)
	for i := range data {
		data[i] = byte(i % 251)
	}
	blocks = append(blocks, Block{Hash: 104, Data: data, Fmt: 1, Dtype: 3, Shape: [4]int32{1, 2, 3, 4}})
	res, err := c.Put(ctx, "m", "", blocks)
	if err != nil || res.Stored != 5 {
		t.Fatalf("put: %+v %v", res, err)
	}
	if n, err := c.Lookup(ctx, "m", "", []uint64{100, 101, 102, 103, 104, 105, 106}); n != 5 || err != nil {
		t.Fatalf("lookup: %d %v", n, err)
	}
	if n, _ := c.Lookup(ctx, "m", "lora-a", []uint64{100}); n != 0 {
		t.Fatal("an adapter's lookup found the base model's block")
	}
	info, ok, err := c.Get(ctx, Key{Model: "m", Hash: 104}, true)
	if err != nil || !ok || !bytes.Equal(info.Data, data) || info.Shape != [4]int32{1, 2, 3, 4} || !info.HasData || info.Hash != 104 {
		t.Fatalf("get: ok %v err %v, %d bytes, %+v", ok, err, len(info.Data), info.Meta)
	}
	info, ok, err = c.Get(ctx, Key{Model: "m", Hash: 101}, false)
	if err != nil || !ok || info.HasData || info.Size != 1<<20 || !info.HasParent || info.ParentHash != 100 || len(info.TokenIDs) != 4 {
		t.Fatalf("get metadata: %+v %v %v", info, ok, err)
	}
	if _, ok, err := c.Get(ctx, Key{Model: "m", Hash: 999}, true); ok || err != nil {
		t.Fatalf("get of a missing block: %v %v", ok, err)
	}
	if n, err := c.Delete(ctx, "m", "", []uint64{102, 999}); n != 1 || err != nil {
		t.Fatalf("delete: %d %v", n, err)
	}
	if n, _ := c.Lookup(ctx, "m", "", []uint64{100, 101, 102, 103}); n != 2 {
		t.Fatalf("lookup after delete: %d", n)
	}
	st, err := c.Stats(ctx)
	if err != nil || st.Store.MemoryEntries != 4 || st.Events == nil {
		t.Fatalf("stats %+v %v", st, err)
	}
	// Bounds: blocks per request, token ids per block, object size, names.
	var ae *APIError
	for _, bad := range []struct {
		model  string
		blocks []Block
		status int
	}{
		{"m", make([]Block, 9), 413},
		{"m", []Block{{Hash: 1, TokenIDs: make([]uint32, 17)}}, 400},
		{"m", []Block{{Hash: 1, Size: DefaultMaxObjectBytes + 1}}, 413},
		{"m", []Block{{Hash: 1, Size: -1}}, 400},
		{"", []Block{{Hash: 1}}, 400},
		{"a@b", []Block{{Hash: 1}}, 400},
	} {
		if _, err := c.Put(ctx, bad.model, "", bad.blocks); !errors.As(err, &ae) || ae.Status != bad.status {
			t.Errorf("put %d blocks of model %q: %v, want status %d", len(bad.blocks), bad.model, err, bad.status)
		}
	}
}

// TestAPIHostile: malformed, oversized and slow requests get clear errors
// or are cut at their timeouts; the server keeps serving.
func TestAPIHostile(t *testing.T) {
	svc := startService(t, ServiceConfig{Store: Config{MemoryBytes: 1 << 20},
		API: APIConfig{MaxBodyBytes: 4096, ReadHeaderTimeout: 200 * time.Millisecond, ReadTimeout: 300 * time.Millisecond}})
	base := "http://" + svc.Addr().String()
	post := func(path, ct, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, base+path, strings.NewReader(body))
		if ct != "" {
			req.Header.Set("Content-Type", ct)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, c := range []struct {
		path, ct, body string
		status         int
	}{
		{"/v1/blocks", "application/json", `{"model":"m","blocks":[{"hash":-1}]}`, 400},
		{"/v1/blocks", "application/json", `{"model":"m","blocks":[{"hash":18446744073709551616}]}`, 400},
		{"/v1/blocks", "application/json", `{"model":"m","blocks":[]} {}`, 400},
		{"/v1/blocks", "application/json", `{"model":"m","bogus":1}`, 400},
		{"/v1/blocks", "application/json", `{"model":"m","blocks":[{"hash":1,"data":"not base64!"}]}`, 400},
		{"/v1/blocks", "application/json", strings.Repeat("[", 5000), 413},
		{"/v1/blocks", "text/plain", `{}`, 415},
		{"/v1/lookup", "application/json", `{"model":"m","hashes":[1],"keys":["k"]}`, 400},
		{"/v1/nope", "application/json", `{}`, 404},
		{"/v1/blocks", "application/json", `{"model":"m","blocks":[{"hash":18446744073709551615,"size":5}]}`, 200},
		{"/v1/blocks", "application/json; charset=utf-8", `{"model":"m","blocks":[{"hash":7,"size":5}]}`, 200},
	} {
		status, body := post(c.path, c.ct, c.body)
		if status != c.status || (status != 200 && !strings.Contains(body, `"error"`)) {
			t.Errorf("POST %s %.40q: %d %s, want %d", c.path, c.body, status, body, c.status)
		}
	}
	if resp, err := http.Get(base + "/v1/lookup"); err != nil || resp.StatusCode != 405 {
		t.Errorf("GET /v1/lookup: %v %v", resp.StatusCode, err)
	} else {
		resp.Body.Close()
	}
	// Slowloris: a header never finished, a body never sent: cut.
	for _, req := range []string{"POST /v1/blocks HTTP/1.1\r\nHost: x\r\n", "POST /v1/blocks HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"} {
		c, err := net.DialTimeout("tcp", svc.Addr().String(), wait)
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte(req))
		_ = c.SetReadDeadline(time.Now().Add(wait))
		_, err = io.ReadAll(c) // until the server closes
		c.Close()
		if err != nil {
			t.Errorf("slow request %q: %v (not closed by the server)", req, err)
		}
	}
	if err := newTestClient(t, svc).Health(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestAPIBounds: what an attack run found. Token ids are counted before
// they are decoded (a body of small numbers decoded into slices many times
// its size first); bodies are read before a serving slot is taken, so slow
// senders hold only the bytes they announced, not the slots.
func TestAPIBounds(t *testing.T) {
	svc := startService(t, ServiceConfig{Store: Config{MemoryBytes: 1 << 20},
		API: APIConfig{MaxBodyBytes: 8 << 20, MaxInflight: 1, InflightWait: wait}})
	base := "http://" + svc.Addr().String()
	var b strings.Builder
	b.WriteString(`{"model":"m","blocks":[{"hash":1,"size":5,"token_ids":[`)
	for i := range MaxWireTokenIDs + 1 {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('0')
	}
	b.WriteString(`]}]}`)
	resp, err := http.Post(base+"/v1/blocks", "application/json", strings.NewReader(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	msg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !strings.Contains(string(msg), "token ids, at most") {
		t.Fatalf("too many token ids: %d %s", resp.StatusCode, msg)
	}
	// Two senders stuck mid-body, the one serving slot free: a lookup is
	// served at once.
	for range 2 {
		c, err := net.DialTimeout("tcp", svc.Addr().String(), wait)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.Write([]byte("POST /v1/blocks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"))
	}
	if n, err := newTestClient(t, svc).Lookup(context.Background(), "m", "", []uint64{1}); err != nil || n != 0 {
		t.Fatalf("lookup beside slow senders: %d %v", n, err)
	}
}

// TestAPIBodyBudgetChargedAsSent: the bodies' budget is charged for the
// bytes a request has sent, not for the Content-Length it announced.
// Charged up front, two connections announcing the whole budget and
// sending one byte made every other writer wait InflightWait and get 503
// (an attack run's finding: four connections of 128 MiB held the default
// 512 MiB). A body that does exceed the budget still gets 503.
func TestAPIBodyBudgetChargedAsSent(t *testing.T) {
	const budget = 1 << 20
	svc := startService(t, ServiceConfig{Store: Config{MemoryBytes: 1 << 20},
		API: APIConfig{MaxBodyBytes: budget, MaxBodyBytesTotal: budget, InflightWait: 50 * time.Millisecond}})
	for range 2 {
		c, err := net.DialTimeout("tcp", svc.Addr().String(), wait)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.Write([]byte("POST /v1/blocks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
			strconv.Itoa(budget) + "\r\n\r\n{"))
	}
	cl := newTestClient(t, svc)
	for i := range 3 {
		if _, err := cl.Put(context.Background(), "m", "", []Block{{Hash: uint64(i + 1), Size: 5}}); err != nil {
			t.Fatalf("put %d beside two senders that announced the whole budget: %v", i, err)
		}
	}
	// A third connection sends the whole budget and stalls before its end:
	// it holds what it sent, and a put then finds the budget full.
	c, err := net.DialTimeout("tcp", svc.Addr().String(), wait)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("POST /v1/blocks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
		strconv.Itoa(budget) + "\r\n\r\n" + strings.Repeat(" ", budget-8)))
	for deadline := time.Now().Add(wait); ; {
		_, err := cl.Put(context.Background(), "m", "", []Block{{Hash: 99, Size: 5}})
		if err != nil && strings.Contains(err.Error(), "503") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a put while a sender holds the budget: %v, want 503", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestAPIListsCountedBeforeDecoding: a body of many empty elements is
// refused 413 before it is decoded. An attack run's finding: a 120 MiB
// put of {"blocks":[{},{},…]} (3 bytes a block) was decoded into 42
// million Block structs before len(req.Blocks) was checked, and the
// process grew past 16 GB; hashes and keys grew likewise.
func TestAPIListsCountedBeforeDecoding(t *testing.T) {
	svc := startService(t, ServiceConfig{Store: Config{MemoryBytes: 1 << 20},
		API: APIConfig{MaxBlocks: 8, MaxBodyBytes: 8 << 20}})
	base := "http://" + svc.Addr().String()
	const n = 1 << 20 // elements: 3 MiB of body
	for _, c := range []struct{ path, head, elem string }{
		{"/v1/blocks", `{"model":"m","blocks":[`, `{}`},
		{"/v1/lookup", `{"model":"m","hashes":[`, `0`},
		{"/v1/lookup", `{"keys":[`, `""`},
		{"/v1/delete", `{"model":"m","hashes":[`, `0`},
	} {
		var b strings.Builder
		b.WriteString(c.head)
		for i := range n {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(c.elem)
		}
		b.WriteString(`]}`)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		resp, err := http.Post(base+c.path, "application/json", strings.NewReader(b.String()))
		if err != nil {
			t.Fatal(err)
		}
		msg, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		runtime.ReadMemStats(&after)
		if resp.StatusCode != 413 || !strings.Contains(string(msg), "at most 8 a request") {
			t.Errorf("%s %s…: %d %s, want 413", c.path, c.head, resp.StatusCode, msg)
		}
		// The body itself (3 MiB, read whole), its copy in the request,
		// and slack; decoded, the blocks alone were ~170 MiB.
		if grew := after.TotalAlloc - before.TotalAlloc; grew > 64<<20 {
			t.Errorf("%s %s…: %d MiB allocated for a %d KiB body", c.path, c.head, grew>>20, b.Len()>>10)
		}
	}
	// Within the bound, and commas inside strings and deeper arrays are
	// not elements: served.
	cl := newTestClient(t, svc)
	blocks := make([]Block, 8)
	for i := range blocks {
		blocks[i] = Block{Key: "k,,,,,,,,,,,,,,,,,,,,,," + strconv.Itoa(i), Size: 5, TokenIDs: []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}
	}
	if res, err := cl.Put(context.Background(), "m", "", blocks); err != nil || res.Stored != 8 {
		t.Fatalf("put of 8 blocks: %+v %v", res, err)
	}
	if n, err := cl.Lookup(context.Background(), "m", "", []uint64{1, 2, 3, 4, 5, 6, 7, 8}); err != nil || n != 0 {
		t.Fatalf("lookup of 8 hashes: %d %v", n, err)
	}
}
