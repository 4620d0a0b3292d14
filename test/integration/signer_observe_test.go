package integration

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestSignerObservable checks what an operator of the management cluster
// sees of the signer's decisions: an Event on the Machine for an approval
// (Normal) and for a denial (Warning), a Warning on the Cluster for a
// request no Machine accounts for, and the CSRs seen and signed and the
// verification latency in the metrics.
func TestSignerObservable(t *testing.T) {
	e := startSigner(t)
	ctx := context.Background()
	cluster := signerNS + "/" + signerCluster
	before := map[string]float64{
		"seen":     counter(t, "kubelet_authenticator_signer_csrs_seen_total", map[string]string{"cluster": cluster}),
		"signed":   counter(t, "kubelet_authenticator_signer_csrs_signed_total", map[string]string{"cluster": cluster, "attestor": insecure.Name}),
		"verified": histogramCount(t, "kubelet_authenticator_signer_verification_duration_seconds", map[string]string{"attestor": insecure.Name, "result": engine.VerifyResultVerified}),
		"denied":   histogramCount(t, "kubelet_authenticator_signer_verification_duration_seconds", map[string]string{"attestor": insecure.Name, "result": engine.VerifyResultDenied}),
	}

	e.mgmt.CreateMachine(t, signerNS, signerCluster, "worker-obs", "test:///obs", true)
	good, _ := signertest.Request{NodeName: "worker-obs", ProviderID: "test:///obs"}.Build(t)
	other, err := json.Marshal(insecure.Evidence{Version: insecure.VersionV1, ProviderID: "test:///elsewhere"})
	if err != nil {
		t.Fatal(err)
	}
	bad, _ := signertest.Request{NodeName: "worker-obs", ProviderID: "test:///obs", Evidence: other}.Build(t)
	ghost, _ := signertest.Request{NodeName: "ghost", ProviderID: "test:///ghost"}.Build(t)
	e.file(t, signertest.CSR("obs-good", good))
	e.file(t, signertest.CSR("obs-bad", bad))
	e.file(t, signertest.CSR("obs-ghost", ghost))
	e.expectIssued(t, "obs-good", "worker-obs", "test:///obs", 24*time.Hour)
	e.expectDenied(t, "obs-bad", attestor.ReasonAttestedProviderIDMismatch)
	e.expectDenied(t, "obs-ghost", attestor.ReasonMachineNotFound)

	t.Run("Events on the Machine and the Cluster", func(t *testing.T) {
		for _, want := range []struct{ kind, name, typ, reason, csr string }{
			{"Machine", "worker-obs", corev1.EventTypeWarning, attestor.ReasonAttestedProviderIDMismatch, "obs-bad"},
			{"Cluster", signerCluster, corev1.EventTypeWarning, attestor.ReasonMachineNotFound, "obs-ghost"},
		} {
			var got *corev1.Event
			harness.WaitFor(t, 30*time.Second, func() (bool, error) {
				list, err := e.mgmt.ControlPlane.Client.CoreV1().Events(signerNS).List(ctx, metav1.ListOptions{
					FieldSelector: fields.Set{"involvedObject.kind": want.kind, "involvedObject.name": want.name, "reason": want.reason}.String(),
				})
				if err != nil {
					return false, err
				}
				for i := range list.Items {
					if ev := &list.Items[i]; containsAll(ev.Message, want.csr, cluster) {
						got = ev
						return true, nil
					}
				}
				return false, nil
			})
			if got.Type != want.typ || got.Source.Component != "node-attestation-controller" || got.InvolvedObject.UID == "" {
				t.Errorf("Event %s on %s %s: type %s, source %s, UID %q; want type %s from node-attestation-controller",
					want.reason, want.kind, want.name, got.Type, got.Source.Component, got.InvolvedObject.UID, want.typ)
			}
			t.Logf("%s %s/%s: %s %s: %s", want.kind, signerNS, want.name, got.Type, got.Reason, got.Message)
		}
		// An approval is no Event: the request's condition says it.
		list, err := e.mgmt.ControlPlane.Client.CoreV1().Events(signerNS).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range list.Items {
			if strings.Contains(ev.Message, "obs-good") {
				t.Errorf("Event %s %s on %s %s for the approved request: %s", ev.Type, ev.Reason, ev.InvolvedObject.Kind, ev.InvolvedObject.Name, ev.Message)
			}
		}
	})

	t.Run("metrics", func(t *testing.T) {
		for _, c := range []struct {
			name string
			got  float64
			min  float64
		}{
			{"seen", counter(t, "kubelet_authenticator_signer_csrs_seen_total", map[string]string{"cluster": cluster, "signer": attestor.ClientSignerName(insecure.Name)}), 3},
			{"signed", counter(t, "kubelet_authenticator_signer_csrs_signed_total", map[string]string{"cluster": cluster, "attestor": insecure.Name}), 1},
			{"verified", histogramCount(t, "kubelet_authenticator_signer_verification_duration_seconds", map[string]string{"attestor": insecure.Name, "result": engine.VerifyResultVerified}), 1},
			{"denied", histogramCount(t, "kubelet_authenticator_signer_verification_duration_seconds", map[string]string{"attestor": insecure.Name, "result": engine.VerifyResultDenied}), 1},
		} {
			if d := c.got - before[c.name]; d < c.min {
				t.Errorf("%s went up by %v, want at least %v", c.name, d, c.min)
			}
		}
	})
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// counter sums the counters name whose labels include labels.
func counter(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	var sum float64
	for _, m := range metricsOf(t, name, labels) {
		sum += m.GetCounter().GetValue()
	}
	return sum
}

// histogramCount sums the sample counts of the histograms name whose
// labels include labels.
func histogramCount(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	var sum float64
	for _, m := range metricsOf(t, name, labels) {
		sum += float64(m.GetHistogram().GetSampleCount())
	}
	return sum
}

// metricsOf returns the samples of metric name in the controller-runtime
// registry whose labels include labels.
func metricsOf(t *testing.T, name string, labels map[string]string) []*dto.Metric {
	t.Helper()
	mfs, err := ctrlmetrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []*dto.Metric
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for k, v := range labels {
				if labelValue(m, k) != v {
					continue next
				}
			}
			out = append(out, m)
		}
	}
	return out
}
