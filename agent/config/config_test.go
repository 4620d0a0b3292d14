package config

import (
	"strings"
	"testing"

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
