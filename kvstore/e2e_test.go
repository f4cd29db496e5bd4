package kvstore

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/infergate/infergate/internal/childproc"
	"github.com/infergate/infergate/kvevents"
)

// lockedBuffer collects a child's output.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// buildInfergate builds cmd/infergate into dir with the go command running
// the tests.
func buildInfergate(t *testing.T, dir string) string {
	t.Helper()
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(goBin); err != nil {
		if goBin, err = exec.LookPath("go"); err != nil {
			t.Fatal("no go command to build infergate")
		}
	}
	out := filepath.Join(dir, "infergate")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if msg, err := exec.CommandContext(ctx, goBin, "build", "-o", out, "github.com/infergate/infergate/cmd/infergate").CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/infergate: %v\n%s", err, msg)
	}
	return out
}

// TestKVStoreProcess runs `infergate kvstore` as its own process with a
// real Redis: blocks put over the native API come back over ZeroMQ as
// BlockStored REMOTE events, real bytes move through the native API and
// lm://, a block LMCache writes to Redis is published, deletes are
// BlockRemoved, and SIGTERM stops it cleanly.
func TestKVStoreProcess(t *testing.T) {
	redisAddr := startRedis(t)
	dir := t.TempDir()
	bin := buildInfergate(t, dir)
	var out lockedBuffer
	cmd := exec.Command(bin, "kvstore", "--listen", "127.0.0.1:0", "--lm-listen", "127.0.0.1:0",
		"--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0", "--model", "m",
		"--memory-bytes", "4MiB", "--disk-dir", filepath.Join(dir, "disk"), "--disk-bytes", "16MiB",
		"--redis", "redis://"+redisAddr+"/0")
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = childproc.Group()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		select {
		case <-exited:
		case <-time.After(wait):
		}
	})
	re := regexp.MustCompile(`msg="kvstore listening" api=(\S+) .*lm=lm://(\S+) .*events=(\S+) topic=(\S+) replay=(\S+)`)
	var m []string
	deadline := time.Now().Add(wait)
	for m == nil {
		m = re.FindStringSubmatch(out.String())
		if m != nil {
			break
		}
		select {
		case err := <-exited:
			t.Fatalf("infergate kvstore exited (%v):\n%s", err, out.String())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no listening line:\n%s", out.String())
		}
	}
	api, lmAddr, events, topic, replay := m[1], m[2], m[3], m[4], m[5]
	if topic != "kv@kvstore@m" {
		t.Errorf("topic %q", topic)
	}
	snk := subscribe(t, events, replay)
	ctx := context.Background()
	c, err := NewClient(api, ClientConfig{Timeout: wait})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	// A metadata-only chain (the simulator's way) and a real 1 MiB block.
	p := uint64(1)
	data := bytes.Repeat([]byte("kvstore!"), 1<<17)
	if _, err := c.Put(ctx, "m", "", []Block{
		{Hash: 1, Size: 1 << 20, TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 4},
		{Hash: 2, Size: 1 << 20, TokenIDs: []uint32{5, 6, 7, 8}, BlockSize: 4, ParentBlockHash: &p},
		{Hash: 3, Data: data},
	}); err != nil {
		t.Fatal(err)
	}
	snk.await(t, "BlockStored for the put blocks", func(s *sink) bool { return s.held[1] && s.held[2] && s.held[3] })
	snk.mu.Lock()
	e, _ := snk.find(kvevents.BlockStored, 2)
	snk.mu.Unlock()
	if e.Medium != "REMOTE" || !e.HasParent || e.ParentBlockHash != 1 || len(e.TokenIDs) != 4 || e.TokenIDs[0] != 5 || e.BlockSize != 4 {
		t.Fatalf("event %+v", e)
	}
	if n, err := c.Lookup(ctx, "m", "", []uint64{1, 2, 3, 4}); n != 3 || err != nil {
		t.Fatalf("lookup %d %v", n, err)
	}
	if info, ok, err := c.Get(ctx, Key{Model: "m", Hash: 3}, true); !ok || err != nil || !bytes.Equal(info.Data, data) {
		t.Fatalf("get: %v %v", ok, err)
	}
	// The same block over lm:// (native key string), and back over lm://.
	lm, err := net.DialTimeout("tcp", lmAddr, wait)
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	k3 := Key{Model: "m", Hash: 3}.String()
	lm.Write(specHeader(LMGet, 0, 1, 2, 0, [4]int32{}, k3))
	if r := readReply(t, lm); r.Code != 200 || r.Length != 1<<20 {
		t.Fatalf("lm GET %+v", r)
	}
	got := make([]byte, 1<<20)
	if _, err := readFull(lm, got); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("lm GET payload: %v", err)
	}
	lmKey := "m@1@0@beef@bfloat16"
	lm.Write(append(specHeader(LMPut, int32(len(data)), 1, 3, 0, [4]int32{2, 1, 1, 1}, lmKey), data...))
	snk.await(t, "BlockStored for the lm:// PUT", func(s *sink) bool { return s.held[0xbeef] })
	// What LMCache writes to the shared Redis is published too.
	raw := rawRedis(t, redisAddr)
	raw.Set(ctx, "m@1@0@cafe@bfloat16kv_bytes", []byte("x"), 0)
	raw.Set(ctx, "m@1@0@cafe@bfloat16metadata", EncodeRedisMeta(Meta{Size: 1}), 0)
	snk.await(t, "BlockStored for LMCache's Redis write", func(s *sink) bool { return s.held[0xcafe] })
	// And the lm:// block reached Redis in LMCache's layout.
	if b, err := raw.Get(ctx, lmKey+"kv_bytes").Bytes(); err != nil || !bytes.Equal(b, data) {
		t.Fatalf("lm:// block in Redis: %v", err)
	}
	if n, err := c.Delete(ctx, "m", "", []uint64{1, 3}); n != 2 || err != nil {
		t.Fatalf("delete %d %v", n, err)
	}
	snk.await(t, "BlockRemoved for the deleted blocks", func(s *sink) bool { return !s.held[1] && !s.held[3] && s.held[2] })

	_ = syscall.Kill(cmd.Process.Pid, syscall.SIGTERM)
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, out.String())
		}
	case <-time.After(wait):
		t.Fatalf("no exit within %v of SIGTERM:\n%s", wait, out.String())
	}
	if !regexp.MustCompile(`kvstore stopped`).MatchString(out.String()) {
		t.Fatalf("no clean stop in the log:\n%s", out.String())
	}
	if files, _ := filepath.Glob(filepath.Join(dir, "disk", "*.kvb")); len(files) != 0 {
		t.Fatalf("%d disk files left", len(files))
	}
}

func readFull(c net.Conn, b []byte) (int, error) {
	_ = c.SetReadDeadline(time.Now().Add(wait))
	n := 0
	for n < len(b) {
		k, err := c.Read(b[n:])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}
