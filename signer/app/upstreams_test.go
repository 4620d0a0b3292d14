package app

import (
	"bytes"
	"context"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
	"sigs.k8s.io/kubelet-authenticator/attestor/tlsconfig"
	"sigs.k8s.io/kubelet-authenticator/test/connectproxy"
	awsemu "sigs.k8s.io/kubelet-authenticator/test/emulators/aws"
	gcpemu "sigs.k8s.io/kubelet-authenticator/test/emulators/gcp"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// logBuffer collects the controller's log lines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) logger() logr.Logger {
	return funcr.New(func(prefix, args string) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.buf.WriteString(prefix + " " + args + "\n")
	}, funcr.Options{})
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// writeAtomic replaces a file the way the kubelet updates a mounted
// ConfigMap: readers see the old content or the new, never half of it.
func writeAtomic(t *testing.T, path, data string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// TestUpstreamProxyAndReload (issue 28.5): each cloud upstream is reached
// through the proxy its own tls block names and no other, verified against
// the trustedCA ConfigMap it names, read from a real kube-apiserver; a
// change to the attestor configuration file (proxy, securityProfile) or to
// the ConfigMap applies to new connections without a restart; a change
// that does not load keeps the last good settings working and shows in the
// metric and the log, without the proxy's password.
func TestUpstreamProxyAndReload(t *testing.T) {
	if testing.Short() {
		t.Skip("needs kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "upstreams")
	c, err := client.New(cp.AdminConfig, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	logs := &logBuffer{}
	ctx = logr.NewContext(ctx, logs.logger())
	const ns = "capi-system"
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		t.Fatal(err)
	}
	a := awsemu.New(t, awsemu.Instance{})
	g := gcpemu.New(t, gcpemu.Instance{})
	caMap := func(name string, pem []byte) *corev1.ConfigMap {
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Data: map[string]string{tlsconfig.ConfigMapKey: string(pem)}}
	}
	jwksCA := caMap("jwks-ca", g.JWKSCAPEM)
	for _, cm := range []*corev1.ConfigMap{caMap("sts-ca", a.STSCAPEM), jwksCA} {
		if err := c.Create(ctx, cm); err != nil {
			t.Fatal(err)
		}
	}
	stsProxy, jwksProxy, newJWKSProxy := connectproxy.Start(t), connectproxy.Start(t), connectproxy.Start(t, connectproxy.WithBasicAuth("ka", "s3cret"))
	newWithCreds := *newJWKSProxy.URL
	newWithCreds.User = url.UserPassword("ka", "s3cret")

	file := filepath.Join(t.TempDir(), "attestor-config.yaml")
	config := func(jwksTLS string) string {
		return `apiVersion: kubelet-authenticator.x-k8s.io/v1alpha1
kind: AttestorConfig
aws:
  accounts: ["111122223333"]
  allowedRoles: ["` + a.Instance.Role + `"]
  certificatesDir: ` + a.WriteCertDir(t) + `
  sts:
    tls:
      proxy: ` + stsProxy.URL.String() + `
      trustedCA: {configMap: {name: sts-ca}}
gcp:
  projects: [test-project]
  jwks:
    url: ` + g.JWKSURL + `
    tls:
` + jwksTLS
	}
	writeAtomic(t, file, config(`      proxy: `+jwksProxy.URL.String()+`
      trustedCA: {configMap: {name: jwks-ca}}
`))
	o := NewOptions()
	o.LeaderElectionNamespace = ns
	o.AttestorConfigFile = file
	o.UpstreamReloadInterval = time.Second
	if errs := o.cloudOptions.validate(); len(errs) > 0 {
		t.Fatal(errs)
	}
	sections, err := o.attestorConfigSections()
	if err != nil {
		t.Fatal(err)
	}
	_, live, err := o.verifiersFrom(ctx, c, sections)
	if err != nil {
		t.Fatal(err)
	}
	if err := o.keepUpstreamsCurrent(ctx, c, live); err != nil {
		t.Fatal(err)
	}
	// The verifiers' clients are made from these upstreams
	// (tlsconfig.Config.WithUpstream); attestor/gcp's
	// TestJWKSCARotationWithoutRestart shows a verifier follows its own.
	upstreamClient := func(section string) *http.Client {
		t.Helper()
		u, ok := live.live[section]
		if !ok {
			t.Fatalf("no upstream %s; have %v", section, live.live)
		}
		hc, err := (*tlsconfig.Config)(nil).WithUpstream(u).HTTPClient(5 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return hc
	}
	sts, jwks := upstreamClient(providers.AWSSTSTLS), upstreamClient(providers.GCPJWKSTLS)
	get := func(hc *http.Client, u string) error {
		hc.CloseIdleConnections() // a new connection each time, as after a reload
		resp, err := hc.Get(u)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	jwksURL, err := url.Parse(g.JWKSURL)
	if err != nil {
		t.Fatal(err)
	}
	jwksHost := jwksURL.Host
	failing := func(section string) float64 {
		var m dto.Metric
		if err := live.metrics.failing.WithLabelValues(section).Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetGauge().GetValue()
	}

	// Each upstream through its own proxy, and only its own.
	if err := get(sts, a.STSURL); err != nil {
		t.Fatalf("STS through its proxy: %v", err)
	}
	if err := get(jwks, g.JWKSURL); err != nil {
		t.Fatalf("JWKS through its proxy: %v", err)
	}
	if stsProxy.Tunnels(a.STSHost) != 1 || stsProxy.Total() != 1 || jwksProxy.Tunnels(jwksHost) != 1 || jwksProxy.Total() != 1 {
		t.Fatalf("tunnels: STS proxy %d to STS of %d; JWKS proxy %d to JWKS of %d; want 1 of 1 each",
			stsProxy.Tunnels(a.STSHost), stsProxy.Total(), jwksProxy.Tunnels(jwksHost), jwksProxy.Total())
	}

	// The JWKS server rotates its CA: refused until the ConfigMap and the
	// file change, then reached through the new proxy with the new CA,
	// with no restart.
	newCA := g.RotateTLS(t)
	if err := get(jwks, g.JWKSURL); err == nil {
		t.Fatal("the JWKS server's new CA was trusted before the ConfigMap changed")
	}
	jwksCA.Data[tlsconfig.ConfigMapKey] = string(newCA)
	if err := c.Update(ctx, jwksCA); err != nil {
		t.Fatal(err)
	}
	writeAtomic(t, file, config(`      proxy: `+newWithCreds.String()+`
      securityProfile: {type: Modern}
      trustedCA: {configMap: {name: jwks-ca}}
`))
	// The ConfigMap and the file are watched apart, so for a moment the
	// new CA may be reached through the old proxy: wait for both.
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		return get(jwks, g.JWKSURL) == nil && newJWKSProxy.Tunnels(jwksHost) > 0, nil
	})
	before := jwksProxy.Total()
	if err := get(jwks, g.JWKSURL); err != nil {
		t.Fatal(err)
	}
	if jwksProxy.Total() != before || stsProxy.Tunnels(jwksHost) != 0 {
		t.Fatal("after the reload the JWKS was reached through another proxy")
	}
	if got := live.live[providers.GCPJWKSTLS].Config().SecurityProfile; got == nil || got.Type != tlsconfig.ProfileModern {
		t.Fatalf("securityProfile after the reload: %+v", got)
	}

	// A ConfigMap that holds no certificate: the JWKS keeps its last good
	// settings, the STS is unaffected, and the metric says so.
	jwksCA.Data[tlsconfig.ConfigMapKey] = "not PEM"
	if err := c.Update(ctx, jwksCA); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 30*time.Second, func() (bool, error) { return failing(providers.GCPJWKSTLS) == 1, nil })
	if failing(providers.AWSSTSTLS) != 0 {
		t.Error("a broken JWKS ConfigMap marked STS failing")
	}
	if err := get(jwks, g.JWKSURL); err != nil {
		t.Fatalf("a broken ConfigMap replaced the last good bundle: %v", err)
	}
	jwksCA.Data[tlsconfig.ConfigMapKey] = string(newCA)
	if err := c.Update(ctx, jwksCA); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 30*time.Second, func() (bool, error) { return failing(providers.GCPJWKSTLS) == 0, nil })

	// A file with an invalid proxy keeps both upstreams on their last
	// good settings; the log says why without the password.
	writeAtomic(t, file, config(`      proxy: socks5://ka:s3cret@127.0.0.1:1080
      trustedCA: {configMap: {name: jwks-ca}}
`))
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		return failing(providers.GCPJWKSTLS) == 1 && failing(providers.AWSSTSTLS) == 1, nil
	})
	if err := get(jwks, g.JWKSURL); err != nil {
		t.Fatalf("an invalid file replaced the last good JWKS settings: %v", err)
	}
	if err := get(sts, a.STSURL); err != nil {
		t.Fatalf("an invalid file replaced the last good STS settings: %v", err)
	}
	out := logs.String()
	if !strings.Contains(out, "Keeping the last good outbound configuration") || !strings.Contains(out, `scheme \"socks5\"`) {
		t.Errorf("the log does not say the new settings were refused and why:\n%s", out)
	}
	if strings.Contains(out, "s3cret") {
		t.Errorf("the log repeats the proxy password:\n%s", out)
	}
	if !strings.Contains(out, "REDACTED@127.0.0.1") {
		t.Errorf("the log does not name the applied proxy (redacted):\n%s", out)
	}
}
