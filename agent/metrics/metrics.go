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

	"sigs.k8s.io/kubelet-authenticator/agent/daemon"
)

const namespace = "kubelet_authenticator_"

// Metrics is the agent's registry.
type Metrics struct {
	families []*family

	expiration      *family
	renewals        *family
	renewalDuration *family
	attestation     *family
	bundleUpdates   *family
	bundleStale     *family
	bundleUpdated   *family
	bundleCerts     *family
	bundleSynced    *family

	mu       sync.Mutex
	notAfter time.Time
	synced   map[string]time.Time // by projection
	now      func() time.Time
}

// New returns the agent's metrics, with the process and Go runtime ones.
func New() *Metrics {
	m := &Metrics{now: time.Now, synced: map[string]time.Time{}}
	m.expiration = newFamily(namespace+"client_certificate_expiration_timestamp_seconds",
		"NotAfter of the current kubelet client certificate, in Unix seconds.", "gauge", "")
	m.expiration.with("")
	ttl := newFamily(namespace+"client_certificate_ttl_seconds",
		"Seconds until the current kubelet client certificate expires (negative once expired; 0 when there is none).", "gauge", "")
	ttl.fn = m.ttl
	m.renewals = newFamily(namespace+"client_certificate_renewals_total",
		"Client certificate renewal attempts by the agent, by result (success, failure).", "counter", "result")
	m.renewalDuration = newFamily(namespace+"client_certificate_renewal_duration_seconds",
		"Duration of a renewal attempt: attestation, CSR, signing and storing.", "histogram", "", exponentialBuckets(0.01, 2, 14)...)
	m.renewalDuration.with("")
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
	syncAge := newFamily(namespace+"trust_bundle_sync_age_seconds",
		"Seconds since a projected trust bundle file was last confirmed to match its source: how stale it may be.", "gauge", "path")
	syncAge.fnVec = m.syncAges
	m.families = append([]*family{m.expiration, ttl, m.renewals, m.renewalDuration, m.attestation,
		m.bundleUpdates, m.bundleStale, m.bundleUpdated, m.bundleCerts, m.bundleSynced, syncAge}, processFamilies(time.Now())...)
	for _, r := range []string{"success", "failure"} {
		m.renewals.with(r)
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
	g.m.expiration.with("").Set(v)
	g.m.mu.Lock()
	g.m.notAfter = time.Unix(int64(v), 0)
	g.m.mu.Unlock()
}

// Renewal returns the renewal loop's metrics.
func (m *Metrics) Renewal() daemon.Metrics {
	return daemon.Metrics{
		CertificateExpiration: expirationGauge{m},
		RenewalSuccess:        m.renewals.with("success"),
		RenewalFailure:        m.renewals.with("failure"),
		RenewalDuration:       m.renewalDuration.with(""),
	}
}

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
	now := m.now()
	out := make(map[string]float64, len(m.synced))
	for p, at := range m.synced {
		out[p] = now.Sub(at).Seconds()
	}
	return out
}

// Stale implements trustbundle.Metrics.
func (m *Metrics) Stale(projection string, stale bool) {
	v := 0.0
	if stale {
		v = 1
	}
	m.bundleStale.with(projection).Set(v)
	m.bundleUpdates.with(projection)
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
