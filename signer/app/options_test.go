package app

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
)

func TestOptionsDefaultsAreValid(t *testing.T) {
	o := NewOptions()
	o.RESTConfig = &rest.Config{Host: "https://127.0.0.1:6443"}
	o.LeaderElectionNamespace = "capi-system"
	if err := o.Complete(); err != nil {
		t.Fatal(err)
	}
	if err := o.Validate(); err != nil {
		t.Fatalf("defaults are invalid: %v", err)
	}
	if !o.LeaderElect || o.MaxClientCertificateLifetime != DefaultMaxClientCertificateLifetime {
		t.Errorf("defaults = %+v", o)
	}
}

func TestOptionsFlagsAndValidateReportsEverything(t *testing.T) {
	o := NewOptions()
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	o.AddFlags(fs)
	err := fs.Parse([]string{
		"--kubeconfig=/nonexistent/kubeconfig",
		"--leader-election-id=",
		"--max-client-certificate-lifetime=1m",
		"--metrics-bind-address=nonsense",
		"--health-probe-bind-address=0",
		"--workers-per-cluster=0",
		"--cluster-recheck-period=1s",
	})
	if err != nil {
		t.Fatal(err)
	}
	if o.MaxClientCertificateLifetime != time.Minute || o.HealthProbeBindAddress != "0" {
		t.Fatalf("flags not applied: %+v", o)
	}
	if err := o.Complete(); err != nil {
		t.Fatal(err)
	}
	err = o.Validate()
	if err == nil {
		t.Fatal("Validate() passed")
	}
	for _, want := range []string{"--kubeconfig", "--leader-election-id", "--leader-election-namespace", "--max-client-certificate-lifetime", "--metrics-bind-address", "--workers-per-cluster", "--cluster-recheck-period"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Validate() does not report %s:\n%v", want, err)
		}
	}
	if strings.Contains(err.Error(), "--health-probe-bind-address") {
		t.Errorf("\"0\" rejected for --health-probe-bind-address: %v", err)
	}
}

func TestVerifiersTable(t *testing.T) {
	o := NewOptions()
	o.LeaderElectionNamespace = "capi-system"
	v, key, err := o.Verifiers(context.Background(), fake.NewClientBuilder().Build())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"insecure", "tpm"} {
		if _, ok := v[p]; !ok {
			t.Errorf("Verifiers() has no %s: %v", p, v)
		}
	}
	if len(v) != 2 {
		t.Errorf("Verifiers() = %v", v)
	}
	if id, k := key.Current(); len(k) < 32 || id != "k1" {
		t.Errorf("Verifiers() challenge key %q is %d bytes, want the controller's first key", id, len(k))
	}
}

func TestDecisionMetricsRegisterTwice(t *testing.T) {
	// Run may be called more than once in a process (tests): registering
	// the counters again must reuse them.
	reg := prometheus.NewRegistry()
	for range 2 {
		m, err := newDecisionMetrics(reg)
		if err != nil {
			t.Fatal(err)
		}
		m.Decision("ns/c", "denied", "SubjectMismatch")
	}
}
