// Package ca owns pollgate's per-install certificate authority: an ECDSA
// P-256 CA created once in the data directory (ca.pem, ca-key.pem),
// optionally name-constrained to the contract's hosts, the leaf certificates
// it signs for MITM'd hosts (cached, one signature per host and validity
// period), and bundle.pem (the system roots plus the CA) for clients whose CA
// variable replaces the system roots.
//
// ca never uses goproxy's built-in CA (its private key is public) and never
// signs a leaf for a host it was not asked about by the proxy. It does no
// network I/O.
package ca

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha1"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"
)

// File names inside the data directory.
const (
	CertFile   = "ca.pem"     // the CA certificate (public; NODE_EXTRA_CA_CERTS)
	KeyFile    = "ca-key.pem" // the CA private key, PKCS#8, mode 0600
	BundleFile = "bundle.pem" // system roots + the CA (SSL_CERT_FILE, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE)
)

// ErrExists is returned by Create when the data directory already holds a CA
// and Options.Force is not set.
var ErrExists = errors.New("a CA already exists")

// Options configure a new CA. The zero value is a usable default.
type Options struct {
	// NameConstraints, when non-empty, limits the CA to these hosts (DNS
	// names match the name and its subdomains; IP literals match exactly).
	// The constraint is critical: clients reject a leaf for any other name
	// even if the CA key leaks. Default: unconstrained.
	NameConstraints []string
	// CommonName of the CA. Default "pollgate CA (<hostname>)".
	CommonName string
	// Validity of the CA certificate. Default 10 years.
	Validity time.Duration
	// LeafValidity of signed leaf certificates. Default 7 days; leaves are
	// re-signed when less than a quarter of it remains.
	LeafValidity time.Duration
	// Now is the clock for validity periods. Default time.Now.
	Now func() time.Time
	// Force lets Create replace an existing CA in the directory.
	Force bool
}

func (o *Options) defaults() {
	if o.Validity <= 0 {
		o.Validity = 10 * 365 * 24 * time.Hour
	}
	if o.LeafValidity <= 0 {
		o.LeafValidity = 7 * 24 * time.Hour
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.CommonName == "" {
		host, _ := os.Hostname()
		if host == "" {
			host = "local"
		}
		o.CommonName = "pollgate CA (" + host + ")"
	}
}

// Authority signs leaf certificates for MITM'd hosts. It is safe for
// concurrent use.
type Authority struct {
	cert    *x509.Certificate
	key     *ecdsa.PrivateKey
	certPEM []byte

	leafValidity time.Duration
	now          func() time.Time

	mu     sync.Mutex
	leaves map[string]*tls.Certificate
	group  singleflight.Group
}

// maxCachedLeaves bounds the leaf cache. Only contract hosts are MITM'd, so
// this is never reached in practice; when it is, the cache starts over.
const maxCachedLeaves = 4096

// New generates a CA in memory (tests, benchmarks, and Create).
func New(opts Options) (*Authority, error) {
	opts.defaults()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("failed to generate CA key: %w", err)
	}
	now := opts.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          randomSerial(),
		Subject:               pkix.Name{CommonName: opts.CommonName, Organization: []string{"pollgate"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(opts.Validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
		SubjectKeyId:          keyID(&key.PublicKey),
	}
	if len(opts.NameConstraints) > 0 {
		applyNameConstraints(tmpl, opts.NameConstraints)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("failed to create CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("failed to parse CA certificate: %w", err)
	}
	return newAuthority(cert, key, opts), nil
}

func newAuthority(cert *x509.Certificate, key *ecdsa.PrivateKey, opts Options) *Authority {
	opts.defaults()
	return &Authority{
		cert:         cert,
		key:          key,
		certPEM:      pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw}),
		leafValidity: opts.LeafValidity,
		now:          opts.Now,
		leaves:       make(map[string]*tls.Certificate),
	}
}

// applyNameConstraints limits the CA to hosts. Both name types are always
// constrained: with only DNS hosts every IP is excluded, with only IP hosts
// DNS names are limited to the reserved ".invalid" domain.
func applyNameConstraints(tmpl *x509.Certificate, hosts []string) {
	tmpl.PermittedDNSDomainsCritical = true
	for _, h := range hosts {
		h = strings.TrimSuffix(strings.ToLower(strings.TrimSpace(h)), ".")
		if h == "" {
			continue
		}
		if ip := net.ParseIP(h); ip != nil {
			bits := 128
			if ip4 := ip.To4(); ip4 != nil {
				ip, bits = ip4, 32
			}
			tmpl.PermittedIPRanges = append(tmpl.PermittedIPRanges, &net.IPNet{IP: ip, Mask: net.CIDRMask(bits, bits)})
			continue
		}
		tmpl.PermittedDNSDomains = append(tmpl.PermittedDNSDomains, h)
	}
	if len(tmpl.PermittedDNSDomains) == 0 {
		tmpl.PermittedDNSDomains = []string{"invalid"}
	}
	if len(tmpl.PermittedIPRanges) == 0 {
		tmpl.ExcludedIPRanges = []*net.IPNet{
			{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)},
			{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)},
		}
	}
}

