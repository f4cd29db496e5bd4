package kvstore

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// The client side of lm://, written from docs/PROTOCOLS.md §6.2 alone
// (struct "iiiiiiiii150s" native little-endian; reply "iiiiiiiii").

func specHeader(cmd, length, fmt, dtype, location int32, shape [4]int32, key string) []byte {
	var b bytes.Buffer
	for _, v := range []int32{cmd, length, fmt, dtype, location, shape[0], shape[1], shape[2], shape[3]} {
		binary.Write(&b, binary.LittleEndian, v)
	}
	b.WriteString(key + strings.Repeat(" ", 150-len(key)))
	return b.Bytes()
}

type specReply struct{ Code, Length, Fmt, Dtype, S0, S1, S2, S3, Location int32 }

func readReply(t *testing.T, c net.Conn) specReply {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	var r specReply
	if err := binary.Read(c, binary.LittleEndian, &r); err != nil {
		t.Fatalf("reading the 36-byte reply: %v", err)
	}
	return r
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func startLM(t *testing.T, s *Store, cfg LMConfig) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Logger = quietLogger()
	srv := NewLMServer(s, cfg)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return ln.Addr().String()
}

func dialLM(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestLMHeaderLayout(t *testing.T) {
	h := LMHeader{Command: LMPut, Length: 1 << 20, Fmt: 1, Dtype: 3, Location: 2, Shape: [4]int32{2, 32, 256, 1024}, Key: "m@1@0@ab@bfloat16"}
	b := AppendLMHeader(nil, h)
	if want := specHeader(1, 1<<20, 1, 3, 2, [4]int32{2, 32, 256, 1024}, h.Key); !bytes.Equal(b, want) || len(b) != 186 {
		t.Fatalf("header % x\nwant   % x", b, want)
	}
	got, err := ParseLMHeader(b)
	if err != nil || got != h {
		t.Fatalf("parse: %+v %v", got, err)
	}
	r := AppendLMReply(nil, LMReply{Code: 200, Length: 7, Fmt: 1, Dtype: 3, Shape: [4]int32{1, 2, 3, 4}, Location: 9})
	var want bytes.Buffer
	for _, v := range []int32{200, 7, 1, 3, 1, 2, 3, 4, 9} {
		binary.Write(&want, binary.LittleEndian, v)
	}
	if !bytes.Equal(r, want.Bytes()) || len(r) != 36 {
		t.Fatalf("reply % x", r)
	}
	if _, err := ParseLMHeader(b[:185]); err == nil {
		t.Fatal("short header parsed")
	}
}

func TestLMProtocol(t *testing.T) {
	s, _ := New(Config{MemoryBytes: 64 << 20, MaxObjectBytes: 4 << 20, Logger: quietLogger()})
	defer s.Close()
	addr := startLM(t, s, LMConfig{})
	c := dialLM(t, addr)
	key := "meta-llama/Llama-3.1-8B@1@0@1f2e3d@bfloat16"
	payload := make([]byte, 1<<20)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	shape := [4]int32{2, 28, 256, 512}

	// HEALTH, EXIST (miss), GET (miss): FAIL replies as LMCache's server sends them.
	c.Write(specHeader(LMHealth, 0, 0, 0, 0, [4]int32{}, ""))
	if r := readReply(t, c); r != (specReply{Code: 200, Fmt: 1, Dtype: 2}) {
		t.Fatalf("HEALTH: %+v", r)
	}
	c.Write(specHeader(LMExist, 0, 0, 0, 0, [4]int32{}, key))
	if r := readReply(t, c); r.Code != 400 {
		t.Fatalf("EXIST before PUT: %+v", r)
	}
	c.Write(specHeader(LMGet, 0, 1, 2, 0, [4]int32{}, key))
	if r := readReply(t, c); r != (specReply{Code: 400, Fmt: 1, Dtype: 2}) {
		t.Fatalf("GET before PUT: %+v", r)
	}
	// PUT in pieces (short writes), no reply; then EXIST and GET on the same connection.
	msg := append(specHeader(LMPut, int32(len(payload)), 1, 3, 1, shape, key), payload...)
	for i := 0; i < len(msg); i += 65521 {
		c.Write(msg[i:min(i+65521, len(msg))])
	}
	c.Write(specHeader(LMExist, 0, 0, 0, 0, [4]int32{}, key))
	if r := readReply(t, c); r.Code != 200 {
		t.Fatalf("EXIST after PUT: %+v", r)
	}
	c.Write(specHeader(LMGet, 0, 1, 2, 0, [4]int32{}, key))
	r := readReply(t, c)
	if r.Code != 200 || r.Length != int32(len(payload)) || r.Fmt != 1 || r.Dtype != 3 || [4]int32{r.S0, r.S1, r.S2, r.S3} != shape {
		t.Fatalf("GET: %+v", r)
	}
	got := make([]byte, r.Length)
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("GET payload: %v, equal %v", err, bytes.Equal(got, payload))
	}
	// LIST and unknown commands: FAIL, connection kept.
	for _, cmd := range []int32{LMList, 0, -7, 99} {
		c.Write(specHeader(cmd, 0, 0, 0, 0, [4]int32{}, key))
		if r := readReply(t, c); r.Code != 400 {
			t.Fatalf("command %d: %+v", cmd, r)
		}
	}
	// The key space is shared with the native API and indexed by hash.
	if ki := ParseKey(key); !ki.Hashed || ki.Hash != 0x1f2e3d || !s.Held(key) {
		t.Fatalf("key %+v held %v", ki, s.Held(key))
	}
	// A PUT over the object bound, or negative, closes the connection.
	for _, n := range []int32{4<<20 + 1, -1} {
		c2 := dialLM(t, addr)
		c2.Write(specHeader(LMPut, n, 0, 0, 0, [4]int32{}, "big"))
		_ = c2.SetReadDeadline(time.Now().Add(30 * time.Second))
		if k, err := c2.Read(make([]byte, 1)); err == nil || k != 0 {
			t.Fatalf("PUT of %d: connection not closed (%d, %v)", n, k, err)
		}
	}
	if s.Held("big") {
		t.Fatal("oversized PUT stored")
	}
}

