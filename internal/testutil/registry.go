package testutil

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// Registry is a docker-registry a test started.
type Registry struct {
	// Addr is its host:port on loopback.
	Addr string
	// Storage is its storage root.
	Storage string
	// CAFile is the PEM certificate it serves (self-signed, for 127.0.0.1
	// and localhost); User and Password the one account it accepts.
	// All three are empty for a plain registry.
	CAFile, User, Password string
}

// RegistryOptions choose what StartRegistryWith serves.
type RegistryOptions struct {
	// TLS serves HTTPS with a self-signed certificate.
	TLS bool
	// Auth asks for User and Password (htpasswd, bcrypt); it needs TLS.
	Auth bool
}

// The account of a registry with Auth: the htpasswd line is the bcrypt
// hash (cost 4) of the password, made once with Python's crypt.
const (
	registryUser     = "forkd"
	registryPassword = "forkd-hub-test-password"
	registryHtpasswd = registryUser + ":$2b$04$CKK53yCXMHJbWYg0gJjNSehIAwEyHwe3abBeGLx0MHs8cuYH8PsUm\n"
)

// StartRegistry runs Debian's docker-registry on a free loopback port with
// storage in a temporary directory, and returns its host:port.
func StartRegistry(t testing.TB) string {
	t.Helper()
	return StartRegistryWith(t, RegistryOptions{}).Addr
}

// StartRegistryWith runs Debian's docker-registry as o says, until t ends.
func StartRegistryWith(t testing.TB, o RegistryOptions) *Registry {
	t.Helper()
	bin := RequireCommand(t, "docker-registry")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir := t.TempDir()
	r := &Registry{Addr: addr, Storage: filepath.Join(dir, "storage")}
	var extra string
	if o.TLS {
		r.CAFile = filepath.Join(dir, "cert.pem")
		key := filepath.Join(dir, "key.pem")
		SelfSigned(t, r.CAFile, key)
		extra = fmt.Sprintf("  tls:\n    certificate: %s\n    key: %s\n", r.CAFile, key)
	}
	var auth string
	if o.Auth {
		if !o.TLS {
			t.Fatal("a registry with auth needs TLS")
		}
		r.User, r.Password = registryUser, registryPassword
		WriteFile(t, filepath.Join(dir, "htpasswd"), []byte(registryHtpasswd), 0o600)
		auth = fmt.Sprintf("auth:\n  htpasswd:\n    realm: forkd-test\n    path: %s\n", filepath.Join(dir, "htpasswd"))
	}
	cfg := filepath.Join(dir, "config.yml")
	WriteFile(t, cfg, []byte(fmt.Sprintf(`version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
%shttp:
  addr: %s
%s`, r.Storage, auth, addr, extra)), 0o644)
	cmd := exec.Command(bin, "serve", cfg)
	var logBuf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logBuf, &logBuf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Teardown: the registry is killed, so Wait reports the signal.
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	// A loaded host can take seconds to start it (TLS keys, its
	// storage).
	for deadline := time.Now().Add(30 * time.Second); ; {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return r
		}
		if time.Now().After(deadline) {
			t.Fatalf("registry on %s did not start: %v\n%s", addr, err, logBuf.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Blobs counts the blobs the registry stores, and their bytes.
func (r *Registry) Blobs(t testing.TB) (n int, size int64) {
	t.Helper()
	root := filepath.Join(r.Storage, "docker", "registry", "v2", "blobs")
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if d == nil { // no blob yet
				return filepath.SkipDir
			}
			return err
		}
		if d.Type().IsRegular() && d.Name() == "data" {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			n++
			size += fi.Size()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n, size
}

// BlobPath is where the registry keeps blob digest ("sha256:...").
func (r *Registry) BlobPath(digest string) string {
	hex := digest[len("sha256:"):]
	return filepath.Join(r.Storage, "docker", "registry", "v2", "blobs", "sha256", hex[:2], hex, "data")
}

// SelfSigned writes a self-signed certificate for 127.0.0.1 and localhost
// and its key, PEM.
func SelfSigned(t testing.TB, certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		Subject:               pkix.Name{CommonName: "forkd test registry"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		DNSNames:              []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	WriteFile(t, certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	WriteFile(t, keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	if _, err := tls.LoadX509KeyPair(certFile, keyFile); err != nil {
		t.Fatal(err)
	}
}
