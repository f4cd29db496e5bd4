package replica

import (
	"fmt"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/infergate/infergate/sched"
)

// urlTarget knows n endpoints by URL and learns nothing: a receiver's
// Target for load reports.
type urlTarget struct{ urls map[string]string }

func newURLTarget(n int) urlTarget {
	t := urlTarget{urls: make(map[string]string, n)}
	for i := range n {
		u := endpointURL(i)
		t.urls[u] = u
	}
	return t
}

func endpointURL(i int) string { return fmt.Sprintf("http://10.0.%d.%d:8000", i>>8, i&255) }

func (t urlTarget) Intern(url []byte) (string, bool) { s, ok := t.urls[string(url)]; return s, ok }

func (urlTarget) Resolve(string, string, sched.Role) (sched.PeerLearner, int, bool) {
	return nil, 0, false
}

func loadReport(id string, urls func(i int) string, n int) []byte {
	entries := make([]LoadEntry, n)
	for i := range entries {
		entries[i] = LoadEntry{Endpoint: urls(i), Load: Load{int64(i % 7), int64(i * 1000), int64(i * 300)}}
	}
	return AppendLoad(nil, id, 1, entries)
}

// cells is the number of load cells p holds over all peers.
func (p *Peers) cells() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, ps := range p.peers {
		n += len(ps.cells)
	}
	return n
}

// TestApplyLoadInterned: a peer's load report of 1,000 known endpoints,
// applied again and again, allocates nothing once its cells exist (it
// cost a string per endpoint and a map per report), and its loads are
// the report's, under this replica's own strings of the URLs.
func TestApplyLoadInterned(t *testing.T) {
	const n = 1000
	tg := newURLTarget(n)
	node := &Node{ID: "a", Peers: NewPeers(time.Hour), Target: tg}
	for _, id := range []string{"b", "c"} {
		msg := loadReport(id, endpointURL, n)
		if _, err := node.Apply(msg, 0); err != nil {
			t.Fatal(err)
		}
		if !raceEnabled {
			if a := testing.AllocsPerRun(20, func() { node.Apply(msg, 0) }); a != 0 {
				t.Errorf("peer %s: a load report of %d known endpoints allocates %v times", id, n, a)
			}
		}
	}
	for i := range n {
		if got, want := node.Peers.Sum(endpointURL(i), 0), (Load{2 * int64(i%7), 2 * int64(i*1000), 2 * int64(i*300)}); got != want {
			t.Fatalf("endpoint %d: %+v, want %+v", i, got, want)
		}
	}
	for url := range node.Peers.peers["b"].cells {
		if unsafe.StringData(url) != unsafe.StringData(tg.urls[url]) {
			t.Fatalf("cell %s keyed by a string of its own, not the target's", url)
		}
	}
	if c := node.Counts.Loads.Load(); c < 2 {
		t.Fatalf("%d loads applied", c)
	}
}

// TestHostileLoadReportsBounded: a peer that reports loads of endpoints
// this replica does not have — new URLs in every report, at the most
// entries a report may carry — and learns naming them, neither grows the
// load table nor makes the reader allocate per entry; from beyond
// MaxPeers peers, nothing is kept. Known endpoints in the same reports
// are kept.
func TestHostileLoadReportsBounded(t *testing.T) {
	const known = 16
	node := &Node{ID: "a", Peers: NewPeers(time.Hour), Target: newURLTarget(known)}
	report := 0
	hostile := func(i int) string {
		if i < known {
			return endpointURL(i)
		}
		return "http://evil-" + strconv.Itoa(report) + "-" + strconv.Itoa(i) + ".example:1"
	}
	for report = range 50 {
		msg := loadReport("evil", hostile, MaxLoadEntries)
		if _, err := node.Apply(msg, 0); err != nil {
			t.Fatal(err)
		}
		if _, err := node.Apply(AppendLearn(nil, "evil", 1, "m", hostile(known+report), 100, 100, []uint64{1}), 0); err != nil {
			t.Fatal(err)
		}
	}
	if c := node.Peers.cells(); c != known {
		t.Fatalf("%d load cells after 50 hostile reports, want the %d known endpoints'", c, known)
	}
	if got := node.Peers.Sum(endpointURL(3), 0); got != (Load{3, 3000, 900}) {
		t.Fatalf("known endpoint's load %+v", got)
	}
	if u := node.Counts.Unknown.Load(); u != 50 {
		t.Fatalf("%d learns of unknown endpoints counted, want 50", u)
	}
	msg := loadReport("evil", hostile, MaxLoadEntries)
	if !raceEnabled {
		if a := testing.AllocsPerRun(10, func() { node.Apply(msg, 0) }); a != 0 {
			t.Errorf("a report of %d unknown endpoints allocates %v times", MaxLoadEntries-known, a)
		}
	}
	// Many peers: at most MaxPeers tables of the known endpoints.
	for i := range 3 * MaxPeers {
		node.Apply(loadReport("peer-"+strconv.Itoa(i), hostile, 64), 0)
	}
	if c := node.Peers.cells(); c > MaxPeers*known {
		t.Fatalf("%d load cells from %d peers, at most %d", c, 3*MaxPeers, MaxPeers*known)
	}
}

// TestDecodeKeepsUnknownLoads: Decode without a Target keeps every entry
// (the replay check, tools); the reused Msg's id and model strings are
// the same values.
func TestDecodeKeepsUnknownLoads(t *testing.T) {
	var m Msg
	for range 3 {
		for _, id := range []string{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"} {
			b := loadReport(id, endpointURL, 5)
			if err := Decode(b, &m); err != nil || m.ID != id || len(m.Loads) != 5 || m.Loads[4].Endpoint != endpointURL(4) {
				t.Fatalf("%v %+v", err, m)
			}
			if err := Decode(AppendLearn(nil, id, 1, "model-"+id, "http://x", 1, 1, nil), &m); err != nil || m.ID != id || m.Model != "model-"+id || m.Endpoint != "http://x" {
				t.Fatalf("%v %+v", err, m)
			}
		}
	}
}
