// Package status answers `kubelet-authenticator status`: the current
// client certificate, kubelet's serving certificate when the agent keeps
// it, the agent's last attestation and renewals, and each projected trust
// bundle. The agent records what only it knows in a small
// state file in the cache directory (Recorder); Collect combines it with
// what is on disk.
package status

import (
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/rotation"
	"sigs.k8s.io/kubelet-authenticator/agent/serving"
	"sigs.k8s.io/kubelet-authenticator/agent/trustbundle"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// StateFile is the agent's state file in the cache directory.
const StateFile = "agent-state.json"

// State is what the agent records.
type State struct {
	// PID and Started identify the agent process that wrote the state;
	// Updated is when it last did.
	PID     int       `json:"pid"`
	Started time.Time `json:"started"`
	Updated time.Time `json:"updated"`
	// MetricsAddress is where the agent serves /metrics and /healthz
	// (comma-separated when systemd passed several sockets); empty while
	// it does not.
	MetricsAddress string `json:"metricsAddress,omitempty"`
	// MetricsError is why it does not serve them, and MetricsNextAttempt
	// when it tries again. A listener problem never stops renewals or
	// projections.
	MetricsError       string    `json:"metricsError,omitempty"`
	MetricsNextAttempt time.Time `json:"metricsNextAttempt,omitzero"`
	// Renewal and Attestation are the last results.
	Renewal     RenewalState `json:"renewal"`
	Attestation Result       `json:"attestation"`
	// ServingRenewal is the serving certificate's renewal loop, when
	// serving.enabled.
	ServingRenewal RenewalState `json:"servingRenewal,omitzero"`
	// TrustBundles are the projections, by path.
	TrustBundles []trustbundle.Status `json:"trustBundles,omitempty"`
}

// Result is the outcome of one operation.
type Result struct {
	Time     time.Time `json:"time,omitzero"`
	Success  bool      `json:"success"`
	Duration string    `json:"duration,omitempty"`
	Error    string    `json:"error,omitempty"`
}

// RenewalState is the renewal loop's state.
type RenewalState struct {
	Last                Result    `json:"last"`
	LastSuccess         time.Time `json:"lastSuccess,omitzero"`
	ConsecutiveFailures int       `json:"consecutiveFailures"`
	NextAttempt         time.Time `json:"nextAttempt,omitzero"`
}

// NewResult returns the Result of an operation that started at start and
// took d.
func NewResult(start time.Time, d time.Duration, err error) Result {
	r := Result{Time: start, Success: err == nil, Duration: d.Round(time.Millisecond).String()}
	if err != nil {
		r.Error = err.Error()
	}
	return r
}

// Recorder keeps the agent's state and writes it atomically (0600) on every
// change. It is safe for concurrent use.
type Recorder struct {
	path  string
	mu    sync.Mutex
	state State
}

// NewRecorder returns a recorder for the state file in cacheDir, starting
// from the state on disk (so that results survive a restart).
func NewRecorder(cacheDir string) *Recorder {
	r := &Recorder{path: filepath.Join(cacheDir, StateFile)}
	if s, err := LoadState(cacheDir); err == nil {
		r.state = *s
	}
	return r
}

// Update changes the state and writes it.
func (r *Recorder) Update(change func(*State)) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	change(&r.state)
	r.state.Updated = time.Now()
	data, err := json.MarshalIndent(&r.state, "", "  ")
	if err != nil {
		return err
	}
	return cache.WriteFileAtomic(r.path, append(data, '\n'), 0o600)
}

// SetTrustBundle records the status of one projection.
func (r *Recorder) SetTrustBundle(s trustbundle.Status) error {
	return r.Update(func(st *State) {
		for i := range st.TrustBundles {
			if st.TrustBundles[i].Projection == s.Projection {
				st.TrustBundles[i] = s
				return
			}
		}
		st.TrustBundles = append(st.TrustBundles, s)
	})
}

// LoadState reads the state file in cacheDir.
func LoadState(cacheDir string) (*State, error) {
	data, err := os.ReadFile(filepath.Join(cacheDir, StateFile))
	if err != nil {
		return nil, err
	}
	var s State
	if err := json.Unmarshal(data, &s); err != nil {
		return nil, fmt.Errorf("unable to parse %s: %w", filepath.Join(cacheDir, StateFile), err)
	}
	return &s, nil
}

