package disagg

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"
)

// Send sends one leg's body to its engine under ctx and returns the
// engine's answer (the caller builds the request: URL, headers, the same
// X-Request-Id on both legs). The flows close every body they are given.
type Send func(ctx context.Context, body []byte) (*http.Response, error)

// Why a leg failed (LegError.Reason; the gateway's metric label values).
const (
	ReasonConnect   = "connect_failure" // no answer: the connection failed
	Reason5xx       = "5xx"             // an engine error status
	ReasonStatus    = "status"          // another non-2xx status (the request's fault, not the engine's)
	ReasonTimeout   = "timeout"         // the leg's timeout
	ReasonBadParams = "bad_params"      // an answer without usable kv_transfer_params
	ReasonCanceled  = "canceled"        // the caller's context ended
)

// LegError is a failed leg: why (a Reason* constant), the engine's status
// when it answered, and the error.
type LegError struct {
	Reason string
	Status int
	Err    error
}

func (e *LegError) Error() string {
	if e.Status != 0 {
		return fmt.Sprintf("prefill leg: %s (status %d): %v", e.Reason, e.Status, e.Err)
	}
	return fmt.Sprintf("prefill leg: %s: %v", e.Reason, e.Err)
}

func (e *LegError) Unwrap() error { return e.Err }

// exchange sends body under ctx bounded by timeout (0: none), reads the
// answer (at most MaxResponseBytes) and classifies a failure.
func exchange(ctx context.Context, timeout time.Duration, send Send, body []byte) ([]byte, *LegError) {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	resp, err := send(ctx, body)
	if err != nil {
		return nil, classify(ctx, err, 0)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, MaxResponseBytes+1))
	switch {
	case err != nil:
		return nil, classify(ctx, err, resp.StatusCode)
	case resp.StatusCode >= 500:
		return b, &LegError{Reason: Reason5xx, Status: resp.StatusCode, Err: fmt.Errorf("engine answered %d", resp.StatusCode)}
	case resp.StatusCode/100 != 2:
		return b, &LegError{Reason: ReasonStatus, Status: resp.StatusCode, Err: fmt.Errorf("engine answered %d", resp.StatusCode)}
	case len(b) > MaxResponseBytes:
		return nil, &LegError{Reason: ReasonBadParams, Status: resp.StatusCode, Err: fmt.Errorf("answer over %d bytes", MaxResponseBytes)}
	}
	return b, nil
}

// classify names the failure err of a leg sent under ctx.
func classify(ctx context.Context, err error, status int) *LegError {
	reason := ReasonConnect
	var ne net.Error
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded),
		errors.As(err, &ne) && ne.Timeout():
		reason = ReasonTimeout
	case ctx.Err() != nil:
		reason = ReasonCanceled
	}
	return &LegError{Reason: reason, Status: status, Err: err}
}

// RunPrefill runs NIXL's serial prefill leg: body (NIXLPrefillBody's) sent
// with send within timeout, and P's answer parsed (ParsePrefill). A
// failure is a *LegError.
func RunPrefill(ctx context.Context, timeout time.Duration, send Send, body []byte) (Prefill, *LegError) {
	b, le := exchange(ctx, timeout, send, body)
	if le != nil {
		return Prefill{}, le
	}
	p, err := ParsePrefill(b)
	if err != nil {
		return Prefill{}, &LegError{Reason: ReasonBadParams, Status: http.StatusOK, Err: err}
	}
	return p, nil
}

// Leg is a prefill leg sent beside its decode leg (Mooncake, SGLang): its
// answer is read to its end and discarded.
type Leg struct {
	cancel context.CancelFunc
	done   chan struct{}
	err    *LegError
	answer []byte // P's answer when it succeeded
}

// StartLeg sends body with send in a goroutine of its own, within timeout
// (0: none), under a context derived from ctx; Cancel or Wait end it.
func StartLeg(ctx context.Context, timeout time.Duration, send Send, body []byte) *Leg {
	ctx, cancel := context.WithCancel(ctx)
	l := &Leg{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(l.done)
		l.answer, l.err = exchange(ctx, timeout, send, body)
		if l.err != nil {
			l.answer = nil
		}
	}()
	return l
}

// Done is closed when the leg has ended.
func (l *Leg) Done() <-chan struct{} { return l.done }

// Wait waits for the leg's end and returns its failure (nil: P answered
// 2xx).
func (l *Leg) Wait() *LegError {
	<-l.done
	l.cancel()
	return l.err
}

// Cached waits for the leg's end and returns P's
// usage.prompt_tokens_details.cached_tokens (AnswerCached), false when the
// leg failed or P reported no usage.
func (l *Leg) Cached() (int, bool) {
	<-l.done
	if l.err != nil {
		return 0, false
	}
	return AnswerCached(l.answer)
}

// Cancel ends the leg (its request canceled, its connection closed) and
// waits for its goroutine; it returns the leg's failure, nil when it had
// already succeeded.
func (l *Leg) Cancel() *LegError {
	l.cancel()
	<-l.done
	return l.err
}

// QueryBootstrap asks a Mooncake P's bootstrap server (get sends GET
// BootstrapQueryPath to it) for the engine id of rank, within timeout.
func QueryBootstrap(ctx context.Context, timeout time.Duration, get Send, rank int) (string, *LegError) {
	b, le := exchange(ctx, timeout, get, nil)
	if le != nil {
		return "", le
	}
	id, err := ParseBootstrap(b, rank)
	if err != nil {
		return "", &LegError{Reason: ReasonBadParams, Status: http.StatusOK, Err: err}
	}
	return id, nil
}

// Release asks P (send posts to ReleasePath) to free the blocks p holds,
// within timeout: true when it released them, false when it held none
// (404: D read them, or they expired).
func Release(ctx context.Context, timeout time.Duration, send Send, p *Prefill) (bool, error) {
	return ReleaseWith(ctx, timeout, send, ReleaseBody(p))
}

// ReleaseWith is Release with the release body given: ReleaseBody's for a
// NIXL hold, ReleaseTransferBody's or ReleaseRoomBody's for the concurrent
// connectors' holds.
func ReleaseWith(ctx context.Context, timeout time.Duration, send Send, body []byte) (bool, error) {
	_, le := exchange(ctx, timeout, send, body)
	switch {
	case le == nil:
		return true, nil
	case le.Status == http.StatusNotFound:
		return false, nil
	}
	return false, le
}

// HostPort is the host:port of a base URL (its scheme's port when it names
// none), as llm-d's x-prefiller-host-port carries it.
func HostPort(host, port, scheme string) string {
	if port == "" {
		port = "80"
		if scheme == "https" {
			port = "443"
		}
	}
	return net.JoinHostPort(host, port)
}

// BootstrapAddr is a Mooncake remote_bootstrap_addr: http://<host>:<port>.
func BootstrapAddr(host string, port int) string {
	return "http://" + net.JoinHostPort(host, strconv.Itoa(port))
}
