package e2e

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/testutil"
)

// e2bDir holds the SDK suite: package.json and package-lock.json pin the
// official npm packages (e2b 2.51.0, @e2b/code-interpreter 2.8.0).
const e2bDir = "e2b"

// e2bDomain is the sandboxes' domain in these tests; e2b/resolve.cjs
// (NODE_OPTIONS) resolves every name under it to 127.0.0.1.
const e2bDomain = "e2b.test"

// requireSDK installs the pinned npm packages from the lockfile (npm ci,
// as TestTypeScriptSDK does) and returns node. A missing node or npm skips
// (fails in a strict tier); a failed install fails.
func requireSDK(t *testing.T) string {
	t.Helper()
	node := testutil.RequireCommand(t, "node", "npm")
	out, err := exec.Command(node, "-e", "process.stdout.write(process.versions.node)").Output()
	testutil.Check(t, err)
	var major, minor int
	if _, err := fmt.Sscanf(string(out), "%d.%d", &major, &minor); err != nil {
		t.Fatalf("node version %q: %v", out, err)
	}
	if major < 20 || major == 20 && minor < 18 || major == 21 {
		testutil.Unavailable(t, "the E2B SDKs need node >= 20.18.1 (<21) or >= 22, not "+string(out))
	}
	npmCI(context.Background(), t, e2bDir, "--prefer-offline")
	return node
}

// nativeSDK builds forkd's own TypeScript SDK (sdk/typescript) for the
// baseline of the measures and returns its entry point.
func nativeSDK(t *testing.T) string {
	t.Helper()
	dir := buildTypeScriptSDK(context.Background(), t)
	return filepath.Join(dir, "dist", "index.js")
}

// freePort returns a loopback port free now.
func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	return port
}

// sdkRun runs the SDK suite (e2b/sdk.mjs) with env, streaming its lines
// to the log, and returns its measure line, if any.
func sdkRun(t *testing.T, node string, env ...string) map[string]any {
	t.Helper()
	abs, err := filepath.Abs(e2bDir)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, "sdk.mjs")
	cmd.Dir = abs
	cmd.Env = append(os.Environ(), "NODE_OPTIONS=--require "+filepath.Join(abs, "resolve.cjs"), "FORKD_TEST_DOMAIN="+e2bDomain)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = os.Stderr
	pr, pw := io.Pipe()
	cmd.Stdout = pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait(); pw.Close() }()
	var measure map[string]any
	var failures []string
	sc := bufio.NewScanner(pr)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		t.Log(line)
		switch {
		case strings.HasPrefix(line, "measure "):
			testutil.Check(t, json.Unmarshal([]byte(strings.TrimPrefix(line, "measure ")), &measure))
		case strings.HasPrefix(line, "FAIL"):
			failures = append(failures, line)
		}
	}
	if err := <-done; err != nil || len(failures) > 0 {
		t.Errorf("the SDK suite failed (%v):\n%s", err, strings.Join(failures, "\n"))
	}
	return measure
}

