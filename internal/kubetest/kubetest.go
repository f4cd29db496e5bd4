// Package kubetest runs a real Kubernetes API server for tests: etcd and
// kube-apiserver as child processes on free loopback ports, in a temporary
// directory, as controller-runtime's envtest does
// (sigs.k8s.io/controller-runtime pkg/internal/testing/controlplane), with
// the binaries scripts/kube.sh builds from the Go module proxy into the
// cache (${INFERGATE_CACHE:-$HOME/.cache/infergate}/kube/<Version>/).
// There is no kubelet, scheduler or controller-manager: pods are never
// scheduled or run, a test sets their status itself (SetPodReady), and
// nothing creates EndpointSlices, ServiceAccount tokens or garbage-collects
// owned objects.
//
// # Use
//
//	s := kubetest.Start(t, kubetest.Options{})   // skips when not built
//	cs := s.Clientset()                           // superuser client (k8s.io/client-go)
//	ns := s.Namespace(t, "disco")                 // fresh namespace "disco-xxxxx"
//	s.InstallInferencePoolCRD(t)                  // deploy/helm/infergate/crds/inferencepool.yaml, Established
//	s.CreatePod(t, ns, "vllm-0", map[string]string{"app": "vllm"}, 8000)
//	s.SetPodReady(t, ns, "vllm-0", "10.0.0.7", true) // status: Running, podIP, Ready=True
//	s.DeletePod(t, ns, "vllm-0")                  // gone at once (never scheduled)
//	run infergate --kubeconfig s.Kubeconfig ...   // the same identity as s.Config
//
// Start registers t.Cleanup to stop both processes and remove the directory.
// A package that shares one server across its tests calls New in TestMain
// and Stop after m.Run (New does not skip: check Binaries first).
//
// # What the server is
//
// kube-apiserver Version (k8s.io/kubernetes cmd/kube-apiserver) on
// https://127.0.0.1:<port> with a CA, serving certificate and client
// certificate generated per server (ECDSA P-256, valid 24 h).
// The test client's certificate has O=system:masters (full access whatever
// the authorizer). --authorization-mode=RBAC, so a test can check a Role
// by impersonating a ServiceAccount (rest.Config.Impersonate).
// --disable-admission-plugins=ServiceAccount (nothing creates the default
// ServiceAccount, as envtest), --service-cluster-ip-range=10.0.0.0/24.
// etcd (go.etcd.io/etcd/server/v3 ETCD_VERSION of scripts/kube.sh) listens
// on plain HTTP on loopback with --unsafe-no-fsync: its data is thrown away.
//
// --endpoint-reconciler-type=none: v1.37 refuses the loopback advertise
// address with the default reconciler, so the "kubernetes" Service has no
// endpoints.
//
// # Costs
//
// Measured with go test -race -count=1 -v -run TestServer ./internal/kubetest
// on 2 cores shared with other jobs (load average 12-19): start to /readyz
// 4.4-5.8 s; peak RSS kube-apiserver 281-297 MB, etcd 41 MB. README.md has
// the build's cost and the commands.
//
// # Limits
//
// A test binary killed outright (SIGKILL, or go test's -timeout) takes its
// etcd and kube-apiserver with it (Pdeathsig) but leaves its directory
// (os.TempDir()/infergate-kubetest-*). InferencePoolCRDPath finds the
// repository from this file's compiled-in path, so tests built with
// -trimpath cannot use it.
//
// # Environment
//
//	INFERGATE_KUBE_DIR     directory holding kube-apiserver and etcd, instead of the cache
//	INFERGATE_CACHE        cache root (default $HOME/.cache/infergate)
//	INFERGATE_E2E_REQUIRE  "1": a missing binary fails the test instead of skipping it
package kubetest

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/infergate/infergate/internal/childproc"
	"github.com/infergate/infergate/internal/realpart"
)

// Version is the Kubernetes release scripts/kube.sh builds by default
// (k8s.io/kubernetes module version; its go.mod asks for go 1.26.0). It
// must match the script's KUBE_VERSION default: it names the cache folder.
const Version = "v1.37.2"

// Environment variables read by this package.
const (
	EnvKubeDir = "INFERGATE_KUBE_DIR" // directory with kube-apiserver and etcd, instead of the cached build
	EnvCache   = realpart.EnvCache    // cache root (default $HOME/.cache/infergate)
	EnvRequire = realpart.EnvRequire  // "1": fail instead of skip when the binaries are missing
)

