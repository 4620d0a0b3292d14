package status

import (
	"bytes"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/trustbundle"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestCollect: status shows the cached certificate, the recorded renewal
// and attestation, and a projection's state, as text and as JSON.
func TestCollect(t *testing.T) {
	dir := t.TempDir()
	ca, err := harness.NewCA("status-ca")
	if err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM, err := ca.Issue(harness.CertSpec{CommonName: "system:node:n1", Organization: []string{attestor.NodesGroup}})
	if err != nil {
		t.Fatal(err)
	}
	if err := (cache.Dir{Path: dir}).Store(certPEM, keyPEM); err != nil {
		t.Fatal(err)
	}
	bundlePath := filepath.Join(dir, "..", "tb", "ca.crt")
	if _, err := trustbundle.NewWriter(bundlePath).Write(ca.CertPEM); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	rec := NewRecorder(dir)
	if err := rec.Update(func(s *State) {
		s.PID = 42
		s.Renewal.Last = NewResult(now.Add(-time.Minute), time.Second, os.ErrDeadlineExceeded)
		s.Renewal.ConsecutiveFailures = 2
		s.Attestation = NewResult(now.Add(-time.Minute), time.Millisecond, nil)
	}); err != nil {
		t.Fatal(err)
	}
	if err := rec.SetTrustBundle(trustbundle.Status{Projection: bundlePath, Sources: []string{"root"}, Certificates: 1, Stale: true, Reason: "ClusterTrustBundle root not found"}); err != nil {
		t.Fatal(err)
	}
	cfg := &config.NodeConfig{NodeName: "n1", CacheDir: dir, TrustBundles: []config.TrustBundleProjection{{Name: "root", Path: bundlePath}}}
	rep := Collect(cfg, now)
	if rep.Certificate == nil || rep.Agent == nil || rep.Agent.Renewal.ConsecutiveFailures != 2 || len(rep.TrustBundles) != 1 ||
		!rep.TrustBundles[0].Stale || rep.TrustBundles[0].Certificates != 1 {
		t.Fatalf("report %+v", rep)
	}
	var text bytes.Buffer
	if err := rep.WriteText(&text, now); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"CN=system:node:n1", "CN=status-ca", "FAILED", "Failures in a row:  2", "Goes dark:", "STALE", "ClusterTrustBundle root not found"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("text output lacks %q:\n%s", want, text.String())
		}
	}
	var js bytes.Buffer
	if err := rep.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(js.Bytes(), &back); err != nil || back.Certificate.Subject != rep.Certificate.Subject || !back.Certificate.RenewalOverdue {
		t.Fatalf("JSON round trip: %v (renewalOverdue %v)", err, back.Certificate.RenewalOverdue)
	}

	// Renewals succeeding again: nothing goes dark.
	if err := rec.Update(func(s *State) { s.Renewal.ConsecutiveFailures = 0 }); err != nil {
		t.Fatal(err)
	}
	rep = Collect(cfg, now)
	text.Reset()
	if err := rep.WriteText(&text, now); err != nil {
		t.Fatal(err)
	}
	if rep.Certificate.RenewalOverdue || strings.Contains(text.String(), "Goes dark") {
		t.Errorf("a certificate renewed on time is reported overdue:\n%s", text.String())
	}
}

// TestCollectServing: with serving.enabled, status shows the installed
// serving certificate (file, addresses, issuer) and the agent's last
// serving renewal, or why there is none.
func TestCollectServing(t *testing.T) {
	dir := t.TempDir()
	cfg := &config.NodeConfig{NodeName: "n1", Attestor: "tpm", CacheDir: dir, Serving: config.ServingConfig{Enabled: true}}
	cfg.Default()
	now := time.Now()
	if rep := Collect(cfg, now); rep.Serving != nil || !strings.Contains(rep.ServingError, "no serving certificate at "+cfg.Serving.Path) {
		t.Fatalf("nothing installed: %+v %q", rep.Serving, rep.ServingError)
	}
	ca, err := harness.NewCA("serving-ca")
	if err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM, err := ca.Issue(harness.CertSpec{CommonName: "system:node:n1", Organization: []string{attestor.NodesGroup},
		DNSNames: []string{"n1"}, IPs: []net.IP{net.ParseIP("10.0.0.5")}, Server: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfg.Serving.Path, append(certPEM, keyPEM...), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := NewRecorder(dir).Update(func(s *State) {
		s.ServingRenewal.Last = NewResult(now.Add(-time.Minute), time.Second, errors.New("denied: SANNotMachineAddress"))
		s.ServingRenewal.ConsecutiveFailures = 3
	}); err != nil {
		t.Fatal(err)
	}
	rep := Collect(cfg, now)
	if rep.Serving == nil || rep.Serving.Path != cfg.Serving.Path || len(rep.Serving.DNSNames) != 1 || len(rep.Serving.IPAddresses) != 1 || rep.Serving.IPAddresses[0] != "10.0.0.5" {
		t.Fatalf("serving report %+v (%q)", rep.Serving, rep.ServingError)
	}
	var text bytes.Buffer
	if err := rep.WriteText(&text, now); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Serving certificate:", cfg.Serving.Path, "n1, 10.0.0.5", "CN=serving-ca", "Last serving renewal:", "SANNotMachineAddress", "Serving failures in a row:  3"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("text output lacks %q:\n%s", want, text.String())
		}
	}
}

// TestHealth: status's exit code says whether the node has a usable
// identity (2 when not) and, when it has one, whether something needs
// attention (3) or nothing does (0).
func TestHealth(t *testing.T) {
	usable := func() *CertificateInfo { return &CertificateInfo{Usable: true, TimeToExpiry: "20h0m0s"} }
	for name, tc := range map[string]struct {
		rep  Report
		want Health
		why  string
	}{
		"usable, nothing else":    {rep: Report{Certificate: usable()}, want: Healthy},
		"no certificate":          {rep: Report{CertificateError: "no client certificate in /var/lib/x"}, want: NoIdentity, why: "no client certificate in /var/lib/x"},
		"expired":                 {rep: Report{Certificate: &CertificateInfo{TimeToExpiry: "-1h0m0s"}}, want: NoIdentity, why: "expired"},
		"renewal overdue":         {rep: Report{Certificate: &CertificateInfo{Usable: true, RenewalOverdue: true}}, want: Degraded, why: "renewal overdue"},
		"serving missing":         {rep: Report{Certificate: usable(), ServingError: "no serving certificate at /x"}, want: Degraded, why: "no serving certificate"},
		"serving expired":         {rep: Report{Certificate: usable(), Serving: &CertificateInfo{}}, want: Degraded, why: "serving certificate expired"},
		"stale bundle":            {rep: Report{Certificate: usable(), TrustBundles: []BundleReport{{Path: "/etc/a", Stale: true}}}, want: Degraded, why: "/etc/a stale"},
		"fresh bundle":            {rep: Report{Certificate: usable(), TrustBundles: []BundleReport{{Path: "/etc/a"}}}, want: Healthy},
		"no identity beats stale": {rep: Report{TrustBundles: []BundleReport{{Path: "/etc/a", Stale: true}}}, want: NoIdentity},
	} {
		t.Run(name, func(t *testing.T) {
			got, why := tc.rep.Health()
			if got != tc.want || !strings.Contains(why, tc.why) {
				t.Errorf("Health() = %d, %q; want %d, containing %q", got, why, tc.want, tc.why)
			}
		})
	}
}
