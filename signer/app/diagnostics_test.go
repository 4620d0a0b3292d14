package app

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	"k8s.io/client-go/rest"
)

// TestDiagnosticsFlags: the logging and metrics flags parse, and Validate
// reports what cannot work together (per-file verbosity with JSON, a
// certificate directory without its files or with plain HTTP).
func TestDiagnosticsFlags(t *testing.T) {
	certDir := t.TempDir()
	for _, f := range []string{"tls.crt", "tls.key"} {
		if err := os.WriteFile(filepath.Join(certDir, f), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		name string
		args []string
		want []string // substrings of Validate's error; none: valid
	}{
		{"defaults", nil, nil},
		{"json, verbosity", []string{"--logging-format=json", "-v=4"}, nil},
		{"text, vmodule", []string{"--vmodule=engine=4"}, nil},
		{"json with vmodule", []string{"--logging-format=json", "--vmodule=engine=4"}, []string{"vmodule"}},
		{"unknown format", []string{"--logging-format=xml"}, []string{"format"}},
		{"certificate directory", []string{"--metrics-cert-dir=" + certDir}, nil},
		{"certificate directory without files", []string{"--metrics-cert-dir=" + t.TempDir()}, []string{"tls.crt", "tls.key"}},
		{"certificate directory over plain HTTP", []string{"--insecure-diagnostics", "--metrics-cert-dir=" + certDir}, []string{"--insecure-diagnostics"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			o := NewOptions()
			o.RESTConfig = &rest.Config{Host: "https://127.0.0.1:6443"}
			o.LeaderElectionNamespace = "capi-system"
			fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
			o.AddFlags(fs)
			if err := fs.Parse(c.args); err != nil {
				t.Fatal(err)
			}
			if err := o.Complete(); err != nil {
				t.Fatal(err)
			}
			err := o.Validate()
			if len(c.want) == 0 {
				if err != nil {
					t.Fatalf("Validate(): %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("Validate() passed")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Validate() does not mention %s: %v", w, err)
				}
			}
		})
	}
}

// TestMetricsServerIsSecuredByDefault: HTTPS with the API server's
// authentication and authorization unless --insecure-diagnostics.
func TestMetricsServerIsSecuredByDefault(t *testing.T) {
	o := NewOptions()
	if o.MetricsBindAddress != DefaultMetricsBindAddress {
		t.Errorf("default metrics address %s", o.MetricsBindAddress)
	}
	s := o.metricsServer()
	if !s.SecureServing || s.FilterProvider == nil {
		t.Errorf("default metrics server %+v: want HTTPS with authentication and authorization", s)
	}
	o.InsecureDiagnostics = true
	if s := o.metricsServer(); s.SecureServing || s.FilterProvider != nil {
		t.Errorf("--insecure-diagnostics metrics server %+v: want plain HTTP", s)
	}
}
