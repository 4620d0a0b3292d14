package app

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/pflag"
	"k8s.io/component-base/logs"
	logsv1 "k8s.io/component-base/logs/api/v1"
	_ "k8s.io/component-base/logs/json/register" // --logging-format=json
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
)

// DefaultMetricsBindAddress is where the controller serves /metrics unless
// told otherwise: HTTPS, as Cluster API's managers do.
const DefaultMetricsBindAddress = ":8443"

// diagnosticsOptions are how the controller reports: its logging (klog
// through k8s.io/component-base/logs: --logging-format, -v, --vmodule) and
// how its metrics endpoint is secured.
type diagnosticsOptions struct {
	// InsecureDiagnostics serves /metrics over plain HTTP to anyone who can
	// reach the port. By default it is HTTPS, and only a caller whose bearer
	// token the management cluster's API server authenticates (TokenReview)
	// and authorizes for get on the non-resource URL /metrics
	// (SubjectAccessReview) reads it.
	InsecureDiagnostics bool
	// MetricsCertDir holds the metrics endpoint's serving certificate and
	// key (tls.crt, tls.key; reloaded when they change). Empty: a
	// self-signed certificate made at start.
	MetricsCertDir string
	// ProfilerAddress serves net/http/pprof there (host:port, plain HTTP,
	// no authentication: bind it to localhost); empty, the default,
	// serves nothing. Cluster API's managers call it the same.
	ProfilerAddress string

	// logging is the logging configuration the flags fill; nil until
	// addFlags (callers that build Options in code keep klog's defaults).
	logging *logsv1.LoggingConfiguration
}

func (o *diagnosticsOptions) addFlags(fs *pflag.FlagSet) {
	if o.logging == nil {
		o.logging = logsv1.NewLoggingConfiguration()
	}
	logsv1.AddFlags(o.logging, fs)
	fs.BoolVar(&o.InsecureDiagnostics, "insecure-diagnostics", o.InsecureDiagnostics,
		"Serve /metrics over plain HTTP without authentication or authorization. By default it is HTTPS and a caller needs a bearer token the API server "+
			"authenticates and authorizes for get on /metrics (ClusterRole kubelet-authenticator:node-attestation-controller-metrics-reader).")
	fs.StringVar(&o.MetricsCertDir, "metrics-cert-dir", o.MetricsCertDir,
		"Directory holding the metrics endpoint's serving certificate and key, tls.crt and tls.key (reloaded when they change). Empty: "+
			"a self-signed certificate made at start.")
	fs.StringVar(&o.ProfilerAddress, "profiler-address", o.ProfilerAddress,
		"Serve Go's profiles (net/http/pprof) at this host:port, over plain HTTP without authentication: bind it to localhost (e.g. "+
			"localhost:6060) and reach it with kubectl port-forward. Empty: not served.")
}

func (o *diagnosticsOptions) validate() []error {
	var errs []error
	if o.logging != nil {
		if err := logsv1.Validate(o.logging, nil, nil).ToAggregate(); err != nil {
			errs = append(errs, fmt.Errorf("logging flags (--logging-format, -v, --vmodule): %w", err))
		}
	}
	if o.MetricsCertDir == "" {
		return errs
	}
	if o.InsecureDiagnostics {
		errs = append(errs, errors.New("--metrics-cert-dir is for HTTPS and cannot be used with --insecure-diagnostics"))
	}
	for _, f := range []string{"tls.crt", "tls.key"} {
		if _, err := os.Stat(filepath.Join(o.MetricsCertDir, f)); err != nil {
			errs = append(errs, fmt.Errorf("--metrics-cert-dir %s: %w", o.MetricsCertDir, err))
		}
	}
	return errs
}

// applyLogging makes the logging flags take effect. It is called first,
// so that everything after logs in the chosen format; once per process. An
// invalid logging configuration is left for Validate to report with every
// other problem.
func (o *diagnosticsOptions) applyLogging() error {
	if o.logging == nil || len(logsv1.Validate(o.logging, nil, nil)) > 0 {
		return nil
	}
	if err := logsv1.ValidateAndApply(o.logging, nil); err != nil {
		return fmt.Errorf("logging: %w", err)
	}
	return nil
}

// flushLogs writes out buffered log lines before the process exits.
func flushLogs() { logs.FlushLogs() }

// metricsServer is the metrics endpoint's configuration: HTTPS with
// authentication and authorization by the management cluster's API server
// unless --insecure-diagnostics.
func (o *Options) metricsServer() metricsserver.Options {
	if o.InsecureDiagnostics || o.MetricsBindAddress == "0" {
		return metricsserver.Options{BindAddress: o.MetricsBindAddress}
	}
	return metricsserver.Options{
		BindAddress:    o.MetricsBindAddress,
		SecureServing:  true,
		FilterProvider: filters.WithAuthenticationAndAuthorization,
		CertDir:        o.MetricsCertDir,
	}
}
