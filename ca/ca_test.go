package ca

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

func verifyLeaf(t *testing.T, a *Authority, host string, now time.Time) error {
	t.Helper()
	c, err := a.Leaf(host)
	if err != nil {
		t.Fatalf("Leaf(%q): %v", host, err)
	}
	_, err = c.Leaf.Verify(x509.VerifyOptions{
		DNSName:     host,
		Roots:       a.Pool(),
		CurrentTime: now,
		KeyUsages:   []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	return err
}

func TestCreateLoadRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	a, err := Create(dir, Options{}, os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	if a.Certificate().PublicKeyAlgorithm != x509.ECDSA {
		t.Fatalf("CA key algorithm = %v, want ECDSA", a.Certificate().PublicKeyAlgorithm)
	}
	if k := a.key; k.Curve != elliptic.P256() {
		t.Fatalf("CA curve = %v, want P-256", k.Curve.Params().Name)
	}
	fi, err := os.Stat(filepath.Join(dir, KeyFile))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("key mode = %04o, want 0600", fi.Mode().Perm())
	}
	b, err := Load(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !b.Certificate().Equal(a.Certificate()) {
		t.Fatal("loaded CA differs from created CA")
	}
	if !b.key.Equal(a.key) {
		t.Fatal("loaded key differs")
	}
	// A leaf signed by the loaded CA verifies against the created CA.
	if err := verifyLeaf(t, b, "api.example.com", time.Now()); err != nil {
		t.Fatal(err)
	}
}

func TestCreateRefusesOverwrite(t *testing.T) {
	dir := t.TempDir()
	a, err := Create(dir, Options{}, os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Create(dir, Options{}, os.Getenv); !errors.Is(err, ErrExists) {
		t.Fatalf("second Create: err = %v, want ErrExists", err)
	}
	b, err := Create(dir, Options{Force: true}, os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	if b.Certificate().Equal(a.Certificate()) {
		t.Fatal("Force did not replace the CA")
	}
	c, created, err := LoadOrCreate(dir, Options{}, os.Getenv)
	if err != nil || created {
		t.Fatalf("LoadOrCreate on existing CA: created=%v err=%v", created, err)
	}
	if !c.Certificate().Equal(b.Certificate()) {
		t.Fatal("LoadOrCreate did not load the existing CA")
	}
}

func TestLoadRejectsReadableKey(t *testing.T) {
	dir := t.TempDir()
	if _, err := Create(dir, Options{}, os.Getenv); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(dir, KeyFile), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(dir, Options{}); err == nil {
		t.Fatal("Load accepted a world-readable CA key")
	}
}

func TestLoadRejectsMismatchedKey(t *testing.T) {
	dir1, dir2 := t.TempDir(), t.TempDir()
	if _, err := Create(dir1, Options{}, os.Getenv); err != nil {
		t.Fatal(err)
	}
	if _, err := Create(dir2, Options{}, os.Getenv); err != nil {
		t.Fatal(err)
	}
	other, err := os.ReadFile(filepath.Join(dir2, KeyFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir1, KeyFile), other, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(dir1, Options{}); err == nil {
		t.Fatal("Load accepted a key that does not match the certificate")
	}
}

func TestLeafForIPAndDNS(t *testing.T) {
	a, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{"api.example.com", "127.0.0.1", "::1"} {
		if err := verifyLeaf(t, a, h, time.Now()); err != nil {
			t.Errorf("%s: %v", h, err)
		}
	}
	c, _ := a.Leaf("api.example.com")
	if _, ok := c.PrivateKey.(*ecdsa.PrivateKey); !ok {
		t.Errorf("leaf key is %T, want ECDSA", c.PrivateKey)
	}
	if err := verifyLeaf(t, a, "api.example.com", c.Leaf.NotAfter.Add(time.Minute)); err == nil {
		t.Error("leaf verified after its NotAfter")
	}
}

func TestNameConstraints(t *testing.T) {
	a, err := New(Options{NameConstraints: []string{"api.example.com", "127.0.0.1"}})
	if err != nil {
		t.Fatal(err)
	}
	if !a.Certificate().PermittedDNSDomainsCritical {
		t.Fatal("name constraints are not critical")
	}
	for _, h := range []string{"api.example.com", "eu.api.example.com", "127.0.0.1"} {
		if err := verifyLeaf(t, a, h, time.Now()); err != nil {
			t.Errorf("%s inside the constraints: %v", h, err)
		}
	}
	for _, h := range []string{"bank.example.org", "example.com", "10.0.0.1"} {
		if err := verifyLeaf(t, a, h, time.Now()); err == nil {
			t.Errorf("%s outside the constraints verified", h)
		}
	}
	// DNS-only constraints exclude every IP.
	b, err := New(Options{NameConstraints: []string{"api.example.com"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := verifyLeaf(t, b, "127.0.0.1", time.Now()); err == nil {
		t.Error("IP leaf verified under DNS-only constraints")
	}
}

func TestLeafCacheSingleflight(t *testing.T) {
	a, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	certs := make([][]byte, 50)
	for i := range certs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := a.Leaf("api.example.com")
			if err != nil {
				t.Error(err)
				return
			}
			certs[i] = c.Certificate[0]
		}()
	}
	wg.Wait()
	for i := range certs {
		if !bytes.Equal(certs[i], certs[0]) {
			t.Fatalf("caller %d got a different leaf: the cache signed twice", i)
		}
	}
}

func TestLeafRenewal(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	a, err := New(Options{Now: clock, LeafValidity: 4 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	c1, _ := a.Leaf("api.example.com")
	now = now.Add(2 * time.Hour)
	c2, _ := a.Leaf("api.example.com")
	if c1 != c2 {
		t.Fatal("leaf re-signed while most of its validity remained")
	}
	now = now.Add(90 * time.Minute) // 30m left of 4h: below a quarter
	c3, _ := a.Leaf("api.example.com")
	if c3 == c1 {
		t.Fatal("leaf not renewed near NotAfter")
	}
	if !c3.Leaf.NotAfter.After(c1.Leaf.NotAfter) {
		t.Fatal("renewed leaf does not last longer")
	}
}

func TestBundleHoldsSystemRootsAndCA(t *testing.T) {
	roots, src, err := SystemRootsPEM(os.Getenv)
	if err != nil {
		t.Skipf("no system roots on this machine: %v", err)
	}
	dir := t.TempDir()
	a, err := Create(dir, Options{}, os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	bundle, err := os.ReadFile(filepath.Join(dir, BundleFile))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := countCerts(bundle), countCerts(roots)+1; got != want {
		t.Fatalf("bundle holds %d certificates, want %d (system roots from %s + CA)", got, want, src)
	}
	if !bytes.Contains(bundle, a.CertPEM()) {
		t.Fatal("bundle does not contain the CA")
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(bundle) {
		t.Fatal("bundle does not parse")
	}
	// SSL_CERT_FILE pointing at a pollgate bundle is not used as the source.
	env := func(k string) string {
		if k == "SSL_CERT_FILE" {
			return filepath.Join(dir, BundleFile)
		}
		return ""
	}
	_, src2, err := SystemRootsPEM(env)
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(src2) == BundleFile {
		t.Fatal("SystemRootsPEM used a pollgate bundle as the system roots")
	}
}