// Defaults for Options' zero values.
const (
	// DefaultStartTimeout bounds New from launch to /readyz answering ok.
	// A cold start takes a few seconds on an idle machine (README.md); the
	// bound is generous for a loaded 2-core machine.
	DefaultStartTimeout = 3 * time.Minute
	// DefaultStopTimeout bounds the wait for each process after SIGTERM;
	// it is then killed.
	DefaultStopTimeout = 20 * time.Second
)

// ErrNoBinaries reports that kube-apiserver or etcd is not available.
var ErrNoBinaries = errors.New("kubetest: kube-apiserver/etcd not available")

// Binaries locates kube-apiserver and etcd: in $INFERGATE_KUBE_DIR if set,
// else in the cache folder scripts/kube.sh build fills. The error wraps
// ErrNoBinaries and says how to get them.
func Binaries() (apiserver, etcd string, err error) {
	dir := os.Getenv(EnvKubeDir)
	how := EnvKubeDir + "=" + dir
	if dir == "" {
		dir = CacheDir()
		how = "not built; run scripts/kube.sh build (about 16 CPU-minutes cold), or set " + EnvKubeDir
	}
	apiserver, etcd = filepath.Join(dir, "kube-apiserver"), filepath.Join(dir, "etcd")
	for _, p := range []string{apiserver, etcd} {
		if e := realpart.Executable(p); e != nil {
			return "", "", fmt.Errorf("%w: %s: %s", ErrNoBinaries, p, how)
		}
	}
	return apiserver, etcd, nil
}

// CacheDir is where scripts/kube.sh build puts the binaries:
// ${INFERGATE_CACHE:-$HOME/.cache/infergate}/kube/<Version>.
func CacheDir() string {
	return realpart.CacheDir("kube", Version)
}

// Require returns the binaries, or skips the test with the reason (fails
// it instead when INFERGATE_E2E_REQUIRE=1). In -short mode it skips
// unless INFERGATE_E2E_REQUIRE=1, as the other real-process tests do.
func Require(t testing.TB) (apiserver, etcd string) {
	t.Helper()
	realpart.SkipShort(t, "the kube-apiserver test")
	apiserver, etcd, err := Binaries()
	if err != nil {
		realpart.Missing(t, err)
	}
	return apiserver, etcd
}

// Options configure one server. The zero value is the default server.
type Options struct {
	// StartTimeout bounds the start (default DefaultStartTimeout).
	StartTimeout time.Duration
	// StopTimeout bounds each process's exit after SIGTERM (default DefaultStopTimeout).
	StopTimeout time.Duration
	// APIServerFlags are extra kube-apiserver flags ("--feature-gates=..."),
	// after the package's own; a flag given twice takes the last value.
	APIServerFlags []string
	// Logs, when set, receives both processes' output as it is written
	// (default: only into files in Dir, whose tails errors quote).
	Logs io.Writer
}

// Server is a running etcd and kube-apiserver. Its fields are read-only.
type Server struct {
	// Config is a client configuration for the test's superuser (client
	// certificate, O=system:masters), QPS 200 / burst 400 so that client-go
	// does not throttle tests. Copy it (rest.CopyConfig) before changing it.
	Config *rest.Config
	// Kubeconfig is a kubeconfig file with the same identity, certificates
	// embedded (context "kubetest"), for a process started with --kubeconfig.
	Kubeconfig string
	// URL is the API server's https://127.0.0.1:<port>.
	URL string
	// EtcdURL is etcd's http://127.0.0.1:<port>.
	EtcdURL string
	// Dir holds certificates, etcd's data, the kubeconfig and both logs; Stop removes it.
	Dir string

	opts      Options
	apiserver *proc
	etcd      *proc
	restarts  int // StartAPIServer calls (its log files' numbers)
	stopOnce  sync.Once
	stopErr   error

	mu        sync.Mutex
	clientset *kubernetes.Clientset
	dyn       *dynamic.DynamicClient
}

// Start starts a server for t and stops it in t.Cleanup; it skips t when
// the binaries are missing (fails with INFERGATE_E2E_REQUIRE=1) and fails
// t when the server does not start.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	Require(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("kubetest: stop: %v", err)
		}
	})
	return s
}

// startAttempts is how many times New picks fresh ports when a process
// exits at start because another process took a port between the pick
// and the bind.
const startAttempts = 3

