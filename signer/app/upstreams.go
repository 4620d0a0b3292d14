package app

import (
	"bytes"
	"context"
	"fmt"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"sigs.k8s.io/kubelet-authenticator/attestor/tlsconfig"
)

// upstreams is the live outbound configuration (proxy, securityProfile,
// trustedCA) of every upstream the cloud verifiers reach, by section of the
// attestor configuration (providers.AWSSTSTLS...). The verifiers' clients
// follow it; reloadUpstreams keeps it current.
type upstreams struct {
	live    map[string]*tlsconfig.Upstream
	metrics *upstreamMetrics // nil: not reported

	// rest is the attestor configuration the verifiers were built from,
	// without its tls blocks (AttestorConfig.withoutTLS).
	rest []byte
	// reported is, by section, the last error logged ("" when none), and
	// restReported the last changed rest logged: a problem is logged when
	// it appears or changes, not at every read.
	reported     map[string]string
	restReported []byte
}

func (o *Options) newUpstreams() (*upstreams, error) {
	u := &upstreams{live: map[string]*tlsconfig.Upstream{}, reported: map[string]string{}}
	if o.attestorConfig != nil {
		rest, err := o.attestorConfig.withoutTLS()
		if err != nil {
			return nil, fmt.Errorf("unable to serialize the attestor configuration: %w", err)
		}
		u.rest = rest
	}
	return u, nil
}

// add makes the live configuration of section from what resolve returns,
// and returns it bound to it (tlsconfig.Config.WithUpstream).
func (u *upstreams) add(section string, resolve func() (*tlsconfig.Config, error)) (*tlsconfig.Config, error) {
	t, err := resolve()
	if err != nil {
		return nil, err
	}
	live, err := tlsconfig.NewUpstream(t)
	if err != nil {
		return nil, err
	}
	u.live[section] = live
	return t.WithUpstream(live), nil
}

// keepUpstreamsCurrent reloads u every --upstream-reload-interval until ctx
// ends, reporting in the controller's metrics.
func (o *Options) keepUpstreamsCurrent(ctx context.Context, c client.Client, u *upstreams) error {
	if len(u.live) == 0 || o.UpstreamReloadInterval <= 0 {
		return nil
	}
	m, err := newUpstreamMetrics(ctrlmetrics.Registry)
	if err != nil {
		return err
	}
	u.metrics = m
	go wait.UntilWithContext(ctx, func(ctx context.Context) { o.reloadUpstreams(ctx, c, u) }, o.UpstreamReloadInterval)
	return nil
}

// reloadUpstreams reads the attestor configuration file again with the
// loader the start used (LoadAttestorConfig, Validate), resolves each
// upstream's tls block (trustedCA ConfigMap through c, file by
// tlsconfig.Upstream.Set) and applies what changed to new connections. An
// upstream whose new settings do not load keeps its last good ones; that
// is logged once per distinct problem and shown by the metric
// kubelet_authenticator_signer_upstream_config_failing. Changes outside
// the tls blocks (allowlists, roots, a provider added or removed) are
// logged as needing a restart and not applied.
func (o *Options) reloadUpstreams(ctx context.Context, c client.Client, u *upstreams) {
	logger := klog.FromContext(ctx)
	cfg, err := LoadAttestorConfig(o.AttestorConfigFile)
	if err == nil {
		err = cfg.Validate()
	}
	if err != nil {
		err = fmt.Errorf("--attestor-config %s: %w", o.AttestorConfigFile, err)
		for section := range u.live {
			u.failed(logger, section, err)
		}
		return
	}
	fields := cfg.tlsFields()
	for section, live := range u.live {
		f, ok := fields[section]
		if !ok {
			continue // its provider's section is gone: a change that needs a restart, logged below
		}
		t, err := o.resolveTLS(ctx, c, *f)
		changed := false
		if err == nil {
			changed, err = live.Set(t)
		}
		if err != nil {
			u.failed(logger, section, err)
			continue
		}
		u.succeeded(logger, section, changed, live.Config())
	}
	rest, err := cfg.withoutTLS()
	if err == nil && !bytes.Equal(rest, u.rest) && !bytes.Equal(rest, u.restReported) {
		logger.Info("The attestor configuration changed outside its tls blocks; restart the controller to apply that part", "file", o.AttestorConfigFile)
		u.restReported = rest
	}
}

func (u *upstreams) failed(logger logr.Logger, section string, err error) {
	u.metrics.observe(section, false)
	if u.reported[section] == err.Error() {
		return
	}
	u.reported[section] = err.Error()
	logger.Error(err, "Keeping the last good outbound configuration of an upstream: its new one does not load", "upstream", section)
}

func (u *upstreams) succeeded(logger logr.Logger, section string, changed bool, t *tlsconfig.Config) {
	u.metrics.observe(section, true)
	if changed {
		logger.Info("Applied a new outbound configuration to an upstream's new connections", "upstream", section,
			"proxy", t.ProxyString(), "securityProfile", profileName(t), "trustedCA", trustedCAName(t))
	} else if u.reported[section] != "" {
		logger.Info("The outbound configuration of an upstream loads again", "upstream", section)
	}
	u.reported[section] = ""
}

func profileName(t *tlsconfig.Config) string {
	if t == nil || t.SecurityProfile == nil {
		return string(tlsconfig.ProfileIntermediate)
	}
	return string(t.SecurityProfile.Type)
}

func trustedCAName(t *tlsconfig.Config) string {
	switch {
	case t == nil || t.TrustedCA == nil:
		return "system roots"
	case t.TrustedCA.File != "":
		return "file " + t.TrustedCA.File
	case t.TrustedCA.ConfigMap != nil:
		return "ConfigMap " + t.TrustedCA.ConfigMap.Namespace + "/" + t.TrustedCA.ConfigMap.Name
	}
	return "inline"
}

// upstreamMetrics reports whether each upstream's outbound configuration
// loads.
type upstreamMetrics struct {
	failing *prometheus.GaugeVec
	reloads *prometheus.CounterVec
}

func newUpstreamMetrics(reg prometheus.Registerer) (*upstreamMetrics, error) {
	failing, err := registerOrReuse(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "kubelet_authenticator",
		Subsystem: "signer",
		Name:      "upstream_config_failing",
		Help: "1 while the last read of an upstream's outbound configuration (proxy, securityProfile, trustedCA) failed and its last good one stays in use, " +
			"else 0; by upstream (aws.sts.tls, azure.issuers.tls, gcp.jwks.tls).",
	}, []string{"upstream"}))
	if err != nil {
		return nil, err
	}
	reloads, err := registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "kubelet_authenticator",
		Subsystem: "signer",
		Name:      "upstream_config_reads_total",
		Help:      "Reads of an upstream's outbound configuration, by upstream and result (ok, failed).",
	}, []string{"upstream", "result"}))
	if err != nil {
		return nil, err
	}
	return &upstreamMetrics{failing: failing, reloads: reloads}, nil
}

func (m *upstreamMetrics) observe(section string, ok bool) {
	if m == nil {
		return
	}
	failing, result := 1.0, "failed"
	if ok {
		failing, result = 0, "ok"
	}
	m.failing.WithLabelValues(section).Set(failing)
	m.reloads.WithLabelValues(section, result).Inc()
}