// TestLMHostile: short headers, stalled payloads and idle connections end
// at their timeouts; connections over the bound are refused; the server
// keeps serving and leaks no goroutines.
func TestLMHostile(t *testing.T) {
	before := runtime.NumGoroutine()
	s, _ := New(Config{MemoryBytes: 1 << 20, Logger: quietLogger()})
	defer s.Close()
	t.Run("hostile", func(t *testing.T) {
		addr := startLM(t, s, LMConfig{IdleTimeout: 200 * time.Millisecond, IOTimeout: 200 * time.Millisecond, MaxConns: 3})
		closed := func(c net.Conn) {
			t.Helper()
			_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
			if _, err := c.Read(make([]byte, 1)); err == nil {
				t.Fatal("connection not closed")
			}
		}
		a := dialLM(t, addr) // idle: closed after IdleTimeout
		b := dialLM(t, addr) // half a header
		b.Write(specHeader(LMGet, 0, 0, 0, 0, [4]int32{}, "k")[:100])
		c := dialLM(t, addr) // a PUT announcing 1000 bytes, sending 10
		c.Write(append(specHeader(LMPut, 1000, 0, 0, 0, [4]int32{}, "k"), make([]byte, 10)...))
		closed(a)
		closed(b)
		closed(c)
		if s.Held("k") {
			t.Fatal("a partial PUT was stored")
		}
		// Still serving.
		d := dialLM(t, addr)
		d.Write(specHeader(LMHealth, 0, 0, 0, 0, [4]int32{}, ""))
		if r := readReply(t, d); r.Code != 200 {
			t.Fatalf("HEALTH: %+v", r)
		}
	})
	// The subtest's cleanups closed the server and the connections: its
	// goroutines must go.
	deadline := time.Now().Add(30 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		buf := make([]byte, 1<<16)
		t.Errorf("goroutines: %d before, %d after\n%s", before, n, buf[:runtime.Stack(buf, true)])
	}
}

// TestLMMaxConns: past MaxConns a new connection takes the place of the
// one idle the longest (idle connections cannot keep clients out: an attack
// run locked lm:// with 64 of them), and is refused when every connection
// is being served.
func TestLMMaxConns(t *testing.T) {
	s, _ := New(Config{MemoryBytes: 1 << 20, Logger: quietLogger()})
	defer s.Close()
	lm := NewLMServer(s, LMConfig{MaxConns: 1, Logger: quietLogger()})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go lm.Serve(ln)
	defer lm.Close()
	addr := ln.Addr().String()
	a := dialLM(t, addr)
	a.Write(specHeader(LMHealth, 0, 0, 0, 0, [4]int32{}, ""))
	readReply(t, a) // served; now idle, waiting for its next request
	for deadline := time.Now().Add(wait); busy(lm); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a never became idle")
		}
	}
	b := dialLM(t, addr)
	b.Write(specHeader(LMHealth, 0, 0, 0, 0, [4]int32{}, ""))
	if r := readReply(t, b); r.Code != LMSuccess {
		t.Fatalf("the new connection: %+v", r)
	}
	_ = a.SetReadDeadline(time.Now().Add(wait))
	if _, err := a.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the idle connection was not closed for the new one: %v", err)
	}
	// b is mid-request (half a header): busy, not evicted; c is refused.
	b.Write(specHeader(LMHealth, 0, 0, 0, 0, [4]int32{}, "")[:10])
	deadline := time.Now().Add(wait)
	for lm.Stats().Requests < 2 || !busy(lm) {
		if time.Now().After(deadline) {
			t.Fatal("b never became busy")
		}
		time.Sleep(time.Millisecond)
	}
	c := dialLM(t, addr)
	_ = c.SetReadDeadline(time.Now().Add(wait))
	if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a connection over MaxConns, every one busy, was kept: %v", err)
	}
	if st := lm.Stats(); st.Evicted != 1 || st.Rejected != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// busy reports whether every connection of lm is being served.
func busy(lm *LMServer) bool {
	lm.mu.Lock()
	defer lm.mu.Unlock()
	for _, idle := range lm.conns {
		if idle.Load() != 0 {
			return false
		}
	}
	return len(lm.conns) > 0
}

func FuzzLMHeader(f *testing.F) {
	f.Add(specHeader(LMPut, 10, 1, 2, 0, [4]int32{1, 2, 3, 4}, "m@1@0@ab@half"))
	f.Add(specHeader(LMGet, 0, 0, 0, 0, [4]int32{}, ""))
	f.Add([]byte("short"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ParseLMHeader(b)
		if len(b) != LMHeaderBytes {
			if err == nil {
				t.Fatalf("parsed %d bytes", len(b))
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(h.Key) > LMKeyBytes || strings.TrimSpace(h.Key) != h.Key {
			t.Fatalf("key %q", h.Key)
		}
		// Re-encoding gives the same integers and key.
		h2, err := ParseLMHeader(AppendLMHeader(nil, h))
		if err != nil || h2 != h {
			t.Fatalf("round trip: %+v vs %+v (%v)", h2, h, err)
		}
		_ = ParseKey(h.Key)
	})
}
