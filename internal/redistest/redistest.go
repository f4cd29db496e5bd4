// Package redistest starts a real redis-server for tests (kvstore's and the
// replicas' exchange): on a loopback port, no persistence,
// its files in the test's temp dir, killed at the test's end. Without
// redis-server the test skips, unless INFERGATE_E2E_REQUIRE=1, which fails
// it instead (.ci/run installs redis-server and sets it).
package redistest

import (
	"bufio"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infergate/infergate/internal/childproc"
	"github.com/infergate/infergate/internal/realpart"
)

// Wait bounds every wait of these helpers: generous, never a measured
// duration.
const Wait = 60 * time.Second

// Server is a running redis-server.
type Server struct {
	Addr string
	stop func()
}

// URL is the server's redis:// URL.
func (s *Server) URL() string { return "redis://" + s.Addr }

// Stop kills the server (idempotent; also done at the test's end).
func (s *Server) Stop() { s.stop() }

// Start starts a redis-server on a free loopback port (port 0) or on
// port, skipping or failing the test without the binary.
func Start(t testing.TB, port int) *Server {
	t.Helper()
	realpart.SkipShort(t, "the redis-server test")
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		realpart.Missing(t, errors.New("redis-server not found in PATH (apt-get install redis-server)"))
	}
	dir := t.TempDir()
	for range 3 { // a free port can be taken before redis binds it
		p := port
		if p == 0 {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			p = ln.Addr().(*net.TCPAddr).Port
			ln.Close()
		}
		cmd := exec.Command(bin, "--port", strconv.Itoa(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", dir, "--daemonize", "no", "--logfile", filepath.Join(dir, "redis.log"))
		cmd.SysProcAttr = childproc.Group()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		stopped := false
		stop := func() {
			if !stopped {
				stopped = true
				_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
				<-exited
			}
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
		if ping(addr, exited) {
			t.Cleanup(stop)
			return &Server{Addr: addr, stop: stop}
		}
		stop()
	}
	log, _ := os.ReadFile(filepath.Join(dir, "redis.log"))
	t.Fatalf("redis-server did not start; its log:\n%s", log)
	return nil
}

// ping waits until addr answers PING, or the server exits.
func ping(addr string, exited <-chan struct{}) bool {
	deadline := time.Now().Add(Wait)
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
