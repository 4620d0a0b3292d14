package daemon

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math/big"
	mrand "math/rand/v2"
	"sync"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/rotation"
)

var serial int64

func leaf(t *testing.T, notBefore time.Time, lifetime time.Duration) *x509.Certificate {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	serial++
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "system:node:n1"}, NotBefore: notBefore, NotAfter: notBefore.Add(lifetime)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := x509.ParseCertificate(der)
	return c
}

// fakeSource is a cache and a signer: Renew issues a new certificate at the
// fake clock's time, or fails and keeps the current one as credential.Source does.
type fakeSource struct {
	t        *testing.T
	clock    *clocktesting.FakeClock
	mu       sync.Mutex
	current  *cache.Credential
	fail     bool
	attempts []time.Time
}

func (f *fakeSource) Load() (*cache.Credential, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.current == nil {
		return nil, cache.ErrNotFound
	}
	return f.current, nil
}

func (f *fakeSource) Renew(context.Context) (*cache.Credential, time.Time, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.attempts = append(f.attempts, f.clock.Now())
	if f.fail {
		return nil, time.Time{}, errors.New("signer down")
	}
	f.current = &cache.Credential{Leaf: leaf(f.t, f.clock.Now(), time.Hour)}
	return f.current, time.Time{}, nil
}

func (f *fakeSource) set(fail bool) { f.mu.Lock(); f.fail = fail; f.mu.Unlock() }
func (f *fakeSource) count() int    { f.mu.Lock(); defer f.mu.Unlock(); return len(f.attempts) }

type counter struct{ n int }

func (c *counter) Inc() { c.n++ }

// TestRenewalSchedule: the loop gets a certificate at once when there is
// none, renews at the jittered point (70-90%), retries failures with
// doubling backoff capped at RetryMax while keeping the current
// certificate, and resets the backoff after a success.
func TestRenewalSchedule(t *testing.T) {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clk := clocktesting.NewFakeClock(start)
	src := &fakeSource{t: t, clock: clk}
	var mu sync.Mutex
	var attempts []Attempt
	var next time.Time
	success, failure := &counter{}, &counter{}
	r := &Renewal{
		Renewer: src, Load: src.Load, NodeName: "n1",
		RetryInitial: 10 * time.Second, RetryMax: 40 * time.Second,
		Clock: clk, Rand: mrand.New(mrand.NewPCG(1, 2)),
		Metrics:    Metrics{RenewalSuccess: success, RenewalFailure: failure},
		OnAttempt:  func(a Attempt) { mu.Lock(); attempts = append(attempts, a); mu.Unlock() },
		OnSchedule: func(_ *x509.Certificate, at time.Time) { mu.Lock(); next = at; mu.Unlock() },
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()

	// waitAttempts waits until the loop has made n attempts and sleeps again.
	waitAttempts := func(n int) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for src.count() < n || !clk.HasWaiters() {
			if time.Now().After(deadline) {
				t.Fatalf("waiting for attempt %d: have %d", n, src.count())
			}
			time.Sleep(time.Millisecond)
		}
	}
	// advanceTo steps the fake clock to at in steps no longer than the
	// loop's heartbeat, letting it wake up each time.
	advanceTo := func(at time.Time) {
		t.Helper()
		for clk.Now().Before(at) {
			step := min(at.Sub(clk.Now()), Heartbeat)
			for !clk.HasWaiters() {
				time.Sleep(time.Millisecond)
			}
			clk.Step(step)
		}
	}

	waitAttempts(1) // no certificate: at once
	first, _ := src.Load()
	point := rotation.JitteredRenewal(first.Leaf, mrand.New(mrand.NewPCG(1, 2)))
	if f := float64(point.Sub(first.Leaf.NotBefore)) / float64(time.Hour); f < 0.7 || f > 0.9 {
		t.Fatalf("renewal point at %.2f of the lifetime", f)
	}
	advanceTo(point.Add(-time.Second))
	if src.count() != 1 {
		t.Fatalf("renewed before the jittered point")
	}
	advanceTo(point)
	waitAttempts(2)
	if !src.attempts[1].Equal(point) {
		t.Fatalf("renewed at %s, want %s", src.attempts[1], point)
	}

	// Failures: backoff 10s, 20s, 40s, 40s; the certificate stays.
	second, _ := src.Load()
	src.set(true)
	mu.Lock()
	due := next
	mu.Unlock()
	if f := float64(due.Sub(second.Leaf.NotBefore)) / float64(time.Hour); f < 0.7 || f > 0.9 {
		t.Fatalf("second renewal scheduled at %.2f of the lifetime", f)
	}
	advanceTo(due)
	waitAttempts(3)
	for i, wait := range []time.Duration{10 * time.Second, 20 * time.Second, 40 * time.Second, 40 * time.Second} {
		before := clk.Now()
		advanceTo(before.Add(wait - time.Millisecond))
		if src.count() != 3+i {
			t.Fatalf("retry %d came before its backoff of %s", i+1, wait)
		}
		advanceTo(before.Add(wait))
		waitAttempts(4 + i)
	}
	if cur, _ := src.Load(); cur != second {
		t.Fatal("a failed renewal replaced the certificate")
	}
	mu.Lock()
	last := attempts[len(attempts)-1]
	mu.Unlock()
	if !errors.Is(last.Err, ErrNotRenewed) || last.ConsecutiveFailures != 5 || last.Err.Error() != ErrNotRenewed.Error()+": signer down" {
		t.Fatalf("last attempt %+v", last)
	}
	// Recovery resets the backoff.
	src.set(false)
	advanceTo(clk.Now().Add(40 * time.Second))
	waitAttempts(8)
	if success.n != 3 || failure.n != 5 {
		t.Fatalf("successes %d failures %d, want 3 and 5", success.n, failure.n)
	}
}

