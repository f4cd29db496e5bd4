package gateway

import (
	"fmt"
	"net"
	"strings"
	"testing"
)

// inSubsetScan is the subset match as a scan of the hint per endpoint
// (the picker's before subsetSet): the reference subsetSet must agree with.
func inSubsetScan(addr string, subset []string) bool {
	if addr == "" {
		return false
	}
	host := addr
	if h, _, err := net.SplitHostPort(addr); err == nil {
		host = h
	}
	for _, s := range subset {
		s = strings.TrimSpace(s)
		if s == addr || s == host || strings.Trim(s, "[]") == host {
			return true
		}
	}
	return false
}

// TestSubsetSet: the set matches exactly what the scan matched: ip:port,
// ip for any port, IPv6 in brackets or bare, entries with spaces; garbage
// matches nothing.
func TestSubsetSet(t *testing.T) {
	subsets := [][]string{
		nil,
		{},
		{"10.0.0.1:8000"},
		{" 10.0.0.1:8000 ", "10.0.0.2"},
		{"[fd00::1]:8000", "fd00::2", "[fd00::3]"},
		{"[10.0.0.1:8000]", "10.0.0.1:", ":8000", "", "  "},
		{"10.0.0.1:9000"},
	}
	addrs := []string{"", "10.0.0.1:8000", "10.0.0.2:8001", "10.0.0.3:8000", "[fd00::1]:8000", "[fd00::2]:80",
		"[fd00::3]:1", "[fd00::4]:8000", "10.0.0.1", "host-without-port"}
	for _, sub := range subsets {
		set := newSubsetSet(sub)
		for _, a := range addrs {
			if got, want := set.has(a), inSubsetScan(a, sub); got != want {
				t.Errorf("subset %q, addr %q: %v, want %v", sub, a, got, want)
			}
		}
	}
}

// FuzzSubsetSet: the set and the scan agree on any entries and address.
func FuzzSubsetSet(f *testing.F) {
	f.Add("10.0.0.1:8000,10.0.0.2", "10.0.0.2:80")
	f.Add("[fd00::1],fd00::2:1", "[fd00::1]:8000")
	f.Fuzz(func(t *testing.T, list, addr string) {
		sub := strings.Split(list, ",")
		if got, want := newSubsetSet(sub).has(addr), inSubsetScan(addr, sub); got != want {
			t.Fatalf("subset %q, addr %q: %v, want %v", sub, addr, got, want)
		}
	})
}

// BenchmarkEPPSubsetHint: a pick's subset match of 1,000 endpoints against
// the largest hint read (maxSubset 4,096 entries in package epp): 97 ms a
// pick as a scan per endpoint.
func BenchmarkEPPSubsetHint(b *testing.B) {
	var subset []string
	for j := range 4096 {
		subset = append(subset, fmt.Sprintf("10.%d.%d.%d:8000", j>>16, (j>>8)&255, j&255))
	}
	addrs := make([]string, 1000)
	for j := range addrs {
		addrs[j] = fmt.Sprintf("10.9.%d.%d:8000", j>>8, j&255)
	}
	for b.Loop() {
		set := newSubsetSet(subset)
		for _, a := range addrs {
			set.has(a)
		}
	}
}
