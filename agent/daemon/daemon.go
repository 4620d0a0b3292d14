// Package daemon is the agent's certificate renewal loop: it renews a
// kubelet certificate with fresh attestation at a jittered point of its
// lifetime (see agent/rotation). For the client certificate it goes through
// the same cache and lock as the exec credential plugin, so that the plugin
// always finds a fresh certificate and never has to wait for a CSR; the
// serving certificate (agent/serving) runs the same loop. A failed renewal
// keeps the current certificate and is retried with capped exponential
// backoff.
//
// The package neither logs nor imports Prometheus: it reports through the
// small interfaces and callbacks of Renewal, which agent/app and
// agent/metrics implement.
package daemon

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/rotation"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Heartbeat is the longest the loop sleeps without looking at the cache
// again (another process may have renewed or removed the certificate).
const Heartbeat = 30 * time.Second

// ErrNotRenewed is the error of an attempt after which the cache still
// holds the certificate it held before: the renewer kept a working
// certificate rather than fail.
var ErrNotRenewed = errors.New("certificate not renewed; keeping the current one")

// Renewer obtains a new credential even when the cached one is fresh.
// *credential.Source is one: it holds the cache lock, attests, files the
// CSR, waits for it and stores the result.
type Renewer interface {
	Renew(ctx context.Context) (*cache.Credential, time.Time, error)
}

// The metric shapes the loop reports to.
type (
	// Gauge is a metric the loop sets.
	Gauge interface{ Set(float64) }
	// Counter is a metric the loop increments.
	Counter interface{ Inc() }
	// Histogram is a metric the loop observes durations with.
	Histogram interface{ Observe(float64) }
)

// Metrics are the loop's metrics; nil fields are not reported.
type Metrics struct {
	// CertificateExpiration is set to the current certificate's NotAfter
	// in Unix seconds.
	CertificateExpiration Gauge
	// RenewalSuccess and RenewalFailure count attempts by result.
	RenewalSuccess, RenewalFailure Counter
	// RenewalDuration observes each attempt, in seconds.
	RenewalDuration Histogram
}

// Attempt is the outcome of one renewal attempt.
type Attempt struct {
	Start    time.Time
	Duration time.Duration
	// Err is nil when a new certificate was stored.
	Err error
	// Certificate is the current certificate after the attempt (nil when
	// there is none).
	Certificate *x509.Certificate
	// ConsecutiveFailures counts failed attempts since the last success,
	// this one included; NextAttempt is when the loop tries again.
	ConsecutiveFailures int
	NextAttempt         time.Time
}

// Renewal is the loop. Fields are set before Run and not changed after.
type Renewal struct {
	Renewer Renewer
	// Load reads the cached credential (cache.Dir.Load).
	Load func() (*cache.Credential, error)
	// NodeName is the node the certificate must be for.
	NodeName string
	// Stale, when set, reports a usable certificate that must be replaced
	// now rather than at its renewal point, because it no longer matches
	// what is configured (the serving certificate's addresses). It is kept
	// until a new one is stored.
	Stale func(*x509.Certificate) bool
	// RetryInitial is the wait after a first failure; it doubles up to
	// RetryMax.
	RetryInitial, RetryMax time.Duration
	// Clock and Rand default to the real clock and the default source.
	Clock   clock.Clock
	Rand    *rand.Rand
	Metrics Metrics
	// OnAttempt is called after every attempt.
	OnAttempt func(Attempt)
	// OnSchedule is called whenever the current certificate or the time of
	// the next attempt changes.
	OnSchedule func(cert *x509.Certificate, next time.Time)
	// OnReady is called once, as soon as the loop holds a usable
	// certificate for NodeName (found in the cache or just obtained): what
	// systemd's READY means for the agent. A node that has none, and cannot
	// get one yet (no bootstrap credential before kubeadm join, the signer
	// unreachable or denying), is not ready.
	OnReady func()
	// OnWaiting is called at every wake-up before OnReady: the loop runs
	// but holds no usable certificate. The agent extends systemd's start
	// timeout with it.
	OnWaiting func()

	beat atomic.Int64
}

func (r *Renewal) clock() clock.Clock {
	if r.Clock == nil {
		return clock.RealClock{}
	}
	return r.Clock
}

