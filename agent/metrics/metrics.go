// Package metrics holds the agent's Prometheus metrics and its HTTP server
// (/metrics, /healthz) on a unix socket, socket-activated listeners or a
// TCP address (listen.go). It implements the small metric
// interfaces of agent/daemon and agent/trustbundle, which know nothing of
// the exposition format, and writes the text format itself (see
// exposition.go for why it does not link client_golang).
package metrics

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/agent/daemon"
	"sigs.k8s.io/kubelet-authenticator/agent/trustbundle"
)

const namespace = "kubelet_authenticator_"

// Metrics is the agent's registry.
type Metrics struct {
	families []*family

	client, serving *certMetrics
	attestation     *family
	bundleUpdates   *family
	bundleStale     *family
	bundleUpdated   *family
	bundleCerts     *family
	bundleSynced    *family
	bundleOversized *family
	bundleExcess    *family

	mu     sync.Mutex
	synced map[string]time.Time // by projection
	clock  clock.PassiveClock
}

// certMetrics are the metrics of one certificate the agent renews.
type certMetrics struct {
	expiration, ttl, renewals, renewalDuration *family

	mu       sync.Mutex
	notAfter time.Time
	clock    clock.PassiveClock
}

func newCertMetrics(kind, what string, clk clock.PassiveClock) *certMetrics {
	c := &certMetrics{clock: clk}
	prefix := namespace + kind + "_certificate_"
	c.expiration = newFamily(prefix+"expiration_timestamp_seconds",
		"NotAfter of the current "+what+", in Unix seconds.", "gauge", "")
	c.expiration.with("")
	c.ttl = newFamily(prefix+"ttl_seconds",
		"Seconds until the current "+what+" expires (negative once expired; 0 when there is none).", "gauge", "")
	c.ttl.fn = c.ttlSeconds
	c.renewals = newFamily(prefix+"renewals_total",
		"Renewal attempts of the "+what+" by the agent, by result (success, failure).", "counter", "result")
	for _, r := range []string{"success", "failure"} {
		c.renewals.with(r)
	}
	c.renewalDuration = newFamily(prefix+"renewal_duration_seconds",
		"Duration of a renewal attempt of the "+what+": attestation, CSR, signing and storing.", "histogram", "", exponentialBuckets(0.01, 2, 14)...)
	c.renewalDuration.with("")
	return c
}

func (c *certMetrics) families() []*family {
	return []*family{c.expiration, c.ttl, c.renewals, c.renewalDuration}
}

func (c *certMetrics) ttlSeconds() float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.notAfter.IsZero() {
		return 0
	}
	return c.notAfter.Sub(c.clock.Now()).Seconds()
}

// Set implements daemon.Gauge for the expiration.
func (c *certMetrics) Set(v float64) {
	c.expiration.with("").Set(v)
	c.mu.Lock()
	c.notAfter = time.Unix(int64(v), 0)
	c.mu.Unlock()
}

func (c *certMetrics) daemon() daemon.Metrics {
	return daemon.Metrics{
		CertificateExpiration: c,
		RenewalSuccess:        c.renewals.with("success"),
		RenewalFailure:        c.renewals.with("failure"),
		RenewalDuration:       c.renewalDuration.with(""),
	}
}

