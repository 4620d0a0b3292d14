// Package fastpath answers the exec credential plugin's most frequent call,
// a fresh cached certificate, with as little as possible: no Kubernetes
// client, no TLS, no X.509 parsing. It is the only non-standard-library code
// the kubelet-authenticator launcher links, because every package a Go
// binary links is initialised on every run, and kubelet (and every kubectl
// on the node using the same kubeconfig) pays that on each call.
//
// The cache file starts with a header line written by the full
// implementation when it stores a certificate it has checked (key matches
// certificate, certificate parses):
//
//	# kubelet-authenticator v1 node=<name> not-before=<unix> renew-by=<unix> expires=<unix> sha256=<hex>
//
// sha256 covers the header text before " sha256=" plus the rest of the file,
// so a corrupt or edited file never passes. Anything the fast path is unsure
// of (no header, a mismatch, a flag it does not know) sends the call to the
// full implementation, which checks everything and renews.
package fastpath

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
)

// Defaults shared with agent/config (a test keeps them equal).
const (
	DefaultConfigPath = "/etc/kubelet-authenticator/config.yaml"
	DefaultCacheDir   = "/var/lib/kubelet-authenticator"
	// CurrentFile is the cache file holding header, chain and key.
	CurrentFile = "kubelet-client-current.pem"
)

const (
	headerPrefix = "# kubelet-authenticator v1 "
	digestField  = " sha256="
)

// Header is the metadata line of a cache file.
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
	return []byte(text + digestField + digest(text, body) + "\n")
}

func digest(text string, body []byte) string {
	d := sha256.New()
	d.Write([]byte(text))
	d.Write([]byte{'\n'})
	d.Write(body)
	return hex.EncodeToString(d.Sum(nil))
}

// Split parses a cache file into its header and body, checking the digest.
func Split(data []byte) (Header, []byte, error) {
	var h Header
	nl := bytes.IndexByte(data, '\n')
	if nl < 0 || !bytes.HasPrefix(data, []byte(headerPrefix)) {
		return h, nil, errors.New("no header")
	}
	line, body := string(data[:nl]), data[nl+1:]
	i := strings.LastIndex(line, digestField)
	if i < 0 {
		return h, nil, errors.New("header has no digest")
	}
	text, sum := line[:i], line[i+len(digestField):]
	if sum != digest(text, body) {
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

// credentialFlags are the flags of `credential` that take a value; the fast
// path reads three of them and must know the others to skip their values.
var credentialFlags = map[string]bool{
	"config": true, "node-name": true, "cache-dir": true, "provider-id": true, "attestor": true,
	"signer-name": true, "bootstrap-kubeconfig": true, "timeout": true, "certificate-lifetime": true,
}

// nodeConfig is the part of the node's configuration the fast path reads.
type nodeConfig struct {
	NodeName string `json:"nodeName"`
	CacheDir string `json:"cacheDir"`
}

// Credential answers `credential` args from a fresh cache, returning the
// ExecCredential JSON and true; or false when the full implementation must
// run (anything missing, stale, unexpected or unreadable).
func Credential(args []string, execInfo string, now time.Time) ([]byte, bool) {
	if len(args) == 0 || args[0] != "credential" {
		return nil, false
	}
	flags := map[string]string{}
	for i := 1; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "--") {
			return nil, false
		}
		name, value, hasValue := strings.Cut(a[2:], "=")
		if name == "verbose" {
			// Progress logging concerns the slow path only.
			continue
		}
		if !credentialFlags[name] {
			return nil, false
		}
		if !hasValue {
			if i+1 >= len(args) {
				return nil, false
			}
			i++
			value = args[i]
		}
		flags[name] = value
	}
	apiVersion := "client.authentication.k8s.io/v1"
	if execInfo != "" {
		var info struct {
			APIVersion string `json:"apiVersion"`
		}
		if json.Unmarshal([]byte(execInfo), &info) != nil {
			return nil, false
		}
		switch info.APIVersion {
		case "client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1":
			apiVersion = info.APIVersion
		default:
			return nil, false
		}
	}
	cfg, ok := loadConfig(flags)
	if !ok {
		return nil, false
	}
	data, err := os.ReadFile(filepath.Join(cfg.CacheDir, CurrentFile))
	if err != nil {
		return nil, false
	}
	h, body, err := Split(data)
	if err != nil || h.Node != cfg.NodeName || now.Before(h.NotBefore) || !now.Before(h.RenewBy) || !now.Before(h.Expiration) {
		return nil, false
	}
	certPEM, keyPEM, ok := splitPEM(body)
	if !ok {
		return nil, false
	}
	out, err := MarshalExecCredential(apiVersion, h.Expiration, certPEM, keyPEM)
	if err != nil {
		return nil, false
	}
	return out, true
}

// MarshalExecCredential returns the ExecCredential JSON (and a newline) the
// plugin prints, in the apiVersion kubelet asked with ("" means v1).
func MarshalExecCredential(apiVersion string, expires time.Time, certPEM, keyPEM []byte) ([]byte, error) {
	if apiVersion == "" {
		apiVersion = "client.authentication.k8s.io/v1"
	}
	out, err := json.Marshal(execCredential{
		APIVersion: apiVersion,
		Kind:       "ExecCredential",
		Status: execCredentialStatus{
			ExpirationTimestamp:   expires.UTC().Format(time.RFC3339),
			ClientCertificateData: string(certPEM),
			ClientKeyData:         string(keyPEM),
		},
	})
	if err != nil {
		return nil, err
	}
	return append(out, '\n'), nil
}

type execCredential struct {
	APIVersion string               `json:"apiVersion"`
	Kind       string               `json:"kind"`
	Status     execCredentialStatus `json:"status"`
}

type execCredentialStatus struct {
	ExpirationTimestamp   string `json:"expirationTimestamp"`
	ClientCertificateData string `json:"clientCertificateData"`
	ClientKeyData         string `json:"clientKeyData"`
}

// loadConfig resolves node name and cache directory as agent/config does:
// flags over the config file over defaults.
func loadConfig(flags map[string]string) (nodeConfig, bool) {
	var c nodeConfig
	path, explicit := flags["config"]
	if !explicit {
		path = DefaultConfigPath
	}
	data, err := os.ReadFile(path)
	switch {
	case err == nil:
		if yaml.Unmarshal(data, &c) != nil {
			return c, false
		}
	case explicit || !errors.Is(err, os.ErrNotExist):
		return c, false
	}
	if v, ok := flags["node-name"]; ok {
		c.NodeName = v
	}
	if v, ok := flags["cache-dir"]; ok {
		c.CacheDir = v
	}
	if c.NodeName == "" {
		h, err := os.Hostname()
		if err != nil {
			return c, false
		}
		c.NodeName = strings.ToLower(h)
	}
	if c.CacheDir == "" {
		c.CacheDir = DefaultCacheDir
	}
	return c, true
}

// splitPEM separates the certificate blocks from the key block by their
// BEGIN lines, without decoding them (the full implementation checked them
// before writing the file, and the digest says they are unchanged).
func splitPEM(body []byte) (certPEM, keyPEM []byte, ok bool) {
	i := bytes.Index(body, []byte("-----BEGIN PRIVATE KEY-----"))
	if i < 0 {
		i = bytes.Index(body, []byte("-----BEGIN EC PRIVATE KEY-----"))
	}
	if i <= 0 {
		return nil, nil, false
	}
	return body[:i], body[i:], true
}