// New starts etcd and kube-apiserver and returns when the API server's
// /readyz answers ok, within opts.StartTimeout and ctx. The caller must
// call Stop. Errors quote the tail of the failing process's log.
func New(ctx context.Context, opts Options) (*Server, error) {
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = DefaultStartTimeout
	}
	if opts.StopTimeout <= 0 {
		opts.StopTimeout = DefaultStopTimeout
	}
	apiserverBin, etcdBin, err := Binaries()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, opts.StartTimeout)
	defer cancel()

	dir, err := os.MkdirTemp("", "infergate-kubetest-")
	if err != nil {
		return nil, err
	}
	s := &Server{Dir: dir, opts: opts}
	ok := false
	defer func() {
		if !ok {
			s.Stop()
		}
	}()
	if err := s.writeCerts(); err != nil {
		return nil, err
	}
	for attempt := 1; ; attempt++ {
		err := s.startEtcd(ctx, etcdBin, attempt)
		if err == nil {
			break
		}
		if attempt >= startAttempts || !errors.Is(err, errPortTaken) {
			return nil, err
		}
	}
	for attempt := 1; ; attempt++ {
		err := s.startAPIServer(ctx, apiserverBin, attempt)
		if err == nil {
			break
		}
		if attempt >= startAttempts || !errors.Is(err, errPortTaken) {
			return nil, err
		}
	}
	ok = true
	return s, nil
}

// Stop stops kube-apiserver, then etcd (SIGTERM, then SIGKILL after
// StopTimeout), and removes Dir. It is safe to call more than once.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() {
		var errs []error
		if s.apiserver != nil {
			errs = append(errs, s.apiserver.stop(s.opts.StopTimeout))
		}
		if s.etcd != nil {
			errs = append(errs, s.etcd.stop(s.opts.StopTimeout))
		}
		if s.Dir != "" {
			errs = append(errs, os.RemoveAll(s.Dir))
		}
		s.stopErr = errors.Join(errs...)
	})
	return s.stopErr
}

// Clientset returns a typed client for s.Config (one per server).
func (s *Server) Clientset() *kubernetes.Clientset {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.clientset == nil {
		s.clientset = kubernetes.NewForConfigOrDie(s.Config)
	}
	return s.clientset
}

// Dynamic returns a dynamic client for s.Config (one per server).
func (s *Server) Dynamic() *dynamic.DynamicClient {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dyn == nil {
		s.dyn = dynamic.NewForConfigOrDie(s.Config)
	}
	return s.dyn
}

// Logs returns the last n bytes of each process's log (kube-apiserver, etcd).
func (s *Server) Logs(n int) (apiserver, etcd string) {
	if s.apiserver != nil {
		apiserver = tail(s.apiserver.logPath, n)
	}
	if s.etcd != nil {
		etcd = tail(s.etcd.logPath, n)
	}
	return apiserver, etcd
}

// File names in Dir.
const (
	caCert         = "ca.crt"
	servingCert    = "apiserver.crt"
	servingKey     = "apiserver.key"
	saKey          = "sa.key"
	kubeconfigFile = "kubeconfig"
)

func (s *Server) path(name string) string { return filepath.Join(s.Dir, name) }

// writeCerts writes the CA, the API server's serving pair, the
// service-account signing key and the kubeconfig's client pair, and
// fills Config's TLS part.
func (s *Server) writeCerts() error {
	ca, err := newCA("infergate-kubetest-ca")
	if err != nil {
		return err
	}
	serving, err := newCert("kube-apiserver", nil,
		[]net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback, net.IPv4(10, 0, 0, 1)},
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
		false, ca, x509.ExtKeyUsageServerAuth)
	if err != nil {
		return err
	}
	client, err := newCert("kubetest-admin", []string{"system:masters"}, nil, nil, false, ca, x509.ExtKeyUsageClientAuth)
	if err != nil {
		return err
	}
	sa, err := newCA("service-accounts") // only its key is used: it signs ServiceAccount tokens
	if err != nil {
		return err
	}
	for name, data := range map[string][]byte{
		caCert: ca.certPEM, servingCert: serving.certPEM, servingKey: serving.keyPEM, saKey: sa.keyPEM,
	} {
		if err := os.WriteFile(s.path(name), data, 0o600); err != nil {
			return err
		}
	}
	s.Config = &rest.Config{
		TLSClientConfig: rest.TLSClientConfig{CAData: ca.certPEM, CertData: client.certPEM, KeyData: client.keyPEM},
		QPS:             200,
		Burst:           400,
		UserAgent:       "infergate-kubetest",
	}
	return nil
}

