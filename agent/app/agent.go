package app

import (
	"context"
	"crypto/x509"
	goflag "flag"
	"fmt"
	"math"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
	sddaemon "github.com/coreos/go-systemd/v22/daemon"
	"github.com/go-logr/logr"
	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/connrotation"
	"k8s.io/klog/v2"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/credential"
	"sigs.k8s.io/kubelet-authenticator/agent/daemon"
	"sigs.k8s.io/kubelet-authenticator/agent/metrics"
	"sigs.k8s.io/kubelet-authenticator/agent/serving"
	"sigs.k8s.io/kubelet-authenticator/agent/status"
	"sigs.k8s.io/kubelet-authenticator/agent/trustbundle"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

func newAgentCommand() *cobra.Command {
	o := &agentOptions{}
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run beside kubelet: renew its client (and serving) certificate ahead of expiry and project trust bundles",
		Long: `agent is the node's long-running service (systemd Type=notify, with watchdog).

It renews kubelet's client certificate with fresh attestation at a random
point between 70% and 90% of its lifetime, through the same cache and lock
as the credential plugin, so that the plugin always finds a fresh
certificate. A failed renewal keeps the current certificate and is retried
with exponential backoff (agent.renewalRetryInitial .. agent.renewalRetryMax).

With serving.enabled, it also keeps kubelet's serving certificate: a key
made on the node, a CSR to the attested serving signer
(cluster.x-k8s.io/kubelet-serving-<attestor>) filed as the node itself with
fresh evidence, for the node's addresses (serving.dnsNames/ipAddresses, or
the node name and its primary address), written with its chain to
serving.path (kubelet's tlsCertFile and tlsPrivateKeyFile), renewed by the
same rule, and at once when the addresses to request change.

It projects the ClusterTrustBundles listed under trustBundles in the config
to host files, authenticating as the node with its client certificate.

It serves Prometheus metrics and /healthz on the sockets systemd passes
(kubelet-authenticator-metrics.socket) or else on agent.metricsBindAddress
(default: the root-only unix socket /run/kubelet-authenticator/metrics.sock);
a listener that fails is logged, shown by status and retried, and never
stops renewals or projections. It records its state for
'kubelet-authenticator status', and talks to systemd: READY once it holds
a usable client certificate (until then, EXTEND_TIMEOUT_USEC while its loop
runs), STATUS, WATCHDOG, RELOADING, STOPPING.

Signals: SIGHUP reloads the config (an invalid one is logged and ignored);
SIGTERM and SIGINT stop it after the write in progress.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			logger := klog.NewKlogr().WithName("agent")
			return runAgent(klog.NewContext(cmd.Context(), logger), o)
		},
	}
	o.AddFlags(cmd.Flags())
	cmd.Flags().StringVar(&o.metricsAddr, "metrics-bind-address", "",
		"unix:/absolute/path or host:port serving /metrics and /healthz when not socket-activated, \"0\" for none (default "+config.DefaultMetricsBindAddress+")")
	gfs := goflag.NewFlagSet("klog", goflag.ContinueOnError)
	klog.InitFlags(gfs)
	cmd.Flags().AddGoFlag(gfs.Lookup("v"))
	return cmd
}

type agentOptions struct {
	nodeOptions
	metricsAddr string
}

// load reads and checks the configuration, including that its attestor is
// available.
func (o *agentOptions) load() (*config.NodeConfig, attestor.Attestor, error) {
	cfg, err := o.Complete()
	if err != nil {
		return nil, nil, err
	}
	if o.flags.Changed("metrics-bind-address") {
		cfg.Agent.MetricsBindAddress = o.metricsAddr
		if err := cfg.Validate(); err != nil {
			return nil, nil, fmt.Errorf("invalid configuration: %w", err)
		}
	}
	att, err := newAttestor(cfg)
	if err != nil {
		return nil, nil, err
	}
	return cfg, att, nil
}

func notify(state string) { _, _ = sddaemon.SdNotify(false, state) }

func runAgent(ctx context.Context, o *agentOptions) error {
	logger := klog.FromContext(ctx)
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	cfg, att, err := o.load()
	if err != nil {
		return err
	}
	a := &agent{metrics: metrics.New(), log: logger, started: time.Now()}

	// The metrics server and the watchdog outlive reloads and stop last.
	var wg sync.WaitGroup
	defer wg.Wait()
	srvCtx, stopServing := context.WithCancel(context.WithoutCancel(ctx))
	defer stopServing()
	activated := a.serveMetrics(srvCtx, &wg, o, cfg)
	a.watchdog(srvCtx, &wg)

	for {
		genCtx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			a.run(genCtx, cfg, att)
		}()
		newCfg, newAtt, reload := a.nextConfig(ctx, o, hup, cfg, activated)
		if !reload {
			notify("STOPPING=1")
			logger.Info("Stopping")
			cancel()
			<-done
			logger.Info("Stopped")
			return nil
		}
		notify(fmt.Sprintf("RELOADING=1\nMONOTONIC_USEC=%d", monotonicUsec()))
		logger.Info("Reloading the configuration")
		cancel()
		<-done
		cfg, att = newCfg, newAtt
	}
}

// serveMetrics starts the metrics and health server, on the sockets
// systemd passed (kubelet-authenticator-metrics.socket) or else on
// agent.metricsBindAddress, and returns the sockets systemd passed.
// Socket activation wins: systemd bound the address before any local user
// could. The environment is read once, before any reload.
func (a *agent) serveMetrics(ctx context.Context, wg *sync.WaitGroup, o *agentOptions, cfg *config.NodeConfig) []net.Listener {
	activated, err := activation.Listeners()
	if err != nil {
		a.log.Error(err, "Unable to use the sockets systemd passed; falling back to agent.metricsBindAddress")
	}
	activated = slices.DeleteFunc(activated, func(l net.Listener) bool { return l == nil })
	addr := cfg.Agent.MetricsBindAddress
	if len(activated) == 0 && addr == "0" {
		return activated
	}
	if len(activated) > 0 && o.flags.Changed("metrics-bind-address") {
		a.log.Info("Serving on the sockets systemd passed; --metrics-bind-address is not used", "metricsBindAddress", addr)
	}
	srv := &metrics.Server{
		Handler:     a.metrics.Handler(a.healthz),
		Activated:   activated,
		BindAddress: addr,
		OnState:     a.listenerState,
	}
	wg.Go(func() { srv.Run(ctx) })
	return activated
}

// watchdog pings systemd's watchdog at half its interval while the agent
// is healthy, when the unit asks for one (WatchdogSec=).
func (a *agent) watchdog(ctx context.Context, wg *sync.WaitGroup) {
	interval, err := sddaemon.SdWatchdogEnabled(false)
	if err != nil || interval <= 0 {
		return
	}
	wg.Go(func() {
		t := time.NewTicker(interval / 2)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if a.healthz() == nil {
					notify("WATCHDOG=1")
				}
			}
		}
	})
}

// nextConfig waits for SIGHUP and a valid configuration to reload (true),
// or for ctx to end (false). An invalid configuration is logged and the
// running one kept.
func (a *agent) nextConfig(ctx context.Context, o *agentOptions, hup <-chan os.Signal, cfg *config.NodeConfig, activated []net.Listener) (*config.NodeConfig,
	attestor.Attestor, bool) {
	for {
		select {
		case <-ctx.Done():
			return nil, nil, false
		case <-hup:
		}
		newCfg, newAtt, err := o.load()
		if err != nil {
			a.log.Error(err, "Not reloading: the new configuration is invalid; keeping the running one")
			continue
		}
		if newCfg.Agent.MetricsBindAddress != cfg.Agent.MetricsBindAddress && len(activated) == 0 {
			a.log.Info("Changes to agent.metricsBindAddress take effect on restart", "serving", cfg.Agent.MetricsBindAddress)
		}
		return newCfg, newAtt, true
	}
}

// agent is one run of the agent; run is called again on every reload.
type agent struct {
	metrics *metrics.Metrics
	log     logr.Logger
	started time.Time

	mu        sync.Mutex
	listener  metrics.ListenerState
	renewal   *daemon.Renewal
	beatLimit time.Duration
	recorder  *status.Recorder
	bundles   map[string]trustbundle.Status
	cert      string // the certificate part of the last STATUS line
	serving   string // the serving certificate's part, when serving.enabled
}

func (a *agent) certLine() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cert == "" {
		return "no client certificate yet"
	}
	return a.cert
}

// healthz is healthy while the renewal loop wakes up as it should.
func (a *agent) healthz() error {
	a.mu.Lock()
	r := a.renewal
	a.mu.Unlock()
	if r == nil {
		return fmt.Errorf("renewal loop not running")
	}
	// The loop beats at least every daemon.Heartbeat; an attempt in
	// progress, bounded by requestTimeout, keeps it from beating meanwhile.
	if since := time.Since(r.LastBeat()); since > a.beatLimit {
		return fmt.Errorf("renewal loop silent for %s", since.Round(time.Second))
	}
	return nil
}

// listenerState records and logs what the metrics server reports. A
// listener problem shows in the log, in status and in systemd's STATUS
// line; it is not a health failure, which would have the watchdog restart
// an agent whose renewals and projections are fine.
func (a *agent) listenerState(st metrics.ListenerState) {
	a.mu.Lock()
	old := a.listener
	a.listener = st
	a.mu.Unlock()
	switch {
	case st.Err == nil:
		a.log.Info("Serving metrics and /healthz", "addresses", st.Addresses)
	case old.Err == nil || old.Err.Error() != st.Err.Error():
		a.log.Error(st.Err, "Not serving metrics and /healthz; retrying", "nextAttempt", st.NextAttempt.UTC().Format(time.RFC3339))
	default:
		a.log.V(2).Info("Still not serving metrics and /healthz", "err", st.Err.Error(), "nextAttempt", st.NextAttempt.UTC().Format(time.RFC3339))
	}
	a.record(func(s *status.State) { setListener(s, st) })
	if (old.Err == nil) != (st.Err == nil) {
		a.sdStatus(a.certLine())
	}
}

func setListener(s *status.State, st metrics.ListenerState) {
	s.MetricsAddress, s.MetricsError, s.MetricsNextAttempt = strings.Join(st.Addresses, ", "), "", time.Time{}
	if st.Err != nil {
		s.MetricsError, s.MetricsNextAttempt = st.Err.Error(), st.NextAttempt
	}
}

func (a *agent) record(change func(*status.State)) {
	a.mu.Lock()
	rec := a.recorder
	a.mu.Unlock()
	if rec == nil {
		return
	}
	if err := rec.Update(change); err != nil {
		a.log.Error(err, "Unable to record the state")
	}
}

// sdStatus sends a one-line summary to systemd.
func (a *agent) sdStatus(cert string) {
	a.mu.Lock()
	stale := 0
	for _, s := range a.bundles {
		if s.Stale {
			stale++
		}
	}
	n := len(a.bundles)
	listenErr := a.listener.Err
	a.cert = cert
	servingLine := a.serving
	a.mu.Unlock()
	line := cert
	if servingLine != "" {
		line += "; " + servingLine
	}
	if n > 0 {
		line += fmt.Sprintf("; trust bundles: %d current, %d stale", n-stale, stale)
	}
	if listenErr != nil {
		line += "; metrics listener failing: " + listenErr.Error()
	}
	notify("STATUS=" + line)
}

func (a *agent) run(ctx context.Context, cfg *config.NodeConfig, att attestor.Attestor) {
	rec := status.NewRecorder(cfg.CacheDir)
	a.mu.Lock()
	a.recorder, a.bundles, a.serving, a.cert = rec, map[string]trustbundle.Status{}, "", ""
	listener := a.listener
	a.mu.Unlock()
	a.cleanUp(ctx, cfg)
	a.record(func(s *status.State) {
		s.PID, s.Started = os.Getpid(), a.started
		setListener(s, listener)
		s.TrustBundles = nil
	})

	src := &credential.Source{
		Config: cfg,
		Attestor: daemon.Instrument(att, func(d time.Duration, err error) {
			a.metrics.ObserveAttestation(d, err)
			a.record(func(s *status.State) { s.Attestation = status.NewResult(time.Now().Add(-d), d, err) })
		}),
	}
	dialer := connrotation.NewDialer((&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext)
	haveCert := make(chan struct{})
	ren := a.clientRenewal(cfg, src, dialer, haveCert)
	a.mu.Lock()
	a.renewal, a.beatLimit = ren, 2*daemon.Heartbeat+cfg.RequestTimeout.Duration
	a.mu.Unlock()

	// The credential path logs through the context: its lines are the
	// agent's, named for it.
	credCtx := klog.NewContext(ctx, a.log.WithName("credential"))
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := ren.Run(credCtx); err != nil {
			a.log.Error(err, "Renewal loop stopped")
		}
	})
	// Serving certificates and trust bundles are asked for with the client
	// certificate: they start once there is one.
	afterCert := func(f func()) {
		wg.Go(func() {
			select {
			case <-ctx.Done():
			case <-haveCert:
				f()
			}
		})
	}
	if cfg.Serving.Enabled {
		afterCert(func() { a.runServing(credCtx, cfg, src) })
	}
	if len(cfg.TrustBundles) > 0 {
		afterCert(func() { a.projectTrustBundles(ctx, cfg, dialer) })
	}
	wg.Wait()
}

// clientRenewal is the client certificate's renewal loop: it closes
// haveCert once there is a certificate, closes every connection after a
// renewal so that new ones present the new certificate, and tells systemd
// the agent is ready once it holds a usable certificate.
func (a *agent) clientRenewal(cfg *config.NodeConfig, src *credential.Source, dialer *connrotation.Dialer, haveCert chan struct{}) *daemon.Renewal {
	var haveCertOnce sync.Once
	renewalState := func(s *status.State) *status.RenewalState { return &s.Renewal }
	return &daemon.Renewal{
		Renewer:      src,
		Load:         cache.Dir{Path: cfg.CacheDir}.Load,
		NodeName:     cfg.NodeName,
		RetryInitial: cfg.Agent.RenewalRetryInitial.Duration,
		RetryMax:     cfg.Agent.RenewalRetryMax.Duration,
		Metrics:      a.metrics.Renewal(),
		OnSchedule: func(cert *x509.Certificate, next time.Time) {
			if cert != nil {
				haveCertOnce.Do(func() { close(haveCert) })
				a.sdStatus(fmt.Sprintf("certificate valid until %s, renewal at %s", cert.NotAfter.UTC().Format(time.RFC3339), next.UTC().Format(time.RFC3339)))
			}
			a.record(func(s *status.State) { renewalState(s).NextAttempt = next })
		},
		OnAttempt: func(at daemon.Attempt) {
			a.recordAttempt(renewalState, at)
			if at.Err != nil {
				a.log.Error(at.Err, "Client certificate renewal failed",
					"consecutiveFailures", at.ConsecutiveFailures, "nextAttempt", at.NextAttempt.UTC().Format(time.RFC3339))
				a.sdStatus(fmt.Sprintf("renewal failing (%d in a row), next attempt %s", at.ConsecutiveFailures, at.NextAttempt.UTC().Format(time.RFC3339)))
				return
			}
			// New connections present the new certificate at once.
			dialer.CloseAll()
			a.log.Info("Renewed the client certificate", "serial", at.Certificate.SerialNumber.Text(16),
				"notAfter", at.Certificate.NotAfter.UTC().Format(time.RFC3339), "took", at.Duration.Round(time.Millisecond))
		},
		// Until it holds a usable certificate the agent is starting: each
		// wake-up of a live loop extends systemd's start timeout by as much
		// as /healthz allows between two (an attempt waits up to
		// requestTimeout), so a node that waits for kubeadm join, or for
		// the signer, stays starting rather than failing, and a hung loop
		// still times out.
		OnWaiting: func() {
			notify(fmt.Sprintf("EXTEND_TIMEOUT_USEC=%d", (2*daemon.Heartbeat + cfg.RequestTimeout.Duration).Microseconds()))
		},
		OnReady: func() {
			notify("READY=1")
			a.sdStatus(a.certLine())
			a.log.Info("Ready")
		},
	}
}

// recordAttempt records a renewal attempt's result in the loop's state
// (which returns it from the whole state).
func (a *agent) recordAttempt(which func(*status.State) *status.RenewalState, at daemon.Attempt) {
	res := status.NewResult(at.Start, at.Duration, at.Err)
	a.record(func(s *status.State) {
		r := which(s)
		r.Last = res
		if at.Err != nil {
			r.ConsecutiveFailures, r.NextAttempt = at.ConsecutiveFailures, at.NextAttempt
			return
		}
		r.LastSuccess, r.ConsecutiveFailures = at.Start, 0
	})
}

// projectTrustBundles keeps the configured trust bundle projections
// current, as the node, once it can build the node's client
// configuration (retried with backoff up to agent.renewalRetryMax).
func (a *agent) projectTrustBundles(ctx context.Context, cfg *config.NodeConfig, dialer *connrotation.Dialer) {
	backoff := wait.Backoff{Duration: time.Second, Factor: 2, Cap: max(time.Second, cfg.Agent.RenewalRetryMax.Duration), Steps: math.MaxInt32}
	var restCfg *rest.Config
	for {
		var err error
		if restCfg, err = nodeRESTConfig(cfg, dialer); err == nil {
			break
		}
		retry := backoff.Step()
		a.log.Error(err, "Unable to project trust bundles yet", "retryIn", retry)
		for _, pr := range cfg.TrustBundles {
			a.metrics.Stale(pr.Key(), true)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(retry):
		}
	}
	mgr := &trustbundle.Manager{
		Config:      restCfg,
		Projections: cfg.TrustBundles,
		MaxBundles:  cfg.Agent.MaxTrustBundles,
		MaxBytes:    cfg.Agent.MaxTrustBundleBytes,
		Metrics:     a.metrics,
		OnStatus:    func(s trustbundle.Status) { a.bundleStatus(s, a.certLine()) },
	}
	if err := mgr.Run(ctx); err != nil {
		a.log.Error(err, "Trust bundle projection stopped")
	}
}

// runServing keeps kubelet's serving certificate (serving.enabled) with the
// client certificate's renewal loop and rule, once the node has a client
// certificate to ask for it with.
func (a *agent) runServing(ctx context.Context, cfg *config.NodeConfig, src *credential.Source) {
	log := a.log.WithValues("path", cfg.Serving.Path, "signerName", cfg.Serving.SignerName)
	mgr := &serving.Manager{Config: cfg, Source: src}
	setLine := func(line string) {
		a.mu.Lock()
		a.serving = line
		a.mu.Unlock()
		a.sdStatus(a.certLine())
	}
	if dnsNames, ips, err := mgr.Addresses(); err != nil {
		log.Error(err, "Unable to tell the serving certificate's addresses")
	} else {
		log.Info("Keeping kubelet's serving certificate", "dnsNames", dnsNames, "ipAddresses", ips)
	}
	renewalState := func(s *status.State) *status.RenewalState { return &s.ServingRenewal }
	ren := &daemon.Renewal{
		Renewer:      mgr,
		Load:         mgr.Load,
		Stale:        mgr.Stale,
		NodeName:     cfg.NodeName,
		RetryInitial: cfg.Agent.RenewalRetryInitial.Duration,
		RetryMax:     cfg.Agent.RenewalRetryMax.Duration,
		Metrics:      a.metrics.ServingRenewal(),
		OnSchedule: func(cert *x509.Certificate, next time.Time) {
			if cert != nil && mgr.Stale(cert) {
				log.Info("The serving certificate's addresses differ from the ones to request; replacing it now",
					"dnsNames", cert.DNSNames, "ipAddresses", cert.IPAddresses)
			}
			if cert != nil {
				setLine(fmt.Sprintf("serving certificate valid until %s", cert.NotAfter.UTC().Format(time.RFC3339)))
			}
			a.record(func(s *status.State) { renewalState(s).NextAttempt = next })
		},
		OnAttempt: func(at daemon.Attempt) {
			a.recordAttempt(renewalState, at)
			if at.Err != nil {
				log.Error(at.Err, "Serving certificate renewal failed; kubelet keeps serving the installed one",
					"consecutiveFailures", at.ConsecutiveFailures, "nextAttempt", at.NextAttempt.UTC().Format(time.RFC3339))
				setLine(fmt.Sprintf("serving renewal failing (%d in a row), next attempt %s", at.ConsecutiveFailures, at.NextAttempt.UTC().Format(time.RFC3339)))
				return
			}
			log.Info("Installed a new kubelet serving certificate",
				"serial", at.Certificate.SerialNumber.Text(16), "notAfter", at.Certificate.NotAfter.UTC().Format(time.RFC3339),
				"dnsNames", at.Certificate.DNSNames, "ipAddresses", at.Certificate.IPAddresses, "took", at.Duration.Round(time.Millisecond))
		},
	}
	if err := ren.Run(ctx); err != nil {
		log.Error(err, "Serving certificate loop stopped")
	}
}

// cleanUp removes what an earlier run left behind: temporary files of a
// writer that died in the cache directory (under the cache lock), and the
// files of trust bundle projections the recorded state has and cfg no
// longer does.
func (a *agent) cleanUp(ctx context.Context, cfg *config.NodeConfig) {
	dir := cache.Dir{Path: cfg.CacheDir}
	// Briefly: a writer holding the lock (a renewal in progress) must not
	// hold up the agent's start; its leftovers go at the next start.
	lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	if unlock, err := dir.Lock(lctx); err != nil {
		a.log.Info("Not cleaning up the cache directory now", "reason", err.Error())
	} else {
		if err := dir.RemoveTemp(); err != nil {
			a.log.Error(err, "Unable to clean up the cache directory")
		}
		unlock()
	}
	cancel()
	prev, err := status.LoadState(cfg.CacheDir)
	if err != nil || prev == nil {
		return
	}
	var paths []string
	for _, s := range prev.TrustBundles {
		paths = append(paths, s.Projection)
	}
	if err := trustbundle.RemoveStale(paths, cfg.TrustBundles); err != nil {
		a.log.Error(err, "Unable to remove a former trust bundle projection")
	}
}

// bundleStatus records a projection's status and logs what changed.
func (a *agent) bundleStatus(s trustbundle.Status, certLine string) {
	a.mu.Lock()
	old, seen := a.bundles[s.Projection]
	a.bundles[s.Projection] = s
	rec := a.recorder
	a.mu.Unlock()
	if err := rec.SetTrustBundle(s); err != nil {
		a.log.Error(err, "Unable to record the state")
	}
	log := a.log.WithValues("path", s.Projection)
	switch {
	case !s.LastUpdate.Equal(old.LastUpdate) && s.LastUpdate.After(a.started):
		log.Info("Trust bundle updated", "sources", s.Sources, "certificates", s.Certificates)
	case s.Stale && (!old.Stale || old.Reason != s.Reason) && s.Reason != "":
		log.Info("Trust bundle stale", "reason", s.Reason, "certificates", s.Certificates)
	case !s.Stale && old.Stale && seen:
		log.Info("Trust bundle current", "sources", s.Sources, "certificates", s.Certificates)
	}
	if s.Reason != "" && !s.Stale && s.Reason != old.Reason {
		log.Info("Trust bundle post-update command failed", "err", s.Reason)
	}
	if !seen || old.Stale != s.Stale {
		a.sdStatus(certLine)
	}
}

// nodeRESTConfig reaches the node's cluster (credential.ClusterConfig:
// the bootstrap kubeconfig's server and CA, or the ones recorded at
// issuance once that file is gone) as the node, with the cached client
// certificate, re-read when it changes; dialer lets the renewal close
// connections that present the old one.
func nodeRESTConfig(cfg *config.NodeConfig, dialer *connrotation.Dialer) (*rest.Config, error) {
	c, err := credential.ClusterConfig(cfg)
	if err != nil {
		return nil, err
	}
	credFile := filepath.Join(cfg.CacheDir, cache.CurrentFile)
	c.TLSClientConfig.CertFile, c.TLSClientConfig.KeyFile = credFile, credFile
	c.UserAgent = "kubelet-authenticator-agent"
	c.Dial = dialer.DialContext
	c.QPS, c.Burst = 5, 10
	return c, nil
}