// Exists reports whether dir holds a CA certificate or key.
func Exists(dir string) bool {
	for _, f := range []string{CertFile, KeyFile} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			return true
		}
	}
	return false
}

// Create generates a CA and writes ca.pem, ca-key.pem (0600) and bundle.pem
// into dir (created 0700 if missing). It refuses to replace an existing CA
// unless opts.Force is set.
func Create(dir string, opts Options, getenv func(string) string) (*Authority, error) {
	if Exists(dir) && !opts.Force {
		return nil, fmt.Errorf("%w in %s (hint: pass --force to replace it; agents must then trust the new ca.pem)", ErrExists, dir)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("failed to create data directory %s: %w", dir, err)
	}
	a, err := New(opts)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(a.key)
	if err != nil {
		return nil, fmt.Errorf("failed to encode CA key: %w", err)
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	if err := writeFileAtomic(filepath.Join(dir, KeyFile), keyPEM, 0o600); err != nil {
		return nil, err
	}
	if err := writeFileAtomic(filepath.Join(dir, CertFile), a.certPEM, 0o644); err != nil {
		return nil, err
	}
	if _, err := WriteBundle(dir, a.certPEM, getenv); err != nil && !errors.Is(err, ErrNoSystemRoots) {
		return nil, err
	}
	return a, nil
}

// Load reads the CA from dir. It refuses a key file readable by others.
func Load(dir string, opts Options) (*Authority, error) {
	certPath, keyPath := filepath.Join(dir, CertFile), filepath.Join(dir, KeyFile)
	certPEM, err := os.ReadFile(certPath)
	if err != nil {
		return nil, fmt.Errorf("failed to read CA certificate: %w (hint: run 'pollgate ca init --data %s')", err, dir)
	}
	fi, err := os.Stat(keyPath)
	if err != nil {
		return nil, fmt.Errorf("failed to read CA key: %w (hint: run 'pollgate ca init --force --data %s')", err, dir)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("CA key %s has mode %04o, readable by others (hint: chmod 600 %s)", keyPath, fi.Mode().Perm(), keyPath)
	}
	keyPEM, err := os.ReadFile(keyPath)
	if err != nil {
		return nil, fmt.Errorf("failed to read CA key: %w", err)
	}
	cb, _ := pem.Decode(certPEM)
	if cb == nil || cb.Type != "CERTIFICATE" {
		return nil, fmt.Errorf("failed to parse %s: no CERTIFICATE block", certPath)
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("failed to parse %s: %w", certPath, err)
	}
	kb, _ := pem.Decode(keyPEM)
	if kb == nil {
		return nil, fmt.Errorf("failed to parse %s: no PEM block", keyPath)
	}
	var key any
	switch kb.Type {
	case "PRIVATE KEY":
		key, err = x509.ParsePKCS8PrivateKey(kb.Bytes)
	case "EC PRIVATE KEY":
		key, err = x509.ParseECPrivateKey(kb.Bytes)
	default:
		err = fmt.Errorf("unexpected PEM block %q", kb.Type)
	}
	if err != nil {
		return nil, fmt.Errorf("failed to parse %s: %w", keyPath, err)
	}
	ek, ok := key.(*ecdsa.PrivateKey)
	if !ok || ek.Curve != elliptic.P256() {
		return nil, fmt.Errorf("CA key %s is not ECDSA P-256 (hint: run 'pollgate ca init --force')", keyPath)
	}
	pub, ok := cert.PublicKey.(*ecdsa.PublicKey)
	if !ok || !pub.Equal(&ek.PublicKey) {
		return nil, fmt.Errorf("CA key %s does not match %s", keyPath, certPath)
	}
	if !cert.IsCA {
		return nil, fmt.Errorf("%s is not a CA certificate", certPath)
	}
	opts.defaults()
	if opts.Now().After(cert.NotAfter) {
		return nil, fmt.Errorf("CA certificate %s expired at %s (hint: run 'pollgate ca init --force')", certPath, cert.NotAfter.Format(time.RFC3339))
	}
	return newAuthority(cert, ek, opts), nil
}

// LoadOrCreate loads the CA from dir, creating it on first start. created
// reports whether a new CA was written. bundle.pem is rewritten when missing.
func LoadOrCreate(dir string, opts Options, getenv func(string) string) (a *Authority, created bool, err error) {
	if !Exists(dir) {
		a, err = Create(dir, opts, getenv)
		return a, err == nil, err
	}
	a, err = Load(dir, opts)
	if err != nil {
		return nil, false, err
	}
	if _, err := os.Stat(filepath.Join(dir, BundleFile)); errors.Is(err, os.ErrNotExist) {
		if _, err := WriteBundle(dir, a.certPEM, getenv); err != nil && !errors.Is(err, ErrNoSystemRoots) {
			return nil, false, err
		}
	}
	return a, false, nil
}

// Certificate returns the CA certificate.
func (a *Authority) Certificate() *x509.Certificate { return a.cert }

// CertPEM returns the CA certificate in PEM form.
func (a *Authority) CertPEM() []byte { return bytes.Clone(a.certPEM) }

// Pool returns a pool holding only the CA (for tests and clients).
func (a *Authority) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(a.cert)
	return p
}