// tlsFor writes a CA and a certificate it signed for *.<domain>,
// sandbox.<domain> and 127.0.0.1, and returns their files.
func tlsFor(t *testing.T, dir, domain string) (caFile, certFile, keyFile string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	testutil.Check(t, err)
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "forkd e2e CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	testutil.Check(t, err)
	ca, err = x509.ParseCertificate(caDER)
	testutil.Check(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	testutil.Check(t, err)
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "*." + domain},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		DNSNames: []string{"*." + domain, domain}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, leaf, ca, &key.PublicKey, caKey)
	testutil.Check(t, err)
	kb, err := x509.MarshalECPrivateKey(key)
	testutil.Check(t, err)
	caFile, certFile, keyFile = filepath.Join(dir, "ca.pem"), filepath.Join(dir, "e2b-cert.pem"), filepath.Join(dir, "e2b-key.pem")
	testutil.WriteFile(t, caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o644)
	testutil.WriteFile(t, certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	testutil.WriteFile(t, keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	return caFile, certFile, keyFile
}

// e2bCall is one control-plane call of the test itself.
func e2bCall(t *testing.T, hc *http.Client, method, url, key, body string) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	testutil.Check(t, err)
	req.Header.Set("X-API-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	testutil.Check(t, err)
	defer resp.Body.Close()
	var out map[string]any
	b, _ := io.ReadAll(resp.Body)
	_ = json.Unmarshal(b, &out)
	return resp.StatusCode, out
}

// TestE2BSDK runs the official E2B SDKs, unmodified and configured by
// environment variables only, against forkd serve --e2b-listen with real
// VMs: first over plain HTTP with E2B_SANDBOX_URL (header routing), then,
// after a daemon restart that keeps the E2B sandboxes, over TLS with
// E2B_DOMAIN (host-name routing, <port>-<id>.e2b.test). The scenarios are
// e2b/sdk.mjs's; the first run also measures create, commands.run and
// runCode.
func TestE2BSDK(t *testing.T) {
	testutil.RequireRoot(t) // sandboxes with their own network: getHost
	c := newCLI(t)
	node := requireSDK(t)
	// A daemon and data dir of its own, mostly waiting on guests and
	// node: it runs beside the SDK, MCP and example tests.
	t.Parallel()
	c.ok("snapshot", "--tag", "base", "--image", "python")
	c.ok("snapshot", "--tag", "code-interpreter", "--image", "code-interpreter", "--mem-size-mib", "1024")

	port := freePort(t)
	domain := e2bDomain + ":" + port
	d := startServe(t, c, "--e2b-listen", "127.0.0.1:"+port, "--e2b-domain", domain)
	key := strings.TrimSpace(c.ok("e2b", "key", "create", "--name", "e2e"))
	api := "http://127.0.0.1:" + port
	run := fmt.Sprintf("run%d", time.Now().UnixNano())

	m := sdkRun(t, node, "E2B_API_KEY="+key, "E2B_API_URL="+api, "E2B_SANDBOX_URL="+api,
		"FORKD_E2B_SCHEME=http", "FORKD_E2B_RUN="+run+"h", "FORKD_E2B_MEASURE=5",
		"FORKD_NATIVE_SDK="+nativeSDK(t), "FORKD_NATIVE_URL="+d.url, "FORKD_NATIVE_TOKEN="+d.token)
	if m != nil {
		b, _ := json.Marshal(m)
		t.Logf("measured, E2B SDK and forkd's TypeScript SDK over TCP in turns: %s", b)
	}

	// A sandbox made before a restart is still there after it, with its
	// id, tokens and files.
	hc := &http.Client{Timeout: 10 * time.Minute}
	code, sb := e2bCall(t, hc, "POST", api+"/v2/sandboxes", key, `{"templateID":"base","metadata":{"keep":"yes"}}`)
	if code != 201 {
		t.Fatalf("create: %d %v", code, sb)
	}
	id, _ := sb["sandboxID"].(string)
	d.stop()

	caFile, certFile, keyFile := tlsFor(t, c.data, e2bDomain)
	startServe(t, c, "--e2b-listen", "127.0.0.1:"+port, "--e2b-domain", domain, "--e2b-tls-cert", certFile, "--e2b-tls-key", keyFile)
	pool := x509.NewCertPool()
	b, err := os.ReadFile(caFile)
	testutil.Check(t, err)
	pool.AppendCertsFromPEM(b)
	hc.Transport = &http.Transport{TLSClientConfig: tlsConfig(pool)}
	api = "https://127.0.0.1:" + port
	if code, got := e2bCall(t, hc, "GET", api+"/sandboxes/"+id, key, ""); code != 200 || got["state"] != "running" {
		t.Errorf("the sandbox made before the restart: %d %v", code, got)
	}
	if code, _ := e2bCall(t, hc, "DELETE", api+"/sandboxes/"+id, key, ""); code != 204 {
		t.Errorf("kill it: %d", code)
	}

	sdkRun(t, node, "E2B_API_KEY="+key, "E2B_API_URL="+api, "E2B_DOMAIN="+domain,
		"NODE_EXTRA_CA_CERTS="+caFile, "FORKD_E2B_SCHEME=https", "FORKD_E2B_RUN="+run+"d")
}

func tlsConfig(pool *x509.CertPool) *tls.Config { return &tls.Config{RootCAs: pool} }
