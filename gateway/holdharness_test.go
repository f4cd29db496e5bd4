package gateway

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
)

// TestSlowReadersHeldMemory is a measurement, not a check (run it with
// INFERGATE_HOLD_HARNESS=1 go test -run SlowReaders -v ./gateway): 100
// clients ask for a 100 MB non-streaming answer and never read it; once
// nothing moves any more, it reports the live heap of the process (gateway
// and engine) after a GC.
func TestSlowReadersHeldMemory(t *testing.T) {
	if os.Getenv("INFERGATE_HOLD_HARNESS") == "" {
		t.Skip("a measurement: set INFERGATE_HOLD_HARNESS=1")
	}
	const clients, answer = 100, 100 << 20
	var written atomic.Int64
	chunk := []byte(strings.Repeat("a", 64<<10))
	eng := newServerNoCleanup(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != pathCompletions {
			return
		}
		w.Header().Set("Content-Type", "application/json")
		for n := 0; n < answer && r.Context().Err() == nil; n += len(chunk) {
			m, err := w.Write(chunk)
			written.Add(int64(m))
			if err != nil {
				return
			}
		}
	}))
	defer eng.Close()
	cfg := testConfig(sched.RoundRobin)
	cfg.HealthCheckPath = healthCheckOff
	cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000}}
	_, url := startGateway(t, cfg)
	addr := strings.TrimPrefix(url, "http://")
	body := `{"model":"m","prompt":"x"}`
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	for range clients {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.(*net.TCPConn).SetReadBuffer(4 << 10)
		fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", pathCompletions, addr, len(body), body)
		conns = append(conns, c)
	}
	last, still := int64(-1), 0
	for still < 10 { // 1 s without a byte more
		time.Sleep(100 * time.Millisecond)
		if n := written.Load(); n == last {
			still++
		} else {
			last, still = n, 0
		}
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	t.Logf("%d clients not reading a %d MiB answer: engines wrote %d MiB; live heap %d MiB, heap in use %d MiB, from the OS %d MiB",
		clients, answer>>20, last>>20, ms.HeapAlloc>>20, ms.HeapInuse>>20, ms.Sys>>20)
}
