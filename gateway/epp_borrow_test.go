package gateway

import (
	"context"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// borrowChat is the k-th of a few chats whose plain contents a pick
// borrows from its body: a long system prompt (the segment cache), a
// short user turn (the short segments' table), a name and a tool reply.
func borrowChat(k int) string {
	system := strings.Repeat("You answer in French, briefly. ", 20)
	return `{"model":"m0","max_tokens":8,"messages":[{"role":"system","content":"s` + strconv.Itoa(k) + ` ` + system +
		`"},{"role":"user","name":"u` + strconv.Itoa(k) + `","content":"turn ` + strconv.Itoa(k) + `"},` +
		`{"role":"assistant","content":"ok"},{"role":"tool","tool_call_id":"c1","content":"r` + strconv.Itoa(k) + `"}]}`
}

// TestPickBorrowedBodyScribbled: the endpoint picker's caller reuses its
// body buffer once Pick returns (the chat's contents were views of it)
// while other picks run: every pick's prompt tokens are those of the
// same chat picked on a fresh gateway, the tokens' caches never hold a
// text scribbled over, and the race detector sees no read of the buffer
// after Pick.
func TestPickBorrowedBodyScribbled(t *testing.T) {
	const chats = 6
	tokens := func(g *Gateway, body []byte) []uint32 {
		pk, ref := g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathChat, Header: http.Header{}, Body: body})
		if ref != nil {
			t.Errorf("refused: %d %s", ref.Status, ref.Body)
			return nil
		}
		toks := slices.Clone(pk.x.toks)
		clear(body) // the caller's buffer reused: zeros...
		for i := range body {
			body[i] = 'Z' // ...then another request's bytes
		}
		pk.Done()
		return toks
	}
	want := make([][]uint32, chats)
	for k := range chats {
		fresh, err := New(context.Background(), eppBenchConfig("cache-aware", 2, 1), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer fresh.Close()
		want[k] = tokens(fresh, []byte(borrowChat(k)))
		if len(want[k]) == 0 {
			t.Fatalf("chat %d: no prompt tokens", k)
		}
	}
	g, err := New(context.Background(), eppBenchConfig("cache-aware", 2, 1), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 0, 4<<10) // the caller's reused buffer
			for i := range 40 {
				k := (w + i) % chats
				buf = append(buf[:0], borrowChat(k)...)
				if got := tokens(g, buf); !slices.Equal(got, want[k]) {
					t.Errorf("worker %d pick %d (chat %d): %d tokens, want %d: %v", w, i, k, len(got), len(want[k]), got)
					return
				}
			}
		}()
	}
	wg.Wait()
}
