package cache

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func selfSigned(t *testing.T) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "system:node:n1"},
		NotBefore:    time.Now().Add(-time.Minute),
		NotAfter:     time.Now().Add(time.Hour),
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalPKCS8PrivateKey(key)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder})
}

func TestStoreLoad(t *testing.T) {
	d := Dir{Path: filepath.Join(t.TempDir(), "cache")}
	if _, err := d.Load(); !errors.Is(err, ErrNotFound) {
		t.Fatalf("empty cache: %v, want ErrNotFound", err)
	}
	cert, key := selfSigned(t)
	if err := d.Store(cert, key); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(d.Path, CurrentFile))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("credential file mode %v, %v; want 0600", st.Mode().Perm(), err)
	}
	if dst, _ := os.Stat(d.Path); dst.Mode().Perm() != 0o700 {
		t.Fatalf("cache dir mode %v, want 0700", dst.Mode().Perm())
	}
	c, err := d.Load()
	if err != nil {
		t.Fatal(err)
	}
	if c.Leaf.Subject.CommonName != "system:node:n1" {
		t.Fatalf("leaf %v", c.Leaf.Subject)
	}
}

func TestStoreRefusesMismatchedKey(t *testing.T) {
	d := Dir{Path: t.TempDir()}
	cert, _ := selfSigned(t)
	_, otherKey := selfSigned(t)
	if err := d.Store(cert, otherKey); err == nil {
		t.Fatal("stored a certificate with a key that does not match it")
	}
	if _, err := d.Load(); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a refused store left a file behind: %v", err)
	}
}

func TestLoadRejectsCorruptOrMismatched(t *testing.T) {
	cert, key := selfSigned(t)
	_, otherKey := selfSigned(t)
	cases := map[string][]byte{
		"garbage":        []byte("not pem at all"),
		"truncated":      append(append([]byte{}, cert...), key[:len(key)/2]...),
		"key mismatch":   append(append([]byte{}, cert...), otherKey...),
		"no key":         cert,
		"two keys":       append(append(append([]byte{}, cert...), key...), key...),
		"trailing bytes": append(append(append([]byte{}, cert...), key...), []byte("xx")...),
	}
	for name, body := range cases {
		t.Run(name, func(t *testing.T) {
			d := Dir{Path: t.TempDir()}
			// A valid header and digest: the content itself must be rejected.
			h := Header{Node: "n1", NotBefore: time.Now(), RenewBy: time.Now().Add(time.Hour), Expiration: time.Now().Add(time.Hour)}
			data := append(h.Encode(body), body...)
			if err := os.WriteFile(filepath.Join(d.Path, CurrentFile), data, 0o600); err != nil {
				t.Fatal(err)
			}
			if c, err := d.Load(); err == nil {
				t.Fatalf("loaded a corrupt credential: %v", c.Leaf.Subject)
			}
		})
	}
}

func TestLoadRejectsEditedFile(t *testing.T) {
	d := Dir{Path: t.TempDir()}
	cert, key := selfSigned(t)
	if err := d.Store(cert, key); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(d.Path, CurrentFile)
	data, _ := os.ReadFile(p)
	for _, edit := range []func([]byte) []byte{
		func(b []byte) []byte { b[len(b)-40] ^= 1; return b },                                        // body byte
		func(b []byte) []byte { return []byte(strings.Replace(string(b), "node=n1", "node=n2", 1)) }, // header claim
		func(b []byte) []byte { return b[bytes.IndexByte(b, '\n')+1:] },                              // header removed
	} {
		if err := os.WriteFile(p, edit(append([]byte{}, data...)), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := d.Load(); err == nil {
			t.Fatal("edited cache file trusted")
		}
	}
}

func TestPendingKey(t *testing.T) {
	d := Dir{Path: t.TempDir()}
	if k, err := d.LoadPendingKey(); k != nil || err != nil {
		t.Fatalf("no pending key: got %v, %v", k, err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err := d.StorePendingKey(key); err != nil {
		t.Fatal(err)
	}
	got, err := d.LoadPendingKey()
	if err != nil || !got.Equal(key) {
		t.Fatalf("pending key not restored: %v", err)
	}
	if err := os.WriteFile(filepath.Join(d.Path, PendingKeyFile), []byte("corrupt"), 0o600); err != nil {
		t.Fatal(err)
	}
	if k, err := d.LoadPendingKey(); k != nil || err != nil {
		t.Fatalf("corrupt pending key trusted: %v, %v", k, err)
	}
	if _, err := os.Stat(filepath.Join(d.Path, PendingKeyFile)); !os.IsNotExist(err) {
		t.Fatal("corrupt pending key not discarded")
	}
}

func TestLockIsExclusive(t *testing.T) {
	d := Dir{Path: t.TempDir()}
	var inside, maxInside atomic.Int32
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			unlock, err := d.Lock(context.Background())
			if err != nil {
				t.Error(err)
				return
			}
			n := inside.Add(1)
			if n > maxInside.Load() {
				maxInside.Store(n)
			}
			time.Sleep(5 * time.Millisecond)
			inside.Add(-1)
			unlock()
		}()
	}
	wg.Wait()
	if maxInside.Load() != 1 {
		t.Fatalf("%d holders at once", maxInside.Load())
	}
	unlock, _ := d.Lock(context.Background())
	defer unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := d.Lock(ctx); err == nil {
		t.Fatal("second lock taken while held")
	}
}

// TestRemoveTemp: the temporary files of a writer that died between create
// and rename are removed at start; the credential, the pending key and the
// lock are not.
func TestRemoveTemp(t *testing.T) {
	d := Dir{Path: t.TempDir()}
	cert, key := selfSigned(t)
	if err := d.Store(cert, key); err != nil {
		t.Fatal(err)
	}
	k, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err := d.StorePendingKey(k); err != nil {
		t.Fatal(err)
	}
	unlock, err := d.Lock(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	unlock()
	for _, n := range []string{"." + CurrentFile + ".tmp-123", "." + PendingKeyFile + ".tmp-456", ".state.json.tmp-789"} {
		if err := os.WriteFile(filepath.Join(d.Path, n), []byte("partial"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.RemoveTemp(); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(d.Path)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	slices.Sort(names)
	if want := []string{LockFile, CurrentFile, PendingKeyFile}; !slices.Equal(names, want) {
		t.Fatalf("after RemoveTemp: %q, want %q", names, want)
	}
}
