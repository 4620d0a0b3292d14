// Package cache keeps the kubelet client credential on the node: the current
// certificate and its key in one file (so the pair is replaced atomically),
// the key of a request still in flight, and the lock that makes concurrent
// invocations of the exec plugin and the agent produce one CSR, not many.
//
// Readers need no lock: every file is replaced by rename, so a reader sees
// the old content or the new, never a mix. Writers hold the lock.
package cache

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/gofrs/flock"

	"sigs.k8s.io/kubelet-authenticator/agent/rotation"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

const (
	// CurrentFile holds a header line (see Header), the current
	// certificate chain and its key.
	CurrentFile = "kubelet-client-current.pem"
	// PendingKeyFile holds the key of a CSR that was filed but not yet
	// answered, so that a retry finds the same CSR.
	PendingKeyFile = "kubelet-client-pending.key"
	// LockFile is the flock(2) file guarding writers.
	LockFile = ".lock"
)

// ErrNotFound is returned by Load when there is no cached credential.
var ErrNotFound = errors.New("no cached credential")

// Dir is a cache directory.
type Dir struct {
	Path string
}

// Credential is a certificate chain and its private key.
type Credential struct {
	// CertPEM is the PEM certificate chain, leaf first; KeyPEM the PEM key.
	CertPEM []byte
	KeyPEM  []byte
	// Leaf is the parsed first certificate and Key the parsed private key.
	Leaf *x509.Certificate
	Key  crypto.Signer
}

// Ensure creates the directory (0700) if it does not exist.
func (d Dir) Ensure() error {
	if err := os.MkdirAll(d.Path, 0o700); err != nil {
		return fmt.Errorf("unable to create cache directory: %w", err)
	}
	return nil
}

// Lock takes the writers' lock, waiting until ctx is done. The returned
// function releases it.
func (d Dir) Lock(ctx context.Context) (func(), error) {
	if err := d.Ensure(); err != nil {
		return nil, err
	}
	l := flock.New(filepath.Join(d.Path, LockFile), flock.SetPermissions(0o600))
	ok, err := l.TryLockContext(ctx, 50*time.Millisecond)
	if err != nil {
		return nil, fmt.Errorf("unable to lock cache directory %s: %w", d.Path, err)
	}
	if !ok {
		return nil, fmt.Errorf("unable to lock cache directory %s: %w", d.Path, ctx.Err())
	}
	return func() { _ = l.Unlock() }, nil
}

// Load reads and parses the current credential. It returns ErrNotFound when
// there is none, and an error saying what is wrong when the file is corrupt
// or its key does not match its certificate; callers replace such a file,
// never trust it.
func (d Dir) Load() (*Credential, error) {
	data, err := os.ReadFile(filepath.Join(d.Path, CurrentFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("unable to read cached credential: %w", err)
	}
	h, body, err := SplitHeader(data)
	if err != nil {
		return nil, fmt.Errorf("cached credential is corrupt: %w", err)
	}
	cred, err := ParseCredential(body)
	if err != nil {
		return nil, err
	}
	if attestor.NodeUserPrefix+h.Node != cred.Leaf.Subject.CommonName {
		return nil, fmt.Errorf("cached credential header names node %q but the certificate %q", h.Node, cred.Leaf.Subject.CommonName)
	}
	return cred, nil
}

// ParseCredential parses a certificate chain followed by its key, as Store
// writes it.
func ParseCredential(data []byte) (*Credential, error) {
	var certPEM, keyPEM bytes.Buffer
	rest := bytes.TrimSpace(data)
	for {
		if len(rest) > 0 && !bytes.HasPrefix(rest, []byte("-----BEGIN ")) {
			return nil, errors.New("cached credential has data outside its PEM blocks")
		}
		var blk *pem.Block
		blk, rest = pem.Decode(rest)
		if blk == nil {
			break
		}
		rest = bytes.TrimSpace(rest)
		switch blk.Type {
		case "CERTIFICATE":
			_ = pem.Encode(&certPEM, blk)
		case "PRIVATE KEY", "EC PRIVATE KEY":
			if keyPEM.Len() != 0 {
				return nil, errors.New("cached credential has more than one key")
			}
			_ = pem.Encode(&keyPEM, blk)
		default:
			return nil, fmt.Errorf("cached credential has an unexpected %q block", blk.Type)
		}
	}
	if len(bytes.TrimSpace(rest)) != 0 {
		return nil, errors.New("cached credential has trailing data")
	}
	if certPEM.Len() == 0 || keyPEM.Len() == 0 {
		return nil, errors.New("cached credential lacks a certificate or a key")
	}
	pair, err := tls.X509KeyPair(certPEM.Bytes(), keyPEM.Bytes())
	if err != nil {
		return nil, fmt.Errorf("cached credential is invalid: %w", err)
	}
	signer, ok := pair.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, errors.New("cached key cannot sign")
	}
	return &Credential{CertPEM: certPEM.Bytes(), KeyPEM: keyPEM.Bytes(), Leaf: pair.Leaf, Key: signer}, nil
}