// writeKubeconfig writes Kubeconfig for Config (once URL is known).
func (s *Server) writeKubeconfig() error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: s.URL, CertificateAuthorityData: s.Config.CAData}
	cfg.AuthInfos["kubetest"] = &clientcmdapi.AuthInfo{ClientCertificateData: s.Config.CertData, ClientKeyData: s.Config.KeyData}
	cfg.Contexts["kubetest"] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: "kubetest", Namespace: "default"}
	cfg.CurrentContext = "kubetest"
	s.Kubeconfig = s.path(kubeconfigFile)
	return clientcmd.WriteToFile(*cfg, s.Kubeconfig)
}

// errPortTaken marks a start that failed because a picked port was taken.
var errPortTaken = errors.New("port taken")

func (s *Server) startEtcd(ctx context.Context, bin string, attempt int) error {
	ports, err := freePorts(2)
	if err != nil {
		return err
	}
	client := "http://127.0.0.1:" + strconv.Itoa(ports[0])
	peer := "http://127.0.0.1:" + strconv.Itoa(ports[1])
	data := s.path(fmt.Sprintf("etcd-%d", attempt))
	args := []string{
		"--name=kubetest",
		"--data-dir=" + data,
		"--listen-client-urls=" + client,
		"--advertise-client-urls=" + client,
		"--listen-peer-urls=" + peer,
		"--initial-advertise-peer-urls=" + peer,
		"--initial-cluster=kubetest=" + peer,
		"--unsafe-no-fsync=true", // throwaway data: no fsync wait on a loaded disk
		"--log-level=warn",
	}
	p, err := startProc(bin, args, s.path(fmt.Sprintf("etcd-%d.log", attempt)), s.opts.Logs)
	if err != nil {
		return err
	}
	s.etcd = p
	// etcd answers /health once it has elected itself leader.
	hc := &http.Client{Timeout: 5 * time.Second}
	err = p.waitReady(ctx, func(ctx context.Context) error {
		return httpOK(ctx, hc, client+"/health")
	})
	if err != nil {
		p.stop(s.opts.StopTimeout)
		s.etcd = nil
		return fmt.Errorf("kubetest: etcd did not start: %w", err)
	}
	s.EtcdURL = client
	return nil
}

func (s *Server) startAPIServer(ctx context.Context, bin string, attempt int) error {
	ports, err := freePorts(1)
	if err != nil {
		return err
	}
	return s.startAPIServerAt(ctx, bin, strconv.Itoa(ports[0]), fmt.Sprintf("kube-apiserver-%d.log", attempt))
}

// KillAPIServer kills kube-apiserver with SIGKILL (a crash, an OOM kill:
// its clients' connections break, their watches end) and waits for it to
// exit, within Options.StopTimeout; etcd and its data stay. StartAPIServer
// starts it again. Not safe for concurrent use with itself, StartAPIServer
// or Stop.
func (s *Server) KillAPIServer() error {
	p := s.apiserver
	if p == nil {
		return errors.New("kubetest: kube-apiserver is not running")
	}
	_ = p.cmd.Process.Kill()
	select {
	case <-p.done:
	case <-time.After(s.opts.StopTimeout):
		return fmt.Errorf("kubetest: kube-apiserver (pid %d) did not exit after SIGKILL", p.cmd.Process.Pid)
	}
	s.apiserver = nil
	return nil
}

// StartAPIServer starts kube-apiserver again after KillAPIServer, at the
// same URL (clients' configurations stay valid), and returns when its
// /readyz answers ok, within Options.StartTimeout and ctx. It fails when
// another process took the port meanwhile.
func (s *Server) StartAPIServer(ctx context.Context) error {
	if s.apiserver != nil {
		return errors.New("kubetest: kube-apiserver is running")
	}
	bin, _, err := Binaries()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, s.opts.StartTimeout)
	defer cancel()
	s.restarts++
	return s.startAPIServerAt(ctx, bin, strings.TrimPrefix(s.URL, "https://127.0.0.1:"), fmt.Sprintf("kube-apiserver-restart-%d.log", s.restarts))
}

