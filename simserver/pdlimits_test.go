package simserver

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/openai"
)

// getTransfer long-polls P's /transfer for room until ctx ends; it
// returns the status ("0" when the request failed, as when ctx ended).
func getTransfer(ctx context.Context, base, room string) (int, http.Header, []byte) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+pdPathPrefix+"v1/transfer?room="+room+"&wait_ms=600000", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, nil
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b
}

// PDConfig.MaxWaiters bounds the long polls: the one beyond it is
// answered 503 with Retry-After at once and counted; a poll that need not
// wait is not; once the waiters end a new one waits again.
func TestPDWaiterCap(t *testing.T) {
	const n = 3
	ps, p := newTestServer(t, ServerConfig{PD: PDConfig{MaxWaiters: n}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	statuses := make([]int, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			statuses[i], _, _ = getTransfer(ctx, p.URL, strconv.Itoa(i))
		}()
	}
	waitFor(t, "the waiters", func() bool { return ps.pdReg.numWaiters() == n })

	status, h, body := getTransfer(context.Background(), p.URL, "99")
	if status != http.StatusServiceUnavailable || h.Get("Retry-After") != pdRetryAfter {
		t.Fatalf("waiter %d: %d Retry-After %q %s", n+1, status, h.Get("Retry-After"), body)
	}
	e := decodeJSON[openai.ErrorResponse](t, body)
	if e.Error == nil || e.Error.Type == "" || !strings.Contains(e.Error.Message, "at most 3") {
		t.Fatalf("503 body %s", body)
	}
	if got := counterValue(t, ps, "infergate_sim_pd_transfer_waiters_rejected_total", ""); got != 1 {
		t.Fatalf("rejections %v", got)
	}
	// A poll that does not wait, or whose hold is there, is answered.
	resp := mustGet(t, p.URL+pdPathPrefix+"v1/transfer?room=99")
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("wait_ms=0 at the cap: %d", resp.StatusCode)
	}
	ps.pdReg.add(&pdHold{reqID: "held", blocks: []int32{7}, keys: []string{reqKey("held"), roomKey("50")}})
	if status, _, body := getTransfer(context.Background(), p.URL, "50"); status != http.StatusOK {
		t.Fatalf("a held room at the cap: %d %s", status, body)
	}
	if ps.pdReg.numWaiters() != n {
		t.Fatalf("waiters %d", ps.pdReg.numWaiters())
	}

	cancel()
	wg.Wait()
	waitFor(t, "the waiters to end", func() bool { return ps.pdReg.numWaiters() == 0 && ps.pdReg.numWaitKeys() == 0 })
	for i, s := range statuses {
		if s != 0 {
			t.Fatalf("cancelled waiter %d answered %d", i, s)
		}
	}

	// A slot is free again: this one waits until its hold comes.
	var got pdTransfer
	var gotStatus int
	wg.Add(1)
	go func() {
		defer wg.Done()
		var b []byte
		gotStatus, _, b = getTransfer(context.Background(), p.URL, "7")
		_ = json.Unmarshal(b, &got)
	}()
	waitFor(t, "the new waiter", func() bool { return ps.pdReg.numWaiters() == 1 })
	ps.pdReg.add(&pdHold{reqID: "r7", blocks: []int32{1, 2}, keys: []string{reqKey("r7"), roomKey("7")}})
	wg.Wait()
	if gotStatus != http.StatusOK || got.RemoteRequestID != "r7" || got.RemoteEngineID != ps.EngineID() {
		t.Fatalf("new waiter: %d %+v", gotStatus, got)
	}
	if got := counterValue(t, ps, "infergate_sim_pd_transfer_waiters_rejected_total", ""); got != 1 {
		t.Fatalf("rejections %v", got)
	}
}

// waitAsync runs r.wait on key in a goroutine; its result comes on the
// returned channel.
func waitAsync(ctx context.Context, r *pdRegistry, key string) <-chan *pdHold {
	out := make(chan *pdHold, 1)
	go func() {
		h, err := r.wait(ctx, nil, key, time.Hour)
		if err != nil {
			h = &pdHold{reqID: "error: " + err.Error()}
		}
		out <- h
	}()
	return out
}

