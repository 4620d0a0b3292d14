package app

import (
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"
)

// csrMetrics counts the CSRs the controller sees and the certificates it
// signs, and observes how long verification takes. It implements
// controller.SeenMetrics, SignedMetrics and VerificationMetrics, and counts
// pod certificate decisions (capi.PodMetrics).
type csrMetrics struct {
	seen, signed, pods *prometheus.CounterVec
	verification       *prometheus.HistogramVec
}

func newCSRMetrics(reg prometheus.Registerer) (*csrMetrics, error) {
	seen, err := registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "kubelet_authenticator",
		Subsystem: "signer",
		Name:      "csrs_seen_total",
		Help: "Pending CertificateSigningRequests of the controller's signer names it saw, " +
			"by workload cluster and signer name (once per CSR and controller start).",
	}, []string{"cluster", "signer"}))
	if err != nil {
		return nil, err
	}
	signed, err := registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "kubelet_authenticator",
		Subsystem: "signer",
		Name:      "csrs_signed_total",
		Help:      "Kubelet client certificates issued, by workload cluster and attestor.",
	}, []string{"cluster", "attestor"}))
	if err != nil {
		return nil, err
	}
	verification, err := registerOrReuse(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "kubelet_authenticator",
		Subsystem: "signer",
		Name:      "verification_duration_seconds",
		Help:      "How long an attestor's verifier took to check a request's evidence, by attestor and result (verified, challenged, denied, error).",
		// 0.5 ms (a local check) to about 12 s (a cloud API that is slow to answer).
		Buckets: prometheus.ExponentialBuckets(0.0005, 2.5, 12),
	}, []string{"attestor", "result"}))
	if err != nil {
		return nil, err
	}
	pods, err := registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "kubelet_authenticator",
		Subsystem: "signer",
		Name:      "pod_certificate_decisions_total",
		Help:      "Decisions on PodCertificateRequests of the pod signer, by workload cluster, decision (issued, denied, retried) and reason.",
	}, []string{"cluster", "decision", "reason"}))
	if err != nil {
		return nil, err
	}
	return &csrMetrics{seen: seen, signed: signed, pods: pods, verification: verification}, nil
}

// PodDecision implements capi.PodMetrics.
func (m *csrMetrics) PodDecision(cluster, decision, reason string) {
	m.pods.WithLabelValues(cluster, decision, reason).Inc()
}

// Seen implements controller.SeenMetrics.
func (m *csrMetrics) Seen(cluster, signerName string) {
	m.seen.WithLabelValues(cluster, signerName).Inc()
}

// Signed implements controller.SignedMetrics.
func (m *csrMetrics) Signed(cluster, provider string) {
	m.signed.WithLabelValues(cluster, provider).Inc()
}

// Verified implements controller.VerificationMetrics.
func (m *csrMetrics) Verified(provider, result string, took time.Duration) {
	m.verification.WithLabelValues(provider, result).Observe(took.Seconds())
}

// registerOrReuse registers c with reg, or returns the collector a previous
// Run in this process (tests) registered under the same name.
func registerOrReuse[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	if err == nil {
		return c, nil
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	var zero C
	return zero, fmt.Errorf("unable to register metrics: %w", err)
}

// Limits of the decision Events (client-go's event correlator): per
// involved object and event type, a burst of eventBurst, then one every
// 1/eventQPS seconds; similar Events (same reason) are aggregated after 10
// within 10 minutes. A node that keeps filing bad requests cannot flood the
// management cluster.
const (
	eventBurst = 25
	eventQPS   = 1. / 300.
	// eventClientQPS and eventClientBurst bound the Event writes, on a
	// client of their own so that they never slow the controller's reads.
	eventClientQPS   = 10
	eventClientBurst = 25
)

// newEventRecorder returns a recorder of Events in the management cluster,
// reported by component node-attestation-controller, and a function that
// stops it.
func newEventRecorder(cfg *rest.Config, scheme *runtime.Scheme) (record.EventRecorder, func(), error) {
	cfg = rest.CopyConfig(cfg)
	cfg.QPS, cfg.Burst = eventClientQPS, eventClientBurst
	// Protobuf, as kube-controller-manager writes its Events: encoding an
	// Event and decoding the answer in JSON cost the controller, and the
	// API server, several times what protobuf does. The Event is the same.
	cfg.ContentType = runtime.ContentTypeProtobuf
	cfg.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("unable to create the event client: %w", err)
	}
	b := record.NewBroadcaster(record.WithCorrelatorOptions(record.CorrelatorOptions{BurstSize: eventBurst, QPS: eventQPS}))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: cs.CoreV1().Events("")})
	return b.NewRecorder(scheme, corev1.EventSource{Component: "node-attestation-controller"}), b.Shutdown, nil
}
