package cache

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// The current-credential file starts with one header line written by Store
// after it has checked the content (certificate parses, is a node's, key
// matches):
//
//	# kubelet-authenticator v1 node=<name> not-before=<unix> renew-by=<unix> expires=<unix> sha256=<hex>
//
// sha256 covers the header text before " sha256=", a newline, and the rest
// of the file, so an edited or truncated file never passes. The header lets
// the exec plugin answer from a fresh cache without parsing X.509 or keys
// (Fresh); anything it is unsure of sends it to the full path (Load, renew).
const (
	headerPrefix = "# kubelet-authenticator v1 "
	digestField  = " sha256="
)

// Header is the metadata line of the current-credential file.
type Header struct {
	Node       string
	NotBefore  time.Time
	RenewBy    time.Time
	Expiration time.Time
}

// Encode returns the header line (with its newline) for body, the PEM
// content that follows it.
func (h Header) Encode(body []byte) []byte {
	text := fmt.Sprintf("%snode=%s not-before=%d renew-by=%d expires=%d",
		headerPrefix, h.Node, h.NotBefore.Unix(), h.RenewBy.Unix(), h.Expiration.Unix())
	return []byte(text + digestField + headerDigest(text, body) + "\n")
}

func headerDigest(text string, body []byte) string {
	d := sha256.New()
	d.Write([]byte(text))
	d.Write([]byte{'\n'})
	d.Write(body)
	return hex.EncodeToString(d.Sum(nil))
}

// SplitHeader parses a current-credential file into its header and body,
// checking the digest.
func SplitHeader(data []byte) (Header, []byte, error) {
	var h Header
	line, body, ok := bytes.Cut(data, []byte{'\n'})
	if !ok || !bytes.HasPrefix(line, []byte(headerPrefix)) {
		return h, nil, errors.New("no header")
	}
	text, sum, ok := strings.Cut(string(line), digestField)
	if !ok {
		return h, nil, errors.New("header has no digest")
	}
	if sum != headerDigest(text, body) {
		return h, nil, errors.New("digest mismatch")
	}
	for _, f := range strings.Fields(strings.TrimPrefix(text, headerPrefix)) {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			return h, nil, fmt.Errorf("malformed header field %q", f)
		}
		var t *time.Time
		switch k {
		case "node":
			h.Node = v
			continue
		case "not-before":
			t = &h.NotBefore
		case "renew-by":
			t = &h.RenewBy
		case "expires":
			t = &h.Expiration
		default:
			// Fields of a later header version are covered by the digest.
			continue
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return h, nil, fmt.Errorf("malformed header field %q", f)
		}
		*t = time.Unix(n, 0)
	}
	if h.Node == "" || h.RenewBy.IsZero() || h.Expiration.IsZero() {
		return h, nil, errors.New("incomplete header")
	}
	return h, body, nil
}

// Fresh answers the exec plugin's most frequent question from the header
// alone: is there a cached credential for node that needs no renewal at
// now? It returns the certificate chain and key PEM as stored and the
// header's expiration. It parses no X.509 and takes no lock: Store checked
// the content before writing it, and the digest says it is unchanged. Any
// doubt (no file, no header, another node, not yet valid, past renew-by)
// returns false, and the caller takes the full path.
func (d Dir) Fresh(node string, now time.Time) (certPEM, keyPEM []byte, expires time.Time, ok bool) {
	data, err := os.ReadFile(filepath.Join(d.Path, CurrentFile))
	if err != nil {
		return nil, nil, time.Time{}, false
	}
	h, body, err := SplitHeader(data)
	if err != nil || h.Node != node || now.Before(h.NotBefore) || !now.Before(h.RenewBy) || !now.Before(h.Expiration) {
		return nil, nil, time.Time{}, false
	}
	// Store writes the chain, then the key; find the key's BEGIN line
	// without decoding anything.
	i := bytes.Index(body, []byte("-----BEGIN PRIVATE KEY-----"))
	if i < 0 {
		i = bytes.Index(body, []byte("-----BEGIN EC PRIVATE KEY-----"))
	}
	if i <= 0 {
		return nil, nil, time.Time{}, false
	}
	return body[:i], body[i:], h.Expiration, true
}
