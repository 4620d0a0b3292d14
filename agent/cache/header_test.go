package cache

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestHeaderDigestCoversHeaderAndBody(t *testing.T) {
	body := []byte("-----BEGIN CERTIFICATE-----\nQUJD\n-----END CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----\nREVG\n-----END PRIVATE KEY-----\n")
	at := time.Unix(1_800_000_000, 0)
	h := Header{Node: "n1", NotBefore: at, RenewBy: at.Add(time.Hour), Expiration: at.Add(2 * time.Hour)}
	data := append(h.Encode(body), body...)
	got, rest, err := SplitHeader(data)
	if err != nil || got != h || !bytes.Equal(rest, body) {
		t.Fatalf("SplitHeader(Encode) = %+v, %q, %v", got, rest, err)
	}
	for name, edit := range map[string]func(string) string{
		"renew-by moved": func(s string) string { return strings.Replace(s, "renew-by=", "renew-by=9", 1) },
		"node renamed":   func(s string) string { return strings.Replace(s, "node=n1", "node=n2", 1) },
		"body edited":    func(s string) string { return strings.Replace(s, "QUJD", "QUJE", 1) },
		"body truncated": func(s string) string { return s[:len(s)-10] },
		"header removed": func(s string) string { return s[strings.IndexByte(s, '\n')+1:] },
		"digest removed": func(s string) string { return s[:strings.Index(s, " sha256=")] + s[strings.IndexByte(s, '\n'):] },
	} {
		if _, _, err := SplitHeader([]byte(edit(string(data)))); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestFresh checks the exec plugin's cached path: it answers from what
// Store wrote, byte for byte what Load parses, and declines whenever the
// full path must look (so that it never hands out a certificate for the
// wrong node or one due for renewal).
func TestFresh(t *testing.T) {
	d := Dir{Path: t.TempDir()}
	now := time.Now()
	if _, _, _, ok := d.Fresh("n1", now); ok {
		t.Fatal("fresh without a cache file")
	}
	cert, key := selfSigned(t)
	if err := d.Store(cert, key); err != nil {
		t.Fatal(err)
	}
	loaded, err := d.Load()
	if err != nil {
		t.Fatal(err)
	}
	gotCert, gotKey, expires, ok := d.Fresh("n1", now)
	if !ok {
		t.Fatal("a just-stored certificate is not fresh")
	}
	if !bytes.Equal(gotCert, loaded.CertPEM) || !bytes.Equal(gotKey, loaded.KeyPEM) {
		t.Fatalf("Fresh and Load disagree:\n%s%s\n---\n%s%s", gotCert, gotKey, loaded.CertPEM, loaded.KeyPEM)
	}
	if expires.After(loaded.Leaf.NotAfter) || !expires.After(now) {
		t.Fatalf("expires %s outside (now, NotAfter %s]", expires, loaded.Leaf.NotAfter)
	}
	h, _, _ := SplitHeader(mustRead(t, filepath.Join(d.Path, CurrentFile)))
	for name, tc := range map[string]struct {
		node string
		at   time.Time
	}{
		"other node":       {"n2", now},
		"before notBefore": {"n1", h.NotBefore.Add(-time.Second)},
		"at renew-by":      {"n1", h.RenewBy},
		"expired":          {"n1", h.Expiration.Add(time.Second)},
	} {
		if _, _, _, ok := d.Fresh(tc.node, tc.at); ok {
			t.Errorf("%s: answered from the cache", name)
		}
	}
	p := filepath.Join(d.Path, CurrentFile)
	data := mustRead(t, p)
	data[len(data)-40] ^= 1
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, _, ok := d.Fresh("n1", now); ok {
		t.Fatal("an edited cache file was answered from")
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}
