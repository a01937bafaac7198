package ca

import (
	"bytes"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// systemRootFiles are the usual locations of the system's PEM root bundle
// (the list crypto/x509 searches on Linux, plus the BSD/macOS one).
var systemRootFiles = []string{
	"/etc/ssl/certs/ca-certificates.crt",                // Debian, Ubuntu, Gentoo, Arch
	"/etc/pki/tls/certs/ca-bundle.crt",                  // Fedora, RHEL 6
	"/etc/ssl/ca-bundle.pem",                            // openSUSE
	"/etc/pki/tls/cacert.pem",                           // OpenELEC
	"/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem", // CentOS, RHEL 7
	"/etc/ssl/cert.pem",                                 // Alpine, macOS, BSDs
}

// ErrNoSystemRoots: no system root bundle was found; bundle.pem then holds
// the pollgate CA alone.
var ErrNoSystemRoots = errors.New("no system root certificate bundle found")

// SystemRootsPEM returns the system's root certificates in PEM form and the
// file they came from. SSL_CERT_FILE (via getenv) is honoured first unless it
// points at a pollgate bundle, which would nest the CA into itself.
func SystemRootsPEM(getenv func(string) string) ([]byte, string, error) {
	candidates := systemRootFiles
	if getenv != nil {
		if f := getenv("SSL_CERT_FILE"); f != "" && filepath.Base(f) != BundleFile {
			candidates = append([]string{f}, candidates...)
		}
	}
	for _, f := range candidates {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if n := countCerts(data); n > 0 {
			return data, f, nil
		}
	}
	return nil, "", ErrNoSystemRoots
}

// WriteBundle writes dir/bundle.pem = system roots + caPEM and returns how
// many system roots it holds. Without system roots the bundle holds the CA
// alone (tunnelled hosts then fail verification in clients that use it), and
// the returned error says so while the file is still written.
func WriteBundle(dir string, caPEM []byte, getenv func(string) string) (int, error) {
	roots, _, rootsErr := SystemRootsPEM(getenv)
	var buf bytes.Buffer
	buf.Write(bytes.TrimRight(roots, "\n"))
	if buf.Len() > 0 {
		buf.WriteString("\n")
	}
	buf.WriteString("# pollgate CA\n")
	buf.Write(caPEM)
	if err := writeFileAtomic(filepath.Join(dir, BundleFile), buf.Bytes(), 0o644); err != nil {
		return 0, err
	}
	if rootsErr != nil {
		return 0, fmt.Errorf("bundle.pem holds only the pollgate CA: %w (hint: install ca-certificates, or set SSL_CERT_FILE to your root bundle, then delete bundle.pem and restart)", rootsErr)
	}
	return countCerts(roots), nil
}

func countCerts(data []byte) int {
	n := 0
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			return n
		}
		if b.Type == "CERTIFICATE" {
			n++
		}
	}
}