// Store replaces the current credential atomically (0600). It refuses a
// certificate that does not parse, is not a node's, or whose key does not
// match, so that Fresh can trust what it wrote.
func (d Dir) Store(certPEM, keyPEM []byte) error {
	body := append(append([]byte{}, certPEM...), keyPEM...)
	cred, err := ParseCredential(body)
	if err != nil {
		return fmt.Errorf("refusing to store credential: %w", err)
	}
	node, ok := strings.CutPrefix(cred.Leaf.Subject.CommonName, attestor.NodeUserPrefix)
	if !ok || node == "" || strings.ContainsAny(node, " \t\n") {
		return fmt.Errorf("refusing to store credential for %q: not a node certificate", cred.Leaf.Subject.CommonName)
	}
	if err := d.Ensure(); err != nil {
		return err
	}
	h := Header{
		Node:       node,
		NotBefore:  cred.Leaf.NotBefore,
		RenewBy:    rotation.RenewBy(cred.Leaf),
		Expiration: rotation.Expiration(cred.Leaf),
	}
	return WriteFileAtomic(filepath.Join(d.Path, CurrentFile), append(h.Encode(body), body...), 0o600)
}

// LoadPendingKey returns the key of a client CSR in flight, or nil if
// there is none (or the file is unusable, in which case it is discarded).
func (d Dir) LoadPendingKey() (*ecdsa.PrivateKey, error) { return d.LoadKey(PendingKeyFile) }

// StorePendingKey records the key of a client CSR about to be filed (0600).
func (d Dir) StorePendingKey(key *ecdsa.PrivateKey) error { return d.StoreKey(PendingKeyFile, key) }

// ClearPendingKey forgets the key of the client CSR in flight.
func (d Dir) ClearPendingKey() error { return d.ClearKey(PendingKeyFile) }

// LoadKey returns the key in the named file of the directory (the key of a
// CSR in flight), or nil if there is none or the file is unusable, in which
// case it is discarded: a corrupt key is replaced, never trusted.
func (d Dir) LoadKey(name string) (*ecdsa.PrivateKey, error) {
	p := filepath.Join(d.Path, name)
	data, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("unable to read pending key: %w", err)
	}
	key, err := parseECKey(data)
	if err != nil {
		_ = os.Remove(p)
		return nil, nil
	}
	return key, nil
}

// StoreKey writes key to the named file of the directory (0600).
func (d Dir) StoreKey(name string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("unable to encode key: %w", err)
	}
	if err := d.Ensure(); err != nil {
		return err
	}
	// Not synced: the key must be there for a later call that retries the
	// request (the page cache is enough for that), while a crash of the
	// whole machine can at worst lose it or leave it unreadable, which
	// LoadKey treats as no key: the node files a new request and the old
	// one expires unanswered. The key is on the cold path's critical path;
	// the credential it ends in is synced.
	return writeFileAtomic(filepath.Join(d.Path, name), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600, false)
}

