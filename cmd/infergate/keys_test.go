package main

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infergate/infergate/auth"
)

// runRoot runs the infergate command line in-process with stdin.
func runRoot(t *testing.T, stdin string, args ...string) (string, error) {
	t.Helper()
	root := newRoot()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetIn(strings.NewReader(stdin))
	root.SetArgs(args)
	err := root.Execute()
	return out.String(), err
}

func TestKeysCommands(t *testing.T) {
	const want = "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n" // printf %s test | sha256sum
	if out, err := runRoot(t, "", "keys", "hash", "test"); err != nil || out != want {
		t.Errorf("keys hash test: %q %v", out, err)
	}
	if out, err := runRoot(t, "test\n", "keys", "hash"); err != nil || out != want {
		t.Errorf("keys hash < stdin: %q %v", out, err)
	}
	if _, err := runRoot(t, "", "keys", "hash"); err == nil {
		t.Error("empty key hashed")
	}
	out, err := runRoot(t, "", "keys", "new", "team-a", "--models", "m1,m2", "--rpm", "60", "--max-priority", "-2")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "sk-ig-") || len(lines[0]) < 40 {
		t.Fatalf("keys new printed %q", out)
	}
	keys, err := auth.ParseKeys([]byte(lines[1]), false)
	if err != nil || len(keys) != 1 || keys[0].Hash != auth.HashKey(lines[0]) ||
		keys[0].RequestsPerMinute != 60 || len(keys[0].Models) != 2 || keys[0].MaxPriority == nil || *keys[0].MaxPriority != -2 {
		t.Fatalf("keys-file line %q: %+v %v", lines[1], keys, err)
	}
	if _, err := runRoot(t, "", "keys", "new", "bad name!"); err == nil {
		t.Error("invalid name accepted")
	}
}

// writeCert writes a self-signed certificate for 127.0.0.1 into dir.
func writeCert(t *testing.T, dir string) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalECPrivateKey(key)
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	_ = os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	_ = os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600)
	cert, _ := x509.ParseCertificate(der)
	pool = x509.NewCertPool()
	pool.AddCert(cert)
	return certFile, keyFile, pool
}

// startWithEnv is start with extra environment variables.
func startWithEnv(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	return start(t, args...)
}

var listenRe = regexp.MustCompile(`msg="gateway listening" addr=(https?://[0-9.:]+)`)

// TestServeTLSAndKeys runs `infergate serve` as a process with a
// certificate and a key from INFERGATE_API_KEYS.
func TestServeTLSAndKeys(t *testing.T) {
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "" {
			http.Error(w, "credential leaked", http.StatusTeapot)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","object":"chat.completion","choices":[]}`)
	}))
	defer eng.Close()
	certFile, keyFile, pool := writeCert(t, t.TempDir())
	p := startWithEnv(t, []string{auth.EnvAPIKeys + "=ci plain:sk-test-0123456789"},
		"serve", "--listen", "127.0.0.1:0", "--endpoint", eng.URL+"=m", "--tls-cert", certFile, "--tls-key", keyFile)
	base := p.await(t, listenRe)
	if !strings.HasPrefix(base, "https://") {
		t.Fatalf("listening on %s", base)
	}
	c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}, Timeout: 10 * time.Second}
	do := func(key string) int {
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := do(""); code != 401 {
		t.Errorf("no key: %d", code)
	}
	if code := do("sk-test-0123456789"); code != 200 {
		t.Errorf("with key: %d", code)
	}
	p.stop(t)
}

func TestServeWarnsWhenExposed(t *testing.T) {
	eng := httptest.NewServer(http.NotFoundHandler())
	defer eng.Close()
	t.Setenv(auth.EnvAPIKeys, "") // unset below: LookupEnv must not see it
	os.Unsetenv(auth.EnvAPIKeys)
	p := start(t, "serve", "--listen", "0.0.0.0:0", "--endpoint", eng.URL+"=m")
	p.await(t, regexp.MustCompile(`(non-loopback address without API keys)`))
	p.stop(t)

	for _, args := range [][]string{{"serve", "--endpoint", eng.URL + "=m"}, {"up", "--listen", "127.0.0.1:0"}} {
		cmd := infergateCommand(append(args, "--pprof", "0.0.0.0:6060")...)
		cmd.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
		if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "loopback only") {
			t.Errorf("%s --pprof on a non-loopback address: %v %s", args[0], err, out)
		}
	}
}

// TestUpKeysReloadAndResponses runs `infergate up` as a process with a keys
// file: requests need a key; at SIGHUP the file is read again (a key added
// works, a key removed is refused, the process keeps serving); and the
// embedded engines keep Responses API responses, so a continuation works.
func TestUpKeysReloadAndResponses(t *testing.T) {
	t.Setenv(auth.EnvAPIKeys, "")
	os.Unsetenv(auth.EnvAPIKeys)
	keys := filepath.Join(t.TempDir(), "keys.txt")
	write := func(lines ...string) {
		if err := os.WriteFile(keys, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("alice " + auth.HashKey("sk-alice-0123456789"))
	p := start(t, "up", "--engines", "2", "--listen", "127.0.0.1:0", "--time-scale", "100", "--keys-file", keys, "--access-log=false")
	base := p.await(t, regexp.MustCompile(`OpenAI API at (http://[0-9.:]+)/v1 \(policy [a-z-]+; API keys required\)`))
	do := func(key, path, body string) (int, map[string]any) {
		req, _ := http.NewRequest(http.MethodPost, base+path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var v map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&v)
		return resp.StatusCode, v
	}
	const chat = `{"model":"meta-llama/Llama-3.1-70B-Instruct","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	if code, _ := do("", "/v1/chat/completions", chat); code != 401 {
		t.Fatalf("no key: %d", code)
	}
	if code, v := do("sk-alice-0123456789", "/v1/chat/completions", chat); code != 200 {
		t.Fatalf("alice: %d %v", code, v)
	}
	// Responses: a continuation of the first answer.
	code, r1 := do("sk-alice-0123456789", "/v1/responses", `{"model":"meta-llama/Llama-3.1-70B-Instruct","input":"Tell me a story.","max_output_tokens":4}`)
	id, _ := r1["id"].(string)
	if code != 200 || id == "" {
		t.Fatalf("responses: %d %v", code, r1)
	}
	if code, v := do("sk-alice-0123456789", "/v1/responses", `{"model":"meta-llama/Llama-3.1-70B-Instruct","input":"Go on.","max_output_tokens":4,"previous_response_id":"`+id+`"}`); code != 200 {
		t.Fatalf("continuation: %d %v", code, v)
	}

	write("bob " + auth.HashKey("sk-bob-0123456789"))
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		code, _ := do("sk-bob-0123456789", "/v1/chat/completions", chat)
		if code == 200 {
			break
		}
		if code != 401 || time.Now().After(deadline) {
			t.Fatalf("bob after SIGHUP: %d", code)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if code, _ := do("sk-alice-0123456789", "/v1/chat/completions", chat); code != 401 {
		t.Errorf("alice after her key was removed: %d, want 401", code)
	}
	p.stop(t)
}