// LastBeat is when the loop last woke up; a health check compares it with
// Heartbeat.
func (r *Renewal) LastBeat() time.Time { return time.Unix(0, r.beat.Load()) }

// Backoff returns the wait after the n-th consecutive failure (n >= 1).
func (r *Renewal) Backoff(n int) time.Duration {
	d := r.RetryInitial
	if d <= 0 {
		d = time.Second
	}
	for i := 1; i < n && d < r.RetryMax; i++ {
		d *= 2
	}
	if r.RetryMax > 0 && d > r.RetryMax {
		d = r.RetryMax
	}
	return d
}

// Run renews until ctx is done; it returns nil then. An attempt in
// progress is cancelled by ctx: the cache keeps the key of a filed CSR, so
// the next run picks the same request up.
func (r *Renewal) Run(ctx context.Context) error {
	clk := r.clock()
	var (
		serial      string    // of the certificate point belongs to
		point       time.Time // its jittered renewal point
		failures    int
		retryAt     time.Time
		ready       bool
		lastCert    *x509.Certificate
		lastNext    time.Time
		scheduleSet bool
	)
	for {
		now := clk.Now()
		r.beat.Store(now.UnixNano())
		cred, err := r.Load()
		var cert *x509.Certificate
		if err == nil && cred.Leaf.Subject.CommonName == attestor.NodeUserPrefix+r.NodeName {
			cert = cred.Leaf
		}
		if cert != nil && r.Metrics.CertificateExpiration != nil {
			r.Metrics.CertificateExpiration.Set(float64(cert.NotAfter.Unix()))
		}
		if cert != nil && cert.SerialNumber.String() != serial {
			serial = cert.SerialNumber.String()
			point = rotation.JitteredRenewal(cert, r.Rand)
			failures, retryAt = 0, time.Time{}
		}
		due := now
		if cert != nil && rotation.Usable(cert, now) && (r.Stale == nil || !r.Stale(cert)) {
			due = point
		}
		if failures > 0 && retryAt.After(due) {
			due = retryAt
		}
		if !scheduleSet || !sameCert(cert, lastCert) || !due.Equal(lastNext) {
			scheduleSet, lastCert, lastNext = true, cert, due
			if r.OnSchedule != nil {
				r.OnSchedule(cert, due)
			}
		}
		switch {
		case ready:
		case cert != nil && rotation.Usable(cert, now):
			ready = true
			if r.OnReady != nil {
				r.OnReady()
			}
		case r.OnWaiting != nil:
			r.OnWaiting()
		}
		if !now.Before(due) {
			a := r.attempt(ctx, cert)
			if ctx.Err() != nil {
				return nil
			}
			if a.Err != nil {
				failures++
				retryAt = clk.Now().Add(r.Backoff(failures))
				a.ConsecutiveFailures, a.NextAttempt = failures, retryAt
			}
			if r.OnAttempt != nil {
				r.OnAttempt(a)
			}
			continue
		}
		t := clk.NewTimer(min(due.Sub(now), Heartbeat))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C():
		}
	}
}

func sameCert(a, b *x509.Certificate) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Equal(b)
}

// attempt renews once. before is the current certificate, if any.
func (r *Renewal) attempt(ctx context.Context, before *x509.Certificate) Attempt {
	clk := r.clock()
	a := Attempt{Start: clk.Now(), Certificate: before}
	cred, _, err := r.Renewer.Renew(ctx)
	a.Duration = clk.Since(a.Start)
	switch {
	case err != nil:
		a.Err = fmt.Errorf("%w: %w", ErrNotRenewed, err)
	case cred == nil:
		a.Err = ErrNotRenewed
	default:
		a.Certificate = cred.Leaf
	}
	if ctx.Err() != nil {
		return a
	}
	if r.Metrics.RenewalDuration != nil {
		r.Metrics.RenewalDuration.Observe(a.Duration.Seconds())
	}
	if a.Err != nil {
		if r.Metrics.RenewalFailure != nil {
			r.Metrics.RenewalFailure.Inc()
		}
	} else if r.Metrics.RenewalSuccess != nil {
		r.Metrics.RenewalSuccess.Inc()
	}
	return a
}