// Report is what status shows.
type Report struct {
	Node        string           `json:"node"`
	Certificate *CertificateInfo `json:"certificate,omitempty"`
	// CertificateError says why there is no usable certificate.
	CertificateError string `json:"certificateError,omitempty"`
	// Serving describes kubelet's serving certificate when serving.enabled;
	// ServingError says why there is none usable.
	Serving      *CertificateInfo `json:"serving,omitempty"`
	ServingError string           `json:"servingError,omitempty"`
	// Agent is the agent's state; nil when it has not run.
	Agent        *State         `json:"agent,omitempty"`
	TrustBundles []BundleReport `json:"trustBundles,omitempty"`
}

// Health is what a report says of the node's identity, as status's exit
// code.
type Health int

const (
	// Healthy means: a usable client certificate, nothing needs attention.
	Healthy Health = 0
	// NoIdentity means: no usable client certificate.
	NoIdentity Health = 2
	// Degraded means: a usable client certificate, but its renewal is overdue
	// or failing, the serving certificate is missing or unusable, or a
	// trust bundle is stale.
	Degraded Health = 3
)

// Health says whether the node has a usable identity and, if not healthy,
// why in one line.
func (r *Report) Health() (Health, string) {
	switch {
	case r.Certificate == nil:
		return NoIdentity, "no usable client certificate: " + r.CertificateError
	case !r.Certificate.Usable:
		return NoIdentity, "no usable client certificate: it expired or is about to (" + r.Certificate.TimeToExpiry + " left)"
	}
	var why []string
	if r.Certificate.RenewalOverdue {
		why = append(why, "client certificate renewal overdue or failing")
	}
	switch {
	case r.ServingError != "":
		why = append(why, r.ServingError)
	case r.Serving != nil && !r.Serving.Usable:
		why = append(why, "serving certificate expired or about to")
	}
	for _, b := range r.TrustBundles {
		if b.Stale {
			why = append(why, "trust bundle "+b.Path+" stale")
		}
	}
	if len(why) > 0 {
		return Degraded, strings.Join(why, "; ")
	}
	return Healthy, ""
}

// CertificateInfo describes the cached client certificate.
type CertificateInfo struct {
	Subject    string    `json:"subject"`
	ProviderID string    `json:"providerID,omitempty"`
	Issuer     string    `json:"issuer"`
	Serial     string    `json:"serial"`
	NotBefore  time.Time `json:"notBefore"`
	NotAfter   time.Time `json:"notAfter"`
	// RenewAt is when the agent renews it (its recorded next attempt), or
	// else when the exec plugin would (90% of its lifetime).
	RenewAt time.Time `json:"renewAt"`
	// TimeToRenewal and TimeToExpiry are from now, rounded to seconds.
	TimeToRenewal string `json:"timeToRenewal"`
	TimeToExpiry  string `json:"timeToExpiry"`
	Usable        bool   `json:"usable"`
	// RenewalOverdue is true when the certificate is past its renewal
	// point or the agent's renewals are failing: unless one succeeds
	// before NotAfter, the certificate ends then (for the client
	// certificate: kubelet loses the API server, what a management
	// cluster out of reach for longer than the renewal window does).
	RenewalOverdue bool `json:"renewalOverdue"`
	// Path, DNSNames and IPAddresses: where a serving certificate is
	// installed, and its subject alternative names.
	Path        string   `json:"path,omitempty"`
	DNSNames    []string `json:"dnsNames,omitempty"`
	IPAddresses []string `json:"ipAddresses,omitempty"`
}

// BundleReport is one configured projection.
type BundleReport struct {
	Path   string `json:"path"`
	Source string `json:"source"`
	// Certificates is how many the file on disk holds; Exists whether it
	// exists.
	Exists       bool `json:"exists"`
	Certificates int  `json:"certificates"`
	// State is what the agent last recorded, if anything.
	State *trustbundle.Status `json:"state,omitempty"`
	// Stale is the agent's verdict, true when it has not recorded one.
	Stale bool `json:"stale"`
}