// startAPIServerAt starts kube-apiserver on port, logging to logName in
// Dir, and waits for its /readyz.
func (s *Server) startAPIServerAt(ctx context.Context, bin, port, logName string) error {
	s.URL = "https://127.0.0.1:" + port
	s.Config.Host = s.URL
	if err := s.writeKubeconfig(); err != nil {
		return err
	}
	// The flags of envtest's APIServer.defaultArgs
	// (controller-runtime pkg/internal/testing/controlplane/apiserver.go),
	// with a client-certificate identity instead of its generated user.
	args := []string{
		"--advertise-address=127.0.0.1",
		// v1.37 refuses a loopback advertise address with the default
		// lease reconciler of the "kubernetes" Service's endpoints; there is
		// no cluster network here, so nothing reconciles them.
		"--endpoint-reconciler-type=none",
		"--bind-address=127.0.0.1",
		"--secure-port=" + port,
		"--cert-dir=" + s.Dir,
		"--tls-cert-file=" + s.path(servingCert),
		"--tls-private-key-file=" + s.path(servingKey),
		"--client-ca-file=" + s.path(caCert),
		"--etcd-servers=" + s.EtcdURL,
		"--service-cluster-ip-range=10.0.0.0/24",
		"--allow-privileged=true",
		"--disable-admission-plugins=ServiceAccount",
		"--authorization-mode=RBAC",
		"--service-account-issuer=" + s.URL + "/",
		"--service-account-key-file=" + s.path(saKey),
		"--service-account-signing-key-file=" + s.path(saKey),
		"--v=0",
	}
	args = append(args, s.opts.APIServerFlags...)
	p, err := startProc(bin, args, s.path(logName), s.opts.Logs)
	if err != nil {
		return err
	}
	s.apiserver = p
	dc, err := discovery.NewDiscoveryClientForConfig(s.Config)
	if err != nil {
		return err
	}
	rc := dc.RESTClient()
	err = p.waitReady(ctx, func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		body, err := rc.Get().AbsPath("/readyz").DoRaw(ctx)
		if err != nil {
			return fmt.Errorf("%w: %s", err, bytes.TrimSpace(body))
		}
		return nil
	})
	if err != nil {
		p.stop(s.opts.StopTimeout)
		s.apiserver = nil
		return fmt.Errorf("kubetest: kube-apiserver did not become ready: %w", err)
	}
	return nil
}

// proc is one child process with its log file.
type proc struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	log     *os.File
	done    chan struct{} // closed when the process has exited
	err     error         // Wait's error, set before done closes
}

func startProc(bin string, args []string, logPath string, mirror io.Writer) (*proc, error) {
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	if mirror != nil {
		w := io.MultiWriter(f, mirror)
		cmd.Stdout, cmd.Stderr = w, w
	}
	cmd.SysProcAttr = childproc.Attr() // killed with the test binary
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("kubetest: start %s: %w", bin, err)
	}
	p := &proc{name: filepath.Base(bin), cmd: cmd, logPath: logPath, log: f, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return p, nil
}

// waitReady polls check every 100 ms until it succeeds, the process exits
// (an error wrapping errPortTaken when its log says a port was taken) or
// ctx ends.
func (p *proc) waitReady(ctx context.Context, check func(context.Context) error) error {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		select {
		case <-p.done:
			log := tail(p.logPath, 4096)
			if strings.Contains(log, "address already in use") {
				return fmt.Errorf("%s exited: %v: %w\n%s", p.name, p.err, errPortTaken, log)
			}
			return fmt.Errorf("%s exited: %v\n%s", p.name, p.err, log)
		case <-ctx.Done():
			return fmt.Errorf("%w (last check: %v)\n%s", ctx.Err(), last, tail(p.logPath, 4096))
		case <-tick.C:
		}
		if last = check(ctx); last == nil {
			return nil
		}
	}
}

// stop sends SIGTERM, waits up to timeout, then SIGKILLs and waits up to
// timeout again. An exit caused by the signal is not an error.
func (p *proc) stop(timeout time.Duration) error {
	select {
	case <-p.done:
		return nil
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(timeout):
	}
	_ = p.cmd.Process.Kill()
	select {
	case <-p.done:
		return fmt.Errorf("%s did not exit within %v of SIGTERM; killed", p.name, timeout)
	case <-time.After(timeout):
		return fmt.Errorf("%s (pid %d) did not exit after SIGKILL", p.name, p.cmd.Process.Pid)
	}
}

// freePorts returns n distinct loopback ports the kernel had free a moment
// ago (they are closed again before returning: a race New retries).
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("kubetest: free port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

func httpOK(ctx context.Context, c *http.Client, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, bytes.TrimSpace(body))
	}
	return nil
}

// tail returns the last n bytes of a file ("" when unreadable).
func tail(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return ""
	}
	off := max(st.Size()-int64(n), 0)
	b := make([]byte, st.Size()-off)
	k, _ := f.ReadAt(b, off)
	return string(b[:k])
}
