package upstream

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// lateAnswer is a fallback transport whose answer races the request's
// cancel and wins: it answers 200 once the request's context has ended (an
// engine whose handler the cancel ended, through net/http's HTTP/2 client,
// which may return the response rather than the cancel).
type lateAnswer struct{}

func (lateAnswer) RoundTrip(r *http.Request) (*http.Response, error) {
	<-r.Context().Done()
	return &http.Response{StatusCode: http.StatusOK, Header: http.Header{}, Body: io.NopCloser(strings.NewReader("")), Request: r}, nil
}

// TestWatchedRoundTripLateAnswer: an answer that arrives after the
// deadline canceled the request is the deadline's timeout, not an answer
// (it was a 200 with no Content-Type, failed as a bad response: 502 instead
// of 504 in TestStallOverTLS under load).
func TestWatchedRoundTripLateAnswer(t *testing.T) {
	u := New(Options{ConnectTimeout: 5 * time.Second, ResponseHeaderTimeout: 10 * time.Minute, IdleConnTimeout: 90 * time.Second, MaxIdleConnsPerHost: 64}, lateAnswer{})
	req, _ := http.NewRequest(http.MethodPost, "https://127.0.0.1:1/v1/chat/completions", strings.NewReader("{}"))
	resp, err := u.RoundTripBy(req, time.Now().Add(10*time.Millisecond), nil)
	if resp != nil {
		resp.Body.Close()
	}
	if !errors.Is(err, ErrTimeout) || !IsResponseTimeout(err) {
		t.Fatalf("RoundTripBy = %v, %v; want the deadline's timeout", resp, err)
	}
}