// Collect builds the report for cfg at now.
func Collect(cfg *config.NodeConfig, now time.Time) *Report {
	rep := &Report{Node: cfg.NodeName}
	state, err := LoadState(cfg.CacheDir)
	if err == nil {
		rep.Agent = state
	}
	cred, err := cache.Dir{Path: cfg.CacheDir}.Load()
	switch {
	case errors.Is(err, cache.ErrNotFound):
		rep.CertificateError = "no client certificate in " + cfg.CacheDir
	case err != nil:
		rep.CertificateError = err.Error()
	default:
		var renewal *RenewalState
		if state != nil {
			renewal = &state.Renewal
		}
		rep.Certificate = describe(cred.Leaf, renewal, now)
	}
	if cfg.Serving.Enabled {
		switch cred, err := serving.Load(cfg.Serving.Path, cfg.NodeName); {
		case errors.Is(err, serving.ErrNotFound):
			rep.ServingError = "no serving certificate at " + cfg.Serving.Path
		case err != nil:
			rep.ServingError = err.Error()
		default:
			var renewal *RenewalState
			if state != nil {
				renewal = &state.ServingRenewal
			}
			rep.Serving = describe(cred.Leaf, renewal, now)
			rep.Serving.Path = cfg.Serving.Path
			rep.Serving.DNSNames = cred.Leaf.DNSNames
			for _, ip := range cred.Leaf.IPAddresses {
				rep.Serving.IPAddresses = append(rep.Serving.IPAddresses, ip.String())
			}
		}
	}
	for _, p := range cfg.TrustBundles {
		b := BundleReport{Path: p.Path, Source: source(p), Stale: true}
		if data, err := os.ReadFile(p.Path); err == nil {
			b.Exists, b.Certificates = true, trustbundle.Count(data)
		} else if !errors.Is(err, fs.ErrNotExist) {
			b.Exists = true
		}
		if state != nil {
			for i := range state.TrustBundles {
				if s := state.TrustBundles[i]; s.Projection == p.Key() {
					b.State, b.Stale = &s, s.Stale
				}
			}
		}
		rep.TrustBundles = append(rep.TrustBundles, b)
	}
	return rep
}

func source(p config.TrustBundleProjection) string {
	if p.Name != "" {
		return "name=" + p.Name
	}
	s := "signerName=" + p.SignerName
	if p.LabelSelector != nil {
		if sel, err := metav1.LabelSelectorAsSelector(p.LabelSelector); err == nil && !sel.Empty() {
			s += " labels=" + sel.String()
		}
	}
	return s
}

// describe describes c; next is the agent's recorded next renewal attempt
// (zero when none).
func describe(c *x509.Certificate, renewal *RenewalState, now time.Time) *CertificateInfo {
	info := &CertificateInfo{
		Subject:   c.Subject.String(),
		Issuer:    c.Issuer.String(),
		Serial:    c.SerialNumber.Text(16),
		NotBefore: c.NotBefore,
		NotAfter:  c.NotAfter,
		RenewAt:   rotation.RenewBy(c),
		Usable:    rotation.Usable(c, now),
	}
	if pid, err := attestor.ProviderIDFromExtensions(c.Extensions); err == nil {
		info.ProviderID = pid
	}
	if renewal != nil && !renewal.NextAttempt.IsZero() && renewal.NextAttempt.Before(info.RenewAt) {
		info.RenewAt = renewal.NextAttempt
	}
	info.RenewalOverdue = info.Usable && (!now.Before(rotation.RenewBy(c)) || (renewal != nil && renewal.ConsecutiveFailures > 0))
	info.TimeToRenewal = info.RenewAt.Sub(now).Round(time.Second).String()
	info.TimeToExpiry = c.NotAfter.Sub(now).Round(time.Second).String()
	return info
}

// WriteJSON writes the report as indented JSON.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// WriteText writes the report for a person.
func (r *Report) WriteText(w io.Writer, now time.Time) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	ts := func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return fmt.Sprintf("%s (%s)", t.UTC().Format(time.RFC3339), ago(now, t))
	}
	fmt.Fprintf(tw, "Node:\t%s\n", r.Node)
	r.writeCertificate(tw, ts)
	r.writeServing(tw, ts)
	r.writeAgent(tw, ts)
	r.writeTrustBundles(tw, ts)
	return tw.Flush()
}

// writeCertificate writes the client certificate's section; ts formats a time.
func (r *Report) writeCertificate(tw io.Writer, ts func(time.Time) string) {
	fmt.Fprintln(tw, "Client certificate:")
	c := r.Certificate
	if c == nil {
		fmt.Fprintf(tw, "  Error:\t%s\n", r.CertificateError)
		return
	}
	fmt.Fprintf(tw, "  Subject:\t%s\n", c.Subject)
	fmt.Fprintf(tw, "  Provider ID:\t%s\n", orDash(c.ProviderID))
	fmt.Fprintf(tw, "  Issuer:\t%s\n", c.Issuer)
	fmt.Fprintf(tw, "  Not after:\t%s\n", ts(c.NotAfter))
	fmt.Fprintf(tw, "  Renewal:\t%s\n", ts(c.RenewAt))
	if !c.Usable {
		fmt.Fprintf(tw, "  Usable:\tno (expired or about to): the node needs a valid bootstrap token to attest again\n")
	}
	if c.RenewalOverdue {
		fmt.Fprintf(tw, "  Goes dark:\t%s unless a renewal succeeds first (renewals go through the management cluster's signer)\n", ts(c.NotAfter))
	}
}

