package bench

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/infergate/infergate/measure"
)

// progress reports a replay's advance: a live bar on a terminal, a single
// summary line on any other writer, nothing for a nil writer. Safe for
// concurrent use.
type progress struct {
	w      io.Writer
	label  string
	bar    *progressbar.ProgressBar // nil unless w is a terminal
	mu     sync.Mutex
	errors int
}

func newProgress(w io.Writer, total int, label string) *progress {
	p := &progress{w: w, label: label}
	if label == "" {
		p.label = "replay"
	}
	if isTerminal(w) {
		p.bar = progressbar.NewOptions(total,
			progressbar.OptionSetWriter(w),
			progressbar.OptionSetDescription(p.label),
			progressbar.OptionShowCount(),
			progressbar.OptionSetItsString("req"),
			progressbar.OptionShowIts(),
			progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionSetWidth(30),
		)
	}
	return p
}

// isTerminal reports whether w is a file attached to a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// done records one finished request.
func (p *progress) done(failed bool) {
	if p == nil || p.w == nil {
		return
	}
	if failed {
		p.mu.Lock()
		p.errors++
		p.mu.Unlock()
	}
	if p.bar != nil {
		_ = p.bar.Add(1)
	}
}

// finish ends the bar and writes the summary line.
func (p *progress) finish(recs []measure.Record, scale float64) {
	if p == nil || p.w == nil {
		return
	}
	if p.bar != nil {
		_ = p.bar.Finish()
		fmt.Fprintln(p.w)
	}
	var dur float64
	for i := range recs {
		dur = max(dur, recs[i].ArrivalMs+recs[i].E2EMs)
	}
	p.mu.Lock()
	errs := p.errors
	p.mu.Unlock()
	fmt.Fprintf(p.w, "%s: %d requests, %d errors, %.1f s engine time (%.1f s wall)\n",
		p.label, len(recs), errs, dur/1000, dur/1000/scale)
}
