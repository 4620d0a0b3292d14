// Package rotation decides when a kubelet client certificate may still be
// handed out and when it is due for renewal.
//
// Three points on a certificate's lifetime matter:
//
//   - the agent renews at a jittered point between 70% and 90% of it (like
//     client-go's certificate manager), so that a fleet does not renew at once;
//   - past RenewBy (90%) the exec plugin renews itself rather than rely on an
//     agent that may not be running;
//   - within Margin of NotAfter the certificate is no longer handed out at all.
package rotation

import (
	"crypto/x509"
	"math/rand/v2"
	"time"
)

const (
	// MaxMargin caps Margin.
	MaxMargin = 5 * time.Minute
	// renewByFraction is the point of the lifetime past which the exec
	// plugin renews by itself.
	renewByFraction = 0.9
	// jitterLow and jitterHigh bound the agent's renewal point.
	jitterLow, jitterHigh = 0.7, 0.9
)

func lifetime(c *x509.Certificate) time.Duration { return c.NotAfter.Sub(c.NotBefore) }

// Margin is how long before NotAfter a certificate stops being handed out:
// a tenth of its lifetime, at most MaxMargin.
func Margin(c *x509.Certificate) time.Duration {
	return min(lifetime(c)/10, MaxMargin)
}

// Usable reports whether c may be handed to kubelet at now.
func Usable(c *x509.Certificate, now time.Time) bool {
	return !now.Before(c.NotBefore) && now.Before(c.NotAfter.Add(-Margin(c)))
}

// RenewBy is the point past which the exec plugin renews c itself.
func RenewBy(c *x509.Certificate) time.Time {
	return c.NotBefore.Add(time.Duration(float64(lifetime(c)) * renewByFraction))
}

// Fresh reports whether c is usable and not yet due for renewal at now.
func Fresh(c *x509.Certificate, now time.Time) bool {
	return Usable(c, now) && now.Before(RenewBy(c))
}

// Expiration is the expirationTimestamp to report for c: the exec plugin is
// asked again no later than RenewBy, and never after the margin begins.
func Expiration(c *x509.Certificate) time.Time {
	end := c.NotAfter.Add(-Margin(c))
	if r := RenewBy(c); r.Before(end) {
		return r
	}
	return end
}

// JitteredRenewal returns the agent's renewal point for c: uniformly
// between 70% and 90% of its lifetime. r may be nil for the default source.
func JitteredRenewal(c *x509.Certificate, r *rand.Rand) time.Time {
	f := rand.Float64
	if r != nil {
		f = r.Float64
	}
	frac := jitterLow + (jitterHigh-jitterLow)*f()
	return c.NotBefore.Add(time.Duration(float64(lifetime(c)) * frac))
}
