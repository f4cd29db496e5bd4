package gateway

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// TLSConfig terminates TLS on the gateway's listener.
type TLSConfig struct {
	// CertFile is the PEM certificate chain (leaf first).
	CertFile string `yaml:"cert_file"`
	// KeyFile is the PEM private key of the leaf.
	KeyFile string `yaml:"key_file"`
	// MinVersion is the lowest TLS version accepted: "1.2" (default) or
	// "1.3".
	MinVersion string `yaml:"min_version"`
}

// Enabled reports whether a certificate is configured.
func (t TLSConfig) Enabled() bool { return t.CertFile != "" || t.KeyFile != "" }

func (t TLSConfig) validate() error {
	if t.Enabled() && (t.CertFile == "" || t.KeyFile == "") {
		return errors.New("tls: cert_file and key_file must be given together")
	}
	if _, err := tlsVersion(t.MinVersion); err != nil {
		return err
	}
	return nil
}

func tlsVersion(s string) (uint16, error) {
	switch s {
	case "", "1.2":
		return tls.VersionTLS12, nil
	case "1.3":
		return tls.VersionTLS13, nil
	}
	return 0, fmt.Errorf("tls.min_version %q: want 1.2 or 1.3", s)
}

// certReloadInterval is how often the certificate files are checked for a
// change (a renewed certificate is picked up without a restart).
const certReloadInterval = 10 * time.Second

// newTLSConfig returns the server TLS configuration: the certificate loaded
// now (an error if it cannot be), reloaded when its files change, TLS 1.2 or
// newer with Go's default cipher suites (forward-secret AEAD only for 1.2).
func newTLSConfig(t TLSConfig) (*tls.Config, error) {
	minV, err := tlsVersion(t.MinVersion)
	if err != nil {
		return nil, err
	}
	cl := &certLoader{certFile: t.CertFile, keyFile: t.KeyFile, interval: certReloadInterval}
	if err := cl.load(time.Now()); err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion:     minV,
		GetCertificate: cl.get,
	}, nil
}

// certLoader serves a certificate pair and reloads it when either file's
// modification time or size changes, checking at most once per interval.
type certLoader struct {
	certFile, keyFile string
	interval          time.Duration

	mu      sync.Mutex
	cert    *tls.Certificate
	stamp   [2]fileStamp
	checked time.Time
}

type fileStamp struct {
	mod  time.Time
	size int64
}

func stampOf(path string) (fileStamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	return fileStamp{fi.ModTime(), fi.Size()}, nil
}

// load reads the pair if its files changed since the last load.
func (cl *certLoader) load(now time.Time) error {
	cl.checked = now
	cs, err := stampOf(cl.certFile)
	if err != nil {
		return fmt.Errorf("tls.cert_file: %w", err)
	}
	ks, err := stampOf(cl.keyFile)
	if err != nil {
		return fmt.Errorf("tls.key_file: %w", err)
	}
	if cl.cert != nil && cl.stamp == [2]fileStamp{cs, ks} {
		return nil
	}
	pair, err := tls.LoadX509KeyPair(cl.certFile, cl.keyFile)
	if err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	cl.cert, cl.stamp = &pair, [2]fileStamp{cs, ks}
	return nil
}

// get is tls.Config.GetCertificate: the current pair, after a reload check
// when the interval has passed (a failed reload keeps the previous pair).
func (cl *certLoader) get(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if now := time.Now(); now.Sub(cl.checked) >= cl.interval {
		if err := cl.load(now); err != nil {
			slog.Warn("gateway: TLS certificate reload failed; keeping the previous one", "err", err)
		}
	}
	return cl.cert, nil
}

// TLSEnabled reports whether Server terminates TLS (serve it with
// ServeTLS(ln, "", "") or ListenAndServeTLS("", "")).
func (g *Gateway) TLSEnabled() bool { return g.tlsConfig != nil }