func TestBackoff(t *testing.T) {
	r := &Renewal{RetryInitial: time.Second, RetryMax: 5 * time.Second}
	for n, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 5 * time.Second, 50: 5 * time.Second} {
		if got := r.Backoff(n); got != want {
			t.Errorf("Backoff(%d) = %s, want %s", n, got, want)
		}
	}
}

// TestRenewalStale: a usable certificate that no longer matches the
// configuration (Stale) is replaced at once rather than at its renewal
// point, and a failure to replace it keeps it and backs off.
func TestRenewalStale(t *testing.T) {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clk := clocktesting.NewFakeClock(start)
	src := &fakeSource{t: t, clock: clk}
	old := &cache.Credential{Leaf: leaf(t, start, time.Hour)}
	src.current = old
	var mu sync.Mutex
	stale := map[string]bool{old.Leaf.SerialNumber.String(): true}
	src.set(true)
	r := &Renewal{
		Renewer: src, Load: src.Load, NodeName: "n1",
		RetryInitial: 10 * time.Second, RetryMax: 40 * time.Second, Clock: clk,
		Stale: func(c *x509.Certificate) bool { mu.Lock(); defer mu.Unlock(); return stale[c.SerialNumber.String()] },
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitAttempts := func(n int) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for src.count() < n || !clk.HasWaiters() {
			if time.Now().After(deadline) {
				t.Fatalf("waiting for attempt %d: have %d", n, src.count())
			}
			time.Sleep(time.Millisecond)
		}
	}
	waitAttempts(1)
	if !src.attempts[0].Equal(start) {
		t.Fatalf("stale certificate renewed at %s, want at once (%s)", src.attempts[0], start)
	}
	if cur, _ := src.Load(); cur != old {
		t.Fatal("a failed renewal replaced the stale certificate")
	}
	// The failure backs off (10s) instead of spinning.
	clk.Step(9 * time.Second)
	time.Sleep(20 * time.Millisecond)
	if src.count() != 1 {
		t.Fatalf("retried a stale certificate before its backoff: %d attempts", src.count())
	}
	src.set(false)
	clk.Step(time.Second)
	waitAttempts(2)
	// The new certificate is not stale: nothing more until its renewal point.
	clk.Step(Heartbeat)
	time.Sleep(20 * time.Millisecond)
	for !clk.HasWaiters() {
		time.Sleep(time.Millisecond)
	}
	if src.count() != 2 {
		t.Fatalf("renewed a current certificate again: %d attempts", src.count())
	}
}

