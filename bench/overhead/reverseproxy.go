package main

import (
	"errors"
	"flag"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"time"
)

// reverseProxyCmd serves a plain Go reverse proxy — net/http's server,
// httputil.ReverseProxy and http.Transport, round-robin over the engines,
// flushing every write — as the "go-reverseproxy" target of run.sh: what a
// proxy costs in Go before any gateway logic, next to nginx's cost.
//
//	overhead reverseproxy --listen 127.0.0.1:18190 --endpoints http://127.0.0.1:18101,http://127.0.0.1:18102
func reverseProxyCmd(args []string) error {
	fs := flag.NewFlagSet("reverseproxy", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:18190", "address to serve on")
	endpoints := fs.String("endpoints", "", "comma-separated engine base URLs")
	_ = fs.Parse(args)
	var targets []*url.URL
	for _, e := range strings.Split(*endpoints, ",") {
		u, err := url.Parse(strings.TrimSpace(e))
		if err != nil || u.Host == "" {
			return errors.New("reverseproxy: --endpoints needs base URLs like http://127.0.0.1:8000")
		}
		targets = append(targets, u)
	}
	var next atomic.Uint64
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(targets[next.Add(1)%uint64(len(targets))])
		},
		Transport: &http.Transport{
			MaxIdleConnsPerHost: 1024, IdleConnTimeout: 90 * time.Second,
			DisableCompression: true, ForceAttemptHTTP2: false,
		},
		FlushInterval: -1, // flush after every write, as an SSE proxy must
	}
	srv := &http.Server{Addr: *listen, Handler: rp, ReadHeaderTimeout: 10 * time.Second}
	return srv.ListenAndServe()
}
