// Package metrics holds the agent's Prometheus metrics and its localhost
// HTTP server (/metrics, /healthz). It implements the small metric
// interfaces of agent/daemon and agent/trustbundle, which do not import
// Prometheus themselves.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"sigs.k8s.io/kubelet-authenticator/agent/daemon"
)

const namespace = "kubelet_authenticator"

// Metrics is the agent's registry.
type Metrics struct {
	Registry *prometheus.Registry

	expiration      prometheus.Gauge
	renewals        *prometheus.CounterVec
	renewalDuration prometheus.Histogram
	attestation     *prometheus.HistogramVec
	bundleUpdates   *prometheus.CounterVec
	bundleStale     *prometheus.GaugeVec
	bundleUpdated   *prometheus.GaugeVec
	bundleCerts     *prometheus.GaugeVec

	mu       sync.Mutex
	notAfter time.Time
	now      func() time.Time
}

// New registers the agent's metrics (and the Go and process collectors) in
// a new registry.
func New() *Metrics {
	m := &Metrics{Registry: prometheus.NewRegistry(), now: time.Now}
	m.expiration = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: namespace, Name: "client_certificate_expiration_timestamp_seconds",
		Help: "NotAfter of the current kubelet client certificate, in Unix seconds.",
	})
	ttl := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: namespace, Name: "client_certificate_ttl_seconds",
		Help: "Seconds until the current kubelet client certificate expires (negative once expired; 0 when there is none).",
	}, m.ttl)
	m.renewals = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Name: "client_certificate_renewals_total",
		Help: "Client certificate renewal attempts by the agent, by result (success, failure).",
	}, []string{"result"})
	m.renewalDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: namespace, Name: "client_certificate_renewal_duration_seconds",
		Help:    "Duration of a renewal attempt: attestation, CSR, signing and storing.",
		Buckets: prometheus.ExponentialBuckets(0.01, 2, 14),
	})
	m.attestation = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Name: "attestation_duration_seconds",
		Help:    "Duration of producing attestation evidence (and answering a challenge), by result.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 15),
	}, []string{"result"})
	m.bundleUpdates = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Name: "trust_bundle_updates_total",
		Help: "Times a projected trust bundle file was rewritten, by projection path.",
	}, []string{"path"})
	m.bundleStale = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: namespace, Name: "trust_bundle_stale",
		Help: "1 when a projected trust bundle keeps content its source no longer provides (gone, invalid, unreadable or not read yet), else 0.",
	}, []string{"path"})
	m.bundleUpdated = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: namespace, Name: "trust_bundle_last_update_timestamp_seconds",
		Help: "When a projected trust bundle file last changed, in Unix seconds.",
	}, []string{"path"})
	m.bundleCerts = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: namespace, Name: "trust_bundle_certificates",
		Help: "Certificates in a projected trust bundle file.",
	}, []string{"path"})
	m.Registry.MustRegister(m.expiration, ttl, m.renewals, m.renewalDuration, m.attestation,
		m.bundleUpdates, m.bundleStale, m.bundleUpdated, m.bundleCerts,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	for _, r := range []string{"success", "failure"} {
		m.renewals.WithLabelValues(r)
	}
	return m
}

func (m *Metrics) ttl() float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.notAfter.IsZero() {
		return 0
	}
	return m.notAfter.Sub(m.now()).Seconds()
}

type expirationGauge struct{ m *Metrics }

func (g expirationGauge) Set(v float64) {
	g.m.expiration.Set(v)
	g.m.mu.Lock()
	g.m.notAfter = time.Unix(int64(v), 0)
	g.m.mu.Unlock()
}

// Renewal returns the renewal loop's metrics.
func (m *Metrics) Renewal() daemon.Metrics {
	return daemon.Metrics{
		CertificateExpiration: expirationGauge{m},
		RenewalSuccess:        m.renewals.WithLabelValues("success"),
		RenewalFailure:        m.renewals.WithLabelValues("failure"),
		RenewalDuration:       m.renewalDuration,
	}
}

// ObserveAttestation records one attestation call (see daemon.Instrument).
func (m *Metrics) ObserveAttestation(d time.Duration, err error) {
	result := "success"
	if err != nil {
		result = "failure"
	}
	m.attestation.WithLabelValues(result).Observe(d.Seconds())
}

// Updated implements trustbundle.Metrics.
func (m *Metrics) Updated(projection string, certificates int, at time.Time) {
	m.bundleUpdates.WithLabelValues(projection).Inc()
	m.bundleUpdated.WithLabelValues(projection).Set(float64(at.UnixNano()) / 1e9)
	m.bundleCerts.WithLabelValues(projection).Set(float64(certificates))
}

// Stale implements trustbundle.Metrics.
func (m *Metrics) Stale(projection string, stale bool) {
	v := 0.0
	if stale {
		v = 1
	}
	m.bundleStale.WithLabelValues(projection).Set(v)
	m.bundleUpdates.WithLabelValues(projection)
}

// Handler serves /metrics and /healthz; healthz returns nil when healthy.
func (m *Metrics) Handler(healthz func() error) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{Registry: m.Registry}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := healthz(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}

// Listen opens addr for Serve.
func Listen(addr string) (net.Listener, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("unable to listen on %s: %w", addr, err)
	}
	return l, nil
}

// Serve serves h on l until ctx is done.
func Serve(ctx context.Context, l net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics server: %w", err)
	}
	return nil
}