// Leaf returns a certificate for host (a DNS name or an IP literal, without
// port), signing it on first use. Concurrent callers for the same host share
// one signature (singleflight); a cached leaf is renewed when less than a
// quarter of its validity remains.
func (a *Authority) Leaf(host string) (*tls.Certificate, error) {
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	if host == "" {
		return nil, errors.New("failed to sign leaf: empty host name")
	}
	now := a.now()
	a.mu.Lock()
	c := a.leaves[host]
	a.mu.Unlock()
	if c != nil && now.Before(c.Leaf.NotAfter.Add(-a.leafValidity/4)) {
		return c, nil
	}
	v, err, _ := a.group.Do(host, func() (any, error) {
		a.mu.Lock()
		c := a.leaves[host]
		a.mu.Unlock()
		if c != nil && now.Before(c.Leaf.NotAfter.Add(-a.leafValidity/4)) {
			return c, nil
		}
		c, err := a.sign(host, now)
		if err != nil {
			return nil, err
		}
		a.mu.Lock()
		if len(a.leaves) >= maxCachedLeaves {
			a.leaves = make(map[string]*tls.Certificate)
		}
		a.leaves[host] = c
		a.mu.Unlock()
		return c, nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*tls.Certificate), nil
}

func (a *Authority) sign(host string, now time.Time) (*tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("failed to generate leaf key for %s: %w", host, err)
	}
	notAfter := now.Add(a.leafValidity)
	if notAfter.After(a.cert.NotAfter) {
		notAfter = a.cert.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber:   randomSerial(),
		Subject:        pkix.Name{CommonName: host},
		NotBefore:      now.Add(-time.Hour),
		NotAfter:       notAfter,
		KeyUsage:       x509.KeyUsageDigitalSignature,
		ExtKeyUsage:    []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		AuthorityKeyId: a.cert.SubjectKeyId,
	}
	if ip := net.ParseIP(host); ip != nil {
		tmpl.IPAddresses = []net.IP{ip}
	} else {
		tmpl.DNSNames = []string{host}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, a.cert, &key.PublicKey, a.key)
	if err != nil {
		return nil, fmt.Errorf("failed to sign leaf for %s: %w", host, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("failed to parse leaf for %s: %w", host, err)
	}
	return &tls.Certificate{
		Certificate: [][]byte{der, a.cert.Raw},
		PrivateKey:  key,
		Leaf:        leaf,
	}, nil
}

// ServerTLSConfig returns the TLS configuration presented to an agent that
// connected to host through the proxy.
func (a *Authority) ServerTLSConfig(host string) (*tls.Config, error) {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	cert, err := a.Leaf(host)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		Certificates: []tls.Certificate{*cert},
		MinVersion:   tls.VersionTLS12,
	}, nil
}

func randomSerial() *big.Int {
	limit := new(big.Int).Lsh(big.NewInt(1), 127)
	n, err := rand.Int(rand.Reader, limit)
	if err != nil {
		// crypto/rand never fails on supported platforms.
		panic(err)
	}
	return n.Add(n, big.NewInt(1))
}

func keyID(pub *ecdsa.PublicKey) []byte {
	b, err := pub.Bytes()
	if err != nil {
		return nil
	}
	sum := sha1.Sum(b)
	return sum[:]
}

func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("failed to write %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return fmt.Errorf("failed to write %s: %w", path, err)
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("failed to write %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("failed to write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("failed to write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("failed to write %s: %w", path, err)
	}
	return nil
}