// writeServing writes the serving certificate's section, when there is one; ts formats a time.
func (r *Report) writeServing(tw io.Writer, ts func(time.Time) string) {
	if r.Serving == nil && r.ServingError == "" {
		return
	}
	fmt.Fprintln(tw, "Serving certificate:")
	c := r.Serving
	if c == nil {
		fmt.Fprintf(tw, "  Error:\t%s\n", r.ServingError)
		return
	}
	fmt.Fprintf(tw, "  File:\t%s\n", c.Path)
	fmt.Fprintf(tw, "  Addresses:\t%s\n", orDash(strings.Join(append(slices.Clone(c.DNSNames), c.IPAddresses...), ", ")))
	fmt.Fprintf(tw, "  Issuer:\t%s\n", c.Issuer)
	fmt.Fprintf(tw, "  Not after:\t%s\n", ts(c.NotAfter))
	fmt.Fprintf(tw, "  Renewal:\t%s\n", ts(c.RenewAt))
	if !c.Usable {
		fmt.Fprintf(tw, "  Usable:\tno (expired or about to)\n")
	}
}

// writeAgent writes the agent's recorded state; ts formats a time.
func (r *Report) writeAgent(tw io.Writer, ts func(time.Time) string) {
	fmt.Fprintln(tw, "Agent:")
	a := r.Agent
	if a == nil {
		fmt.Fprintln(tw, "  State:\tnone recorded (the agent has not run)")
		return
	}
	fmt.Fprintf(tw, "  Process:\tpid %d, started %s, state updated %s\n", a.PID, ts(a.Started), ts(a.Updated))
	fmt.Fprintf(tw, "  Last attestation:\t%s\n", result(a.Attestation, ts))
	fmt.Fprintf(tw, "  Last renewal:\t%s\n", result(a.Renewal.Last, ts))
	if a.Renewal.ConsecutiveFailures > 0 {
		fmt.Fprintf(tw, "  Failures in a row:\t%d, next attempt %s\n", a.Renewal.ConsecutiveFailures, ts(a.Renewal.NextAttempt))
	}
	if !a.ServingRenewal.Last.Time.IsZero() {
		fmt.Fprintf(tw, "  Last serving renewal:\t%s\n", result(a.ServingRenewal.Last, ts))
		if a.ServingRenewal.ConsecutiveFailures > 0 {
			fmt.Fprintf(tw, "  Serving failures in a row:\t%d, next attempt %s\n", a.ServingRenewal.ConsecutiveFailures, ts(a.ServingRenewal.NextAttempt))
		}
	}
	switch {
	case a.MetricsError != "":
		fmt.Fprintf(tw, "  Metrics:\tNOT SERVING: %s (next attempt %s)\n", a.MetricsError, ts(a.MetricsNextAttempt))
	case a.MetricsAddress != "":
		fmt.Fprintf(tw, "  Metrics:\t%s\n", a.MetricsAddress)
	}
}

// writeTrustBundles writes each trust bundle projection; ts formats a time.
func (r *Report) writeTrustBundles(tw io.Writer, ts func(time.Time) string) {
	if len(r.TrustBundles) > 0 {
		fmt.Fprintln(tw, "Trust bundles:")
	}
	for _, b := range r.TrustBundles {
		fresh := "current"
		if b.Stale {
			fresh = "STALE"
		}
		fmt.Fprintf(tw, "  %s\t%s, %d certificates, %s\n", b.Path, b.Source, b.Certificates, fresh)
		if s := b.State; s != nil {
			fmt.Fprintf(tw, "    Sources:\t%s\n", orDash(strings.Join(s.Sources, ", ")))
			fmt.Fprintf(tw, "    Last update:\t%s\n", ts(s.LastUpdate))
			fmt.Fprintf(tw, "    Last sync:\t%s\n", ts(s.LastSync))
			if s.Reason != "" {
				fmt.Fprintf(tw, "    Reason:\t%s\n", s.Reason)
			}
		}
		if !b.Exists {
			fmt.Fprintf(tw, "    File:\tnot written yet\n")
		}
	}
}

func result(r Result, ts func(time.Time) string) string {
	if r.Time.IsZero() {
		return "-"
	}
	if r.Success {
		return fmt.Sprintf("succeeded %s in %s", ts(r.Time), r.Duration)
	}
	return fmt.Sprintf("FAILED %s after %s: %s", ts(r.Time), r.Duration, r.Error)
}

func ago(now, t time.Time) string {
	d := t.Sub(now).Round(time.Second)
	if d >= 0 {
		return "in " + d.String()
	}
	return (-d).String() + " ago"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