// An add wakes the waiters of its keys only; a waiter woken for a hold
// that was dropped before it looked waits again; the count is exact.
func TestPDRegistryWakesOnlyItsKey(t *testing.T) {
	r := newPDRegistry(8)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	a1, a2, b := waitAsync(ctx, r, "a"), waitAsync(ctx, r, "a"), waitAsync(ctx, r, "b")
	waitFor(t, "three waiters", func() bool { return r.numWaiters() == 3 && r.numWaitKeys() == 2 })
	r.mu.Lock()
	cha, chb := r.waits["a"].ch, r.waits["b"].ch
	r.mu.Unlock()

	ha := &pdHold{reqID: "ra", keys: []string{reqKey("ra"), "a"}}
	r.add(ha)
	if !isClosed(cha) || isClosed(chb) {
		t.Fatalf("after add(a): a woken %v, b woken %v", isClosed(cha), isClosed(chb))
	}
	if h1, h2 := <-a1, <-a2; h1 != ha || h2 != ha {
		t.Fatalf("a's waiters got %+v %+v", h1, h2)
	}
	waitFor(t, "a's waiters to end", func() bool { return r.numWaiters() == 1 })
	r.mu.Lock()
	_, aLeft := r.waits["a"]
	r.mu.Unlock()
	if aLeft || r.numWaitKeys() != 1 {
		t.Fatalf("wait entries after a: a left %v, %d keys", aLeft, r.numWaitKeys())
	}
	select {
	case h := <-b:
		t.Fatalf("b's waiter returned %+v", h)
	default:
	}

	// An add and a drop before b's waiter looks: it waits again.
	r.mu.Lock()
	close(r.waits["b"].ch)
	delete(r.waits, "b")
	r.mu.Unlock()
	waitFor(t, "b to wait again", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		w := r.waits["b"]
		return w != nil && w.ch != chb && r.waiters == 1
	})
	hb := &pdHold{reqID: "rb", keys: []string{reqKey("rb"), "b"}}
	r.add(hb)
	if h := <-b; h != hb {
		t.Fatalf("b's waiter got %+v", h)
	}
	if r.numWaiters() != 0 || r.numWaitKeys() != 0 {
		t.Fatalf("waiters %d, keys %d", r.numWaiters(), r.numWaitKeys())
	}

	// At the cap: a held key is still answered, a missing one refused; a
	// cancelled waiter frees its slot and its entry.
	full := newPDRegistry(1)
	full.add(hb)
	c := waitAsync(ctx, full, "c")
	waitFor(t, "c to wait", func() bool { return full.numWaiters() == 1 })
	if h, err := full.wait(ctx, nil, "b", time.Hour); h != hb || err != nil {
		t.Fatalf("held key at the cap: %+v %v", h, err)
	}
	if h, err := full.wait(ctx, nil, "d", time.Hour); h != nil || !errors.Is(err, errPDWaitersFull) {
		t.Fatalf("missing key at the cap: %+v %v", h, err)
	}
	cancel()
	if h := <-c; h != nil {
		t.Fatalf("cancelled waiter got %+v", h)
	}
	if full.numWaiters() != 0 || full.numWaitKeys() != 0 {
		t.Fatalf("after cancel: waiters %d, keys %d", full.numWaiters(), full.numWaitKeys())
	}
}

// stalledPOST sends a side-channel POST's headers and the start of its
// body on a fresh connection to addr, then stalls; it returns the
// connection, with a generous safety deadline on reads.
func stalledPOST(t *testing.T, addr, path string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetReadDeadline(time.Now().Add(time.Minute)) // safety only
	req := "POST " + path + " HTTP/1.1\r\nHost: " + addr + "\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"remote_request_id\":"
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	return c, bufio.NewReader(c)
}