// New returns the agent's metrics, with the process and Go runtime ones.
func New() *Metrics {
	m := &Metrics{clock: clock.RealClock{}, synced: map[string]time.Time{}}
	m.client = newCertMetrics("client", "kubelet client certificate", m.clock)
	m.serving = newCertMetrics("serving", "kubelet serving certificate (serving.enabled)", m.clock)
	m.attestation = newFamily(namespace+"attestation_duration_seconds",
		"Duration of producing attestation evidence (and answering a challenge), by result.", "histogram", "result", exponentialBuckets(0.001, 2, 15)...)
	m.bundleUpdates = newFamily(namespace+"trust_bundle_updates_total",
		"Times a projected trust bundle file was rewritten, by projection path.", "counter", "path")
	m.bundleStale = newFamily(namespace+"trust_bundle_stale",
		"1 when a projected trust bundle keeps content its source no longer provides (gone, invalid, unreadable or not read yet), else 0.", "gauge", "path")
	m.bundleUpdated = newFamily(namespace+"trust_bundle_last_update_timestamp_seconds",
		"When a projected trust bundle file last changed, in Unix seconds.", "gauge", "path")
	m.bundleCerts = newFamily(namespace+"trust_bundle_certificates",
		"Certificates in a projected trust bundle file.", "gauge", "path")
	m.bundleSynced = newFamily(namespace+"trust_bundle_last_sync_timestamp_seconds",
		"When a projected trust bundle file was last confirmed to match its source, in Unix seconds.", "gauge", "path")
	m.bundleOversized = newFamily(namespace+"trust_bundle_oversized_objects_total",
		"ClusterTrustBundles kept out of a projection's watch cache because their trust bundle alone is over agent.maxTrustBundleBytes, "+
			"by projection path (once per object version).",
		"counter", "path")
	m.bundleExcess = newFamily(namespace+"trust_bundle_excess_objects_total",
		"ClusterTrustBundles kept out of a projection's watch cache because it already holds agent.maxTrustBundles objects, "+
			"by projection path (once per object version).",
		"counter", "path")
	syncAge := newFamily(namespace+"trust_bundle_sync_age_seconds",
		"Seconds since a projected trust bundle file was last confirmed to match its source: how stale it may be.", "gauge", "path")
	syncAge.fnVec = m.syncAges
	m.families = append(append(append(m.client.families(), m.serving.families()...), m.attestation,
		m.bundleUpdates, m.bundleStale, m.bundleUpdated, m.bundleCerts, m.bundleSynced, m.bundleOversized, m.bundleExcess, syncAge), processFamilies(time.Now())...)
	return m
}

// Renewal returns the client certificate renewal loop's metrics.
func (m *Metrics) Renewal() daemon.Metrics { return m.client.daemon() }

// ServingRenewal returns the serving certificate renewal loop's metrics.
func (m *Metrics) ServingRenewal() daemon.Metrics { return m.serving.daemon() }

// ObserveAttestation records one attestation call (see daemon.Instrument).
func (m *Metrics) ObserveAttestation(d time.Duration, err error) {
	result := "success"
	if err != nil {
		result = "failure"
	}
	m.attestation.with(result).Observe(d.Seconds())
}

// Updated implements trustbundle.Metrics.
func (m *Metrics) Updated(projection string, certificates int, at time.Time) {
	m.bundleUpdates.with(projection).Inc()
	m.bundleUpdated.with(projection).Set(float64(at.UnixNano()) / 1e9)
	m.bundleCerts.with(projection).Set(float64(certificates))
}

// Synced implements trustbundle.Metrics.
func (m *Metrics) Synced(projection string, at time.Time) {
	m.bundleSynced.with(projection).Set(float64(at.UnixNano()) / 1e9)
	m.mu.Lock()
	m.synced[projection] = at
	m.mu.Unlock()
}

func (m *Metrics) syncAges() map[string]float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.clock.Now()
	out := make(map[string]float64, len(m.synced))
	for p, at := range m.synced {
		out[p] = now.Sub(at).Seconds()
	}
	return out
}

// Rejected implements trustbundle.Metrics.
func (m *Metrics) Rejected(projection, reason string) {
	if reason == trustbundle.RejectedTooLarge {
		m.bundleOversized.with(projection).Inc()
		return
	}
	m.bundleExcess.with(projection).Inc()
}

// Stale implements trustbundle.Metrics.
func (m *Metrics) Stale(projection string, stale bool) {
	v := 0.0
	if stale {
		v = 1
	}
	m.bundleStale.with(projection).Set(v)
	m.bundleUpdates.with(projection)
	m.bundleOversized.with(projection)
	m.bundleExcess.with(projection)
}

// Write writes every metric in the Prometheus text exposition format.
func (m *Metrics) Write(w io.Writer) error { return writeAll(w, m.families) }

// Handler serves /metrics and /healthz; healthz returns nil when healthy.
func (m *Metrics) Handler(healthz func() error) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_ = m.Write(w)
	})
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := healthz(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
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