// ClearKey removes the named key file of the directory.
func (d Dir) ClearKey(name string) error {
	err := os.Remove(filepath.Join(d.Path, name))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("unable to remove pending key: %w", err)
	}
	return nil
}

func parseECKey(data []byte) (*ecdsa.PrivateKey, error) {
	blk, rest := pem.Decode(data)
	if blk == nil || len(bytes.TrimSpace(rest)) != 0 {
		return nil, errors.New("not a single PEM block")
	}
	k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
	if err != nil {
		return nil, err
	}
	ec, ok := k.(*ecdsa.PrivateKey)
	if !ok {
		return nil, errors.New("not an ECDSA key")
	}
	return ec, nil
}

// WriteFileAtomic writes data to a temporary file in the same directory,
// syncs it, and renames it over path, so that readers see the old content or
// the new, never a partial file.
func WriteFileAtomic(path string, data []byte, perm fs.FileMode) error {
	return writeFileAtomic(path, data, perm, true)
}

// writeFileAtomic is WriteFileAtomic; durable false skips the syncs (of the
// file and of the directory after the rename).
func writeFileAtomic(path string, data []byte, perm fs.FileMode, durable bool) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+tempMarker+"*")
	if err != nil {
		return fmt.Errorf("unable to write %s: %w", path, err)
	}
	tmp := f.Name()
	ok := false
	defer func() {
		if !ok {
			_ = f.Close()
			_ = os.Remove(tmp)
		}
	}()
	if err := f.Chmod(perm); err != nil {
		return fmt.Errorf("unable to write %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		return fmt.Errorf("unable to write %s: %w", path, err)
	}
	if durable {
		if err := f.Sync(); err != nil {
			return fmt.Errorf("unable to write %s: %w", path, err)
		}
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("unable to write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("unable to write %s: %w", path, err)
	}
	ok = true
	if !durable {
		return nil
	}
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
	return nil
}

// tempMarker is in the name of every temporary file WriteFileAtomic
// creates: "." + base + ".tmp-" + random.
const tempMarker = ".tmp-"

// RemoveTemp removes temporary files a crashed writer left in the cache
// directory (WriteFileAtomic's, which start with a dot and carry
// ".tmp-"). Only the agent calls it, at start, holding the lock, so that
// no writer's file in progress is taken away.
func (d Dir) RemoveTemp() error {
	entries, err := os.ReadDir(d.Path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("unable to clean up cache directory: %w", err)
	}
	var errs []error
	for _, e := range entries {
		if n := e.Name(); e.Type().IsRegular() && strings.HasPrefix(n, ".") && strings.Contains(n, tempMarker) {
			if err := os.Remove(filepath.Join(d.Path, n)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// ClusterFile records the cluster the current credential was obtained
// from, so that the node keeps finding it when the bootstrap kubeconfig is
// gone (operators delete it once the node has joined).
const ClusterFile = "cluster.json"

// Cluster is where the node's API server is and how to verify it.
type Cluster struct {
	Server     string `json:"server"`
	CAData     []byte `json:"certificateAuthorityData,omitempty"`
	ServerName string `json:"tlsServerName,omitempty"`
}

// StoreCluster records c (0600).
func (d Dir) StoreCluster(c Cluster) error {
	if c.Server == "" {
		return errors.New("refusing to record a cluster without a server")
	}
	data, err := json.Marshal(c)
	if err != nil {
		return err
	}
	if err := d.Ensure(); err != nil {
		return err
	}
	return WriteFileAtomic(filepath.Join(d.Path, ClusterFile), append(data, '\n'), 0o600)
}

// LoadCluster returns the recorded cluster, or ErrNotFound.
func (d Dir) LoadCluster() (*Cluster, error) {
	data, err := os.ReadFile(filepath.Join(d.Path, ClusterFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("unable to read the recorded cluster: %w", err)
	}
	var c Cluster
	if err := json.Unmarshal(data, &c); err != nil || c.Server == "" {
		return nil, fmt.Errorf("the recorded cluster %s is corrupt", filepath.Join(d.Path, ClusterFile))
	}
	return &c, nil
}
