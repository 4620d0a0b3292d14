package metrics

import (
	"bytes"
	"errors"
	"net/http/httptest"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// TestExposition checks what /metrics serves with Prometheus's own parser:
// every family parses, with its type, and the values are the ones recorded,
// including a histogram's cumulative buckets and a label value that needs
// escaping.
func TestExposition(t *testing.T) {
	m := New()
	r := m.Renewal()
	r.RenewalSuccess.Inc()
	r.RenewalSuccess.Inc()
	r.RenewalFailure.Inc()
	r.RenewalDuration.Observe(0.015)
	r.RenewalDuration.Observe(100)
	r.CertificateExpiration.Set(float64(time.Now().Add(time.Hour).Unix()))
	m.ObserveAttestation(3*time.Millisecond, nil)
	m.ObserveAttestation(time.Second, errors.New("no"))
	path := "/etc/kubernetes/trust-bundles/\"odd\"\\dir/ca.crt"
	m.Updated(path, 3, time.Unix(1_800_000_000, 0))
	m.Stale(path, true)
	m.Synced(path, time.Now().Add(-time.Minute))

	rec := httptest.NewRecorder()
	m.Handler(func() error { return nil }).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if ct := rec.Header().Get("Content-Type"); ct != "text/plain; version=0.0.4; charset=utf-8" {
		t.Errorf("Content-Type %q", ct)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(rec.Body.Bytes()))
	if err != nil {
		t.Fatalf("not valid exposition: %v\n%s", err, rec.Body)
	}
	value := func(name, label, labelValue string) *dto.Metric {
		t.Helper()
		f, ok := fams[name]
		if !ok {
			t.Fatalf("no %s in\n%s", name, rec.Body)
		}
		for _, mt := range f.Metric {
			if label == "" {
				return mt
			}
			for _, l := range mt.Label {
				if l.GetName() == label && l.GetValue() == labelValue {
					return mt
				}
			}
		}
		t.Fatalf("no %s{%s=%q}", name, label, labelValue)
		return nil
	}
	if v := value("kubelet_authenticator_client_certificate_renewals_total", "result", "success").GetCounter().GetValue(); v != 2 {
		t.Errorf("renewals success = %v", v)
	}
	if v := value("kubelet_authenticator_client_certificate_renewals_total", "result", "failure").GetCounter().GetValue(); v != 1 {
		t.Errorf("renewals failure = %v", v)
	}
	h := value("kubelet_authenticator_client_certificate_renewal_duration_seconds", "", "").GetHistogram()
	if h.GetSampleCount() != 2 || h.GetSampleSum() != 100.015 {
		t.Errorf("renewal duration count %d sum %v", h.GetSampleCount(), h.GetSampleSum())
	}
	for _, b := range h.Bucket {
		want := uint64(0)
		switch {
		case b.GetUpperBound() >= 100:
			want = 2
		case b.GetUpperBound() >= 0.015:
			want = 1
		}
		if b.GetCumulativeCount() != want {
			t.Errorf("bucket le=%v: %d, want %d", b.GetUpperBound(), b.GetCumulativeCount(), want)
		}
	}
	if c := value("kubelet_authenticator_attestation_duration_seconds", "result", "failure").GetHistogram().GetSampleCount(); c != 1 {
		t.Errorf("attestation failures %d", c)
	}
	if ttl := value("kubelet_authenticator_client_certificate_ttl_seconds", "", "").GetGauge().GetValue(); ttl < 3500 || ttl > 3600 {
		t.Errorf("ttl %v", ttl)
	}
	if v := value("kubelet_authenticator_trust_bundle_stale", "path", path).GetGauge().GetValue(); v != 1 {
		t.Errorf("stale = %v", v)
	}
	if v := value("kubelet_authenticator_trust_bundle_certificates", "path", path).GetGauge().GetValue(); v != 3 {
		t.Errorf("certificates = %v", v)
	}
	if v := value("kubelet_authenticator_trust_bundle_last_update_timestamp_seconds", "path", path).GetGauge().GetValue(); v != 1_800_000_000 {
		t.Errorf("last update = %v", v)
	}
	if age := value("kubelet_authenticator_trust_bundle_sync_age_seconds", "path", path).GetGauge().GetValue(); age < 60 || age > 70 {
		t.Errorf("sync age %v, want about 60", age)
	}
	for _, name := range []string{"process_resident_memory_bytes", "process_start_time_seconds", "go_goroutines"} {
		if v := value(name, "", "").GetGauge().GetValue(); v <= 0 {
			t.Errorf("%s = %v", name, v)
		}
	}
	if fams["process_cpu_seconds_total"].GetType() != dto.MetricType_COUNTER {
		t.Error("process_cpu_seconds_total is not a counter")
	}
}

// TestServingMetrics: the serving certificate's renewals and expiry are
// families of their own, apart from the client certificate's.
func TestServingMetrics(t *testing.T) {
	m := New()
	s := m.ServingRenewal()
	s.RenewalFailure.Inc()
	s.CertificateExpiration.Set(float64(time.Now().Add(time.Hour).Unix()))
	m.Renewal().RenewalSuccess.Inc()
	var buf bytes.Buffer
	if err := m.Write(&buf); err != nil {
		t.Fatal(err)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(buf.Bytes()))
	if err != nil {
		t.Fatalf("not valid exposition: %v\n%s", err, buf.String())
	}
	count := func(name, result string) float64 {
		t.Helper()
		for _, mt := range fams[name].GetMetric() {
			for _, l := range mt.Label {
				if l.GetName() == "result" && l.GetValue() == result {
					return mt.GetCounter().GetValue()
				}
			}
		}
		t.Fatalf("no %s{result=%q}", name, result)
		return 0
	}
	if count("kubelet_authenticator_serving_certificate_renewals_total", "failure") != 1 || count("kubelet_authenticator_serving_certificate_renewals_total", "success") != 0 {
		t.Error("serving renewals not counted apart")
	}
	if count("kubelet_authenticator_client_certificate_renewals_total", "success") != 1 || count("kubelet_authenticator_client_certificate_renewals_total", "failure") != 0 {
		t.Error("client renewals not counted apart")
	}
	ttl := fams["kubelet_authenticator_serving_certificate_ttl_seconds"].GetMetric()[0].GetGauge().GetValue()
	if ttl < 3500 || ttl > 3600 {
		t.Errorf("serving TTL %v, want about an hour", ttl)
	}
	if v := fams["kubelet_authenticator_client_certificate_ttl_seconds"].GetMetric()[0].GetGauge().GetValue(); v != 0 {
		t.Errorf("client TTL %v with no client certificate", v)
	}
}