// TestRenewalReadyOnlyWithCertificate: the loop reports ready (systemd's
// READY) only once it holds a usable certificate for its node: at once
// when the cache has one; never while attempts fail, or while the cache
// holds another node's or an expired certificate (it reports waiting
// instead); and once, as soon as an attempt stores one.
func TestRenewalReadyOnlyWithCertificate(t *testing.T) {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name   string
		cached func() *cache.Credential
		// failures is how many attempts fail before one succeeds.
		failures int
		// readyAt is the attempt count when ready is reported.
		readyAt int
	}{
		{name: "usable certificate in the cache", cached: func() *cache.Credential { return &cache.Credential{Leaf: leaf(t, start, time.Hour)} }, readyAt: 0},
		{name: "no certificate, signer down twice", failures: 2, readyAt: 3},
		{name: "expired certificate", cached: func() *cache.Credential { return &cache.Credential{Leaf: leaf(t, start.Add(-2*time.Hour), time.Hour)} }, failures: 1, readyAt: 2},
		{name: "another node's certificate", cached: func() *cache.Credential {
			c := leaf(t, start, time.Hour)
			c.Subject.CommonName = "system:node:other"
			return &cache.Credential{Leaf: c}
		}, readyAt: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := clocktesting.NewFakeClock(start)
			src := &fakeSource{t: t, clock: clk}
			if tc.cached != nil {
				src.current = tc.cached()
			}
			src.set(tc.failures > 0)
			var mu sync.Mutex
			readyAfter, ready, waiting := -1, 0, 0
			r := &Renewal{
				Renewer: src, Load: src.Load, NodeName: "n1",
				RetryInitial: 10 * time.Second, RetryMax: 10 * time.Second, Clock: clk,
				OnReady: func() {
					mu.Lock()
					defer mu.Unlock()
					ready++
					readyAfter = src.count()
				},
				OnWaiting: func() { mu.Lock(); waiting++; mu.Unlock() },
				OnAttempt: func(Attempt) {
					if src.count() >= tc.failures {
						src.set(false)
					}
				},
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error)
			go func() { done <- r.Run(ctx) }()
			defer func() { cancel(); <-done }()
			deadline := time.Now().Add(10 * time.Second)
			for {
				mu.Lock()
				r, w := ready, waiting
				mu.Unlock()
				if r > 0 {
					break
				}
				if src.count() > tc.readyAt {
					t.Fatalf("not ready after %d attempts", src.count())
				}
				if w == 0 && src.count() > 0 {
					t.Fatal("an attempt without a certificate was not reported as waiting")
				}
				if time.Now().After(deadline) {
					t.Fatalf("not ready after %d attempts (want ready after %d)", src.count(), tc.readyAt)
				}
				if clk.HasWaiters() {
					clk.Step(10 * time.Second)
				}
				time.Sleep(time.Millisecond)
			}
			// Let the loop go on: ready is reported once.
			for range 3 {
				for !clk.HasWaiters() {
					time.Sleep(time.Millisecond)
				}
				clk.Step(Heartbeat)
			}
			time.Sleep(20 * time.Millisecond)
			mu.Lock()
			defer mu.Unlock()
			if ready != 1 || readyAfter != tc.readyAt {
				t.Errorf("ready reported %d times, after %d attempts; want once, after %d", ready, readyAfter, tc.readyAt)
			}
			if cred, _ := src.Load(); cred == nil || !rotation.Usable(cred.Leaf, clk.Now()) {
				t.Errorf("ready without a usable certificate in the cache")
			}
			if (tc.readyAt == 0) != (waiting == 0) {
				t.Errorf("waiting reported %d times; want it only before a certificate", waiting)
			}
		})
	}
}
