package rotation

import (
	"crypto/x509"
	"math/rand/v2"
	"testing"
	"time"
)

func TestPoints(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	c := &x509.Certificate{NotBefore: t0, NotAfter: t0.Add(100 * time.Minute)}
	if m := Margin(c); m != 5*time.Minute {
		t.Fatalf("margin %v", m)
	}
	short := &x509.Certificate{NotBefore: t0, NotAfter: t0.Add(10 * time.Minute)}
	if m := Margin(short); m != time.Minute {
		t.Fatalf("short margin %v", m)
	}
	for _, tc := range []struct {
		at            time.Duration
		usable, fresh bool
	}{
		{-time.Second, false, false},
		{0, true, true},
		{89 * time.Minute, true, true},
		{90 * time.Minute, true, false},
		{94*time.Minute + 59*time.Second, true, false},
		{95 * time.Minute, false, false},
		{101 * time.Minute, false, false},
	} {
		now := t0.Add(tc.at)
		if Usable(c, now) != tc.usable || Fresh(c, now) != tc.fresh {
			t.Errorf("at %v: usable=%v fresh=%v, want %v %v", tc.at, Usable(c, now), Fresh(c, now), tc.usable, tc.fresh)
		}
	}
	if e := Expiration(c); !e.Equal(t0.Add(90 * time.Minute)) {
		t.Fatalf("expiration %v", e)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 1000 {
		j := JitteredRenewal(c, r).Sub(t0)
		if j < 70*time.Minute || j > 90*time.Minute {
			t.Fatalf("jittered renewal at %v, outside 70-90%%", j)
		}
	}
}
