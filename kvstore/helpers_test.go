package kvstore

import (
	"bufio"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/infergate/infergate/kvevents"
)

// envRequire is e2e.EnvRequire: "1" fails, instead of skipping, a test
// whose tool (redis-server) is missing.
const envRequire = "INFERGATE_E2E_REQUIRE"

// wait is the bound of every wait in these tests: generous, never a
// measured duration.
const wait = 60 * time.Second

// startRedis starts a real redis-server on a free loopback port with its
// files in a temp dir, no persistence, and stops it at the test's end. It
// skips the test without redis-server (and in -short mode) unless
// INFERGATE_E2E_REQUIRE=1, which fails it instead.
func startRedis(t testing.TB) string {
	t.Helper()
	required := os.Getenv(envRequire) == "1"
	if testing.Short() && !required {
		t.Skip("skipping the redis-server test in -short mode")
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if required {
			t.Fatalf("redis-server not found in PATH (apt-get install redis-server); %s=1, so this is a failure", envRequire)
		}
		t.Skip("skipping: redis-server not found in PATH (apt-get install redis-server)")
	}
	dir := t.TempDir()
	for range 3 { // a free port can be taken before redis binds it
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		cmd := exec.Command(bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", dir, "--daemonize", "no", "--logfile", filepath.Join(dir, "redis.log"))
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		stop := func() {
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		if pingRedis(addr, exited) {
			t.Cleanup(stop)
			return addr
		}
		stop()
	}
	log, _ := os.ReadFile(filepath.Join(dir, "redis.log"))
	t.Fatalf("redis-server did not start; its log:\n%s", log)
	return ""
}

// pingRedis waits until addr answers PING, or the server exits.
func pingRedis(addr string, exited <-chan struct{}) bool {
	deadline := time.Now().Add(wait)
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return false
		default:
		}
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			_, _ = c.Write([]byte("PING\r\n"))
			line, _ := bufio.NewReader(c).ReadString('\n')
			c.Close()
			if strings.HasPrefix(line, "+PONG") {
				return true
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

// sink is a kvevents.Handler that keeps every event received and the set
// of hashes the stream says are held.
type sink struct {
	mu     sync.Mutex
	events []kvevents.Event
	held   map[uint64]bool
	resets int
}

func newSink() *sink { return &sink{held: map[uint64]bool{}} }

func (s *sink) KVBatch(_ uint64, b *kvevents.Batch) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range b.Events {
		e.BlockHashes = append([]uint64(nil), e.BlockHashes...)
		e.TokenIDs = append([]uint32(nil), e.TokenIDs...)
		s.events = append(s.events, e)
		for _, h := range e.BlockHashes {
			switch e.Type {
			case kvevents.BlockStored:
				s.held[h] = true
			case kvevents.BlockRemoved:
				delete(s.held, h)
			}
		}
	}
}

func (s *sink) KVReset(kvevents.ResetReason) {
	s.mu.Lock()
	s.resets++
	s.mu.Unlock()
}

// await polls until f (called with the sink locked) holds, failing the
// test after wait.
func (s *sink) await(t testing.TB, what string, f func(*sink) bool) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for {
		s.mu.Lock()
		ok := f(s)
		n := len(s.events)
		s.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting %v for %s; %d events so far", wait, what, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// find returns the last event of type typ for hash h.
func (s *sink) find(typ kvevents.Type, h uint64) (kvevents.Event, bool) {
	for i := len(s.events) - 1; i >= 0; i-- {
		if e := s.events[i]; e.Type == typ && len(e.BlockHashes) > 0 && e.BlockHashes[0] == h {
			return e, true
		}
	}
	return kvevents.Event{}, false
}

// subscribe runs a subscriber of the publisher at endpoint (with its
// replay socket) into a new sink until the test's end.
func subscribe(t testing.TB, endpoint, replay string) *sink {
	t.Helper()
	sub, err := kvevents.NewSubscriber(kvevents.SubscriberConfig{Endpoint: endpoint, ReplayEndpoint: replay})
	if err != nil {
		t.Fatal(err)
	}
	s := newSink()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = sub.Run(ctx, s) }()
	t.Cleanup(func() { cancel(); <-done })
	return s
}