// A side-channel body that stalls is cut off at PDConfig.BodyTimeout:
// 408 and the connection closed, on the main listener and the bootstrap
// listener alike. The deadline does not outlive the request: the next
// request on a connection, to the main API, reads its body as before.
func TestPDSlowBodyCutOff(t *testing.T) {
	ps, p := newTestServer(t, ServerConfig{PD: PDConfig{BodyTimeout: 50 * time.Millisecond, BootstrapAddr: "127.0.0.1:0"}})
	main := strings.TrimPrefix(p.URL, "http://")
	for _, c := range []struct{ addr, path string }{
		{main, pdPathPrefix + "v1/release"},
		{main, pdPathPrefix + "v1/read"},
		{ps.BootstrapAddr(), pdPathPrefix + "v1/release"},
	} {
		conn, br := stalledPOST(t, c.addr, c.path)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("%s %s: %v", c.addr, c.path, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(body), "request_timeout") {
			t.Fatalf("%s %s: %d %s", c.addr, c.path, resp.StatusCode, body)
		}
		if n, err := br.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
			t.Fatalf("%s %s: the connection stayed open (%d, %v)", c.addr, c.path, n, err)
		}
		conn.Close()
	}

	// A side-channel request, then a main-API request on the same
	// connection whose body comes later than BodyTimeout.
	conn, err := net.Dial("tcp", main)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(time.Minute)) // safety only
	br := bufio.NewReader(conn)
	rel := `{"remote_request_id":"none"}`
	if _, err := io.WriteString(conn, "POST "+pdPathPrefix+"v1/release HTTP/1.1\r\nHost: x\r\nContent-Length: "+strconv.Itoa(len(rel))+"\r\n\r\n"+rel); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("release of nothing: %d", resp.StatusCode)
	}
	comp := `{"model":"` + testModel + `","prompt":"hello","max_tokens":2}`
	if _, err := io.WriteString(conn, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "+strconv.Itoa(len(comp))+"\r\n\r\n"+comp[:5]); err != nil {
		t.Fatal(err)
	}
	time.Sleep(4 * ps.pd.BodyTimeout) // longer than a side-channel body may take
	if _, err := io.WriteString(conn, comp[5:]); err != nil {
		t.Fatal(err)
	}
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("a slow main-API body after a side-channel request: %d %s", resp.StatusCode, body)
	}
}

// The /read bound admits the largest body a hold can match: every block
// of the engine, each the largest int32, with ids of the largest size.
func TestPDReadBodyLimit(t *testing.T) {
	ps, _ := newTestServer(t, ServerConfig{})
	n := ps.EngineConfig().NumBlocks
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = math.MaxInt32
	}
	long := strings.Repeat("\u2028", maxPDString/3) // 3 bytes, 6 escaped
	b, _ := json.Marshal(map[string]any{"remote_engine_id": long, "remote_request_id": long, "remote_block_ids": ids})
	if int64(len(b)) > ps.pdReadBody || ps.pdReadBody > pdReadBodyLimit(MaxRemoteBlockIDs) {
		t.Fatalf("a %d-byte /read body of %d blocks; limit %d", len(b), n, ps.pdReadBody)
	}
	if pdReadBodyLimit(1<<30) != pdReadBodyLimit(MaxRemoteBlockIDs) {
		t.Fatal("the /read bound grows past MaxRemoteBlockIDs")
	}
}

// The limits' configuration: defaults, and negative values refused.
func TestPDLimitsConfig(t *testing.T) {
	c, err := PDConfig{}.withDefaults()
	if err != nil || c.MaxWaiters != DefaultPDMaxWaiters || c.BodyTimeout != DefaultPDBodyTimeout {
		t.Fatalf("defaults %+v %v", c, err)
	}
	for _, bad := range []PDConfig{{MaxWaiters: -1}, {BodyTimeout: -time.Second}} {
		if _, err := NewServer(ServerConfig{PD: bad}); err == nil {
			t.Fatalf("%+v accepted", bad)
		}
	}
}
