package kubetest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"time"
)

// keyPair is a certificate and its ECDSA P-256 key, PEM-encoded
// ("CERTIFICATE", "EC PRIVATE KEY"), as kube-apiserver's --tls-cert-file,
// --tls-private-key-file and --client-ca-file read them.
type keyPair struct {
	cert    *x509.Certificate
	key     *ecdsa.PrivateKey
	certPEM []byte
	keyPEM  []byte
}

// certValidity is how long the generated certificates are valid: far longer
// than any test, short enough that a leaked directory's keys expire.
const certValidity = 24 * time.Hour

// newCA makes a self-signed CA certificate.
func newCA(cn string) (*keyPair, error) {
	return newCert(cn, nil, nil, nil, true, nil)
}

// newCert makes a certificate signed by ca (self-signed when ca is nil).
// orgs become the subject's O (Kubernetes reads them as the client's
// groups); ips and dns are the serving names; usages are the extended key
// usages (server or client auth).
func newCert(cn string, orgs []string, ips []net.IP, dns []string, isCA bool, ca *keyPair, usages ...x509.ExtKeyUsage) (*keyPair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("kubetest: key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return nil, fmt.Errorf("kubetest: serial: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: cn, Organization: orgs},
		NotBefore:             now.Add(-time.Hour), // clock skew between processes is nil, but be lenient
		NotAfter:              now.Add(certValidity),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:           usages,
		BasicConstraintsValid: true,
		IsCA:                  isCA,
		IPAddresses:           ips,
		DNSNames:              dns,
	}
	if isCA {
		tmpl.KeyUsage |= x509.KeyUsageCertSign
	}
	parent, signer := tmpl, key
	if ca != nil {
		parent, signer = ca.cert, ca.key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, signer)
	if err != nil {
		return nil, fmt.Errorf("kubetest: certificate %s: %w", cn, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	return &keyPair{
		cert:    cert,
		key:     key,
		certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		keyPEM:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}),
	}, nil
}
