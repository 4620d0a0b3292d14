package config

import (
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestValidateAgentAndTrustBundles(t *testing.T) {
	base := func() *NodeConfig {
		c := &NodeConfig{NodeName: "n1", Attestor: "insecure", CacheDir: "/var/lib/ka"}
		c.Default()
		return c
	}
	if err := base().Validate(); err != nil {
		t.Fatalf("defaults invalid: %v", err)
	}
	c := base()
	c.Agent.MetricsBindAddress = "localhost"
	c.Agent.RenewalRetryInitial.Duration = c.Agent.RenewalRetryMax.Duration * 2
	c.TrustBundles = []TrustBundleProjection{
		{Name: "a", SignerName: "x.io/s", Path: "/etc/tb/a/ca.crt"},
		{Path: "relative/ca.crt"},
		{Name: "b", LabelSelector: &metav1.LabelSelector{}, Path: "/etc/tb/a/other.crt"},
		{SignerName: "nodomain", Path: "/var/lib/ka/tb/ca.crt"},
		{Name: "c", Path: "/etc/tb/c/..data"},
	}
	err := c.Validate()
	if err == nil {
		t.Fatal("invalid configuration accepted")
	}
	for _, want := range []string{
		"agent.metricsBindAddress", "renewalRetryMax", "mutually exclusive", "one of name and signerName",
		"must be absolute", "labelSelector is only allowed with signerName", "already used by trustBundles[0]",
		"dotted domain", "inside cacheDir", `must not start with ".."`,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q:\n%v", want, err)
		}
	}
	ok := base()
	ok.TrustBundles = []TrustBundleProjection{
		{Name: "cluster.x-k8s.io:kubelet-serving-tpm:abc", Path: "/etc/kubernetes/trust-bundles/serving/ca.crt", PostUpdateCommand: []string{"systemctl", "reload", "x"}},
		{SignerName: "cluster.x-k8s.io/kubelet-serving-tpm", LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"a": "b"}}, Path: "/etc/kubernetes/trust-bundles/all/ca.crt"},
	}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
}

// TestMetricsBindAddress: the default is a unix socket; unix: takes a clean
// absolute path, anything else is host:port or "0".
func TestMetricsBindAddress(t *testing.T) {
	c := &NodeConfig{NodeName: "n1", Attestor: "insecure", CacheDir: "/var/lib/ka"}
	c.Default()
	if c.Agent.MetricsBindAddress != "unix:"+DefaultMetricsSocket {
		t.Errorf("default metricsBindAddress %q", c.Agent.MetricsBindAddress)
	}
	for addr, ok := range map[string]bool{
		"unix:/run/kubelet-authenticator/metrics.sock": true,
		"127.0.0.1:10279":                   true,
		"0":                                 true,
		"unix:metrics.sock":                 false,
		"unix:/run/x/../metrics.sock":       false,
		"unix:":                             false,
		"/run/kubelet-authenticator/m.sock": false,
	} {
		c.Agent.MetricsBindAddress = addr
		if err := c.Validate(); (err == nil) != ok {
			t.Errorf("metricsBindAddress %q: valid %v, want %v (%v)", addr, err == nil, ok, err)
		}
	}
}

// TestServing: off by default, defaults to the attestor's serving signer
// and kubelet's file name in the cache directory; when enabled, insecure
// (client-only), bad names, addresses, paths and lifetimes are each named.
func TestServing(t *testing.T) {
	c := &NodeConfig{NodeName: "n1", Attestor: "tpm", CacheDir: "/var/lib/ka"}
	c.Default()
	if c.Serving.Enabled {
		t.Fatal("serving on by default")
	}
	if c.Serving.SignerName != "cluster.x-k8s.io/kubelet-serving-tpm" || c.Serving.Path != "/var/lib/ka/kubelet-server-current.pem" {
		t.Fatalf("defaults: %+v", c.Serving)
	}
	c.Serving.Enabled = true
	if err := c.Validate(); err != nil {
		t.Fatalf("enabled with defaults: %v", err)
	}
	c.Serving.DNSNames = []string{"n1", "n1.internal"}
	c.Serving.IPAddresses = []string{"10.0.0.5", "fd00::5"}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}

	bad := &NodeConfig{NodeName: "n1", Attestor: "insecure", CacheDir: "/var/lib/ka", Serving: ServingConfig{
		Enabled: true, SignerName: "nodomain", Path: "/var/lib/ka/kubelet-client-current.pem",
		DNSNames: []string{"Bad_Name"}, IPAddresses: []string{"10.0.0.300", "0.0.0.0"},
		CertificateLifetime: Duration{time.Minute},
	}}
	bad.Default()
	err := bad.Validate()
	if err == nil {
		t.Fatal("invalid serving configuration accepted")
	}
	for _, want := range []string{
		"attestor insecure issues client certificates only", `serving.signerName "nodomain"`, "only kubelet-server-current.pem",
		"serving.dnsNames[0]", `serving.ipAddresses[0] "10.0.0.300"`, `serving.ipAddresses[1] "0.0.0.0"`, "serving.certificateLifetime",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q:\n%v", want, err)
		}
	}
	rel := &NodeConfig{NodeName: "n1", Attestor: "tpm", CacheDir: "/var/lib/ka", Serving: ServingConfig{Enabled: true, Path: "pki/server.pem"}}
	rel.Default()
	if err := rel.Validate(); err == nil || !strings.Contains(err.Error(), "clean absolute path") {
		t.Errorf("relative serving.path: %v", err)
	}
	// Disabled, nothing of it is checked: an insecure node's config stays valid.
	off := &NodeConfig{NodeName: "n1", Attestor: "insecure", CacheDir: "/var/lib/ka"}
	off.Default()
	if err := off.Validate(); err != nil {
		t.Fatal(err)
	}
}
