package integration

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2/ktesting"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// runSigner runs the controller in-process against mgmt until the test
// ends; adjust changes its options first.
// unauthorizedListPeriod is how often the controllers the tests run list
// the requests to signer names they do not watch (attestors not
// authorized, refused ones), so that their denials come within a test's
// wait.
const unauthorizedListPeriod = 2 * time.Second

func runSigner(t *testing.T, mgmt *harness.Management, adjust func(*app.Options)) {
	t.Helper()
	o := app.NewOptions()
	o.UnauthorizedListPeriod = unauthorizedListPeriod
	o.RESTConfig = mgmt.AdminConfig
	o.LeaderElectionNamespace = metav1.NamespaceSystem
	o.MetricsBindAddress = "0"
	o.HealthProbeBindAddress = "0"
	o.MaxClientCertificateLifetime = 24 * time.Hour
	o.SkipControllerNameValidation = true
	o.ClusterRecheckPeriod = 10 * time.Second
	if adjust != nil {
		adjust(o)
	}
	runOptions(t, o)
}

// runOptions completes, validates and runs o (either controller command's
// options) in-process until the test ends.
func runOptions(t *testing.T, o interface {
	Complete() error
	Validate() error
	Run(context.Context) error
}) {
	t.Helper()
	if err := o.Complete(); err != nil {
		t.Fatal(err)
	}
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	_, tctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(tctx)
	done := make(chan error, 1)
	go func() { done <- o.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("controller: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("controller did not stop within 30s")
		}
	})
}

// gauge returns the value of the metric name with label cluster=cluster in
// the controller-runtime registry, and whether it is there.
func gauge(t *testing.T, name, cluster string) (float64, bool) {
	t.Helper()
	return labelledValue(t, name, "cluster", cluster)
}

// labelledValue returns the value of the gauge or counter name with label
// label=value in the controller-runtime registry, and whether it is there.
func labelledValue(t *testing.T, name, label, value string) (float64, bool) {
	t.Helper()
	mfs, err := ctrlmetrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if labelValue(m, label) == value {
				if g := m.GetGauge(); g != nil {
					return g.GetValue(), true
				}
				return m.GetCounter().GetValue(), true
			}
		}
	}
	return 0, false
}

func labelValue(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// pollFor polls cond every 100 ms until it holds or timeout passes.
func pollFor(timeout time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %s", timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return nil
}

func parseCerts(t *testing.T, data []byte) []*x509.Certificate {
	t.Helper()
	var out []*x509.Certificate
	for rest := data; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			return out
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, c)
	}
}

// setKubeconfig replaces the kubeconfig in the Secret Cluster API keeps
// for Cluster ns/name.
func setKubeconfig(t *testing.T, mgmt *harness.Management, ns, name string, kubeconfig []byte) {
	t.Helper()
	var s corev1.Secret
	key := types.NamespacedName{Namespace: ns, Name: name + capi.KubeconfigSecretSuffix}
	if err := mgmt.Client.Get(context.Background(), key, &s); err != nil {
		t.Fatal(err)
	}
	s.Data[capi.KubeconfigSecretKey] = kubeconfig
	if err := mgmt.Client.Update(context.Background(), &s); err != nil {
		t.Fatal(err)
	}
}
