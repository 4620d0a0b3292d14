package shard

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// newRings starts a control plane and joins one Ring per identity to the
// ring "test" in kube-system, all reading one fake clock.
func newRings(t *testing.T, ids ...string) (client.Client, *clocktesting.FakeClock, []*Ring) {
	t.Helper()
	harness.Binaries(t)
	cp := harness.StartControlPlane(t, "shard")
	c, err := client.New(cp.AdminConfig, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	clk := clocktesting.NewFakeClock(time.Now())
	var rings []*Ring
	for _, id := range ids {
		r := &Ring{Client: c, Namespace: metav1.NamespaceSystem, Name: "test", Identity: id, LeaseDuration: 3 * time.Second, Clock: clk}
		if err := r.Join(t.Context()); err != nil {
			t.Fatal(err)
		}
		rings = append(rings, r)
	}
	for _, r := range rings { // everyone sees everyone
		if err := r.tick(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	return c, clk, rings
}

func holderOf(t *testing.T, c client.Client, key string) string {
	t.Helper()
	var l coordinationv1.Lease
	if err := c.Get(t.Context(), client.ObjectKey{Namespace: metav1.NamespaceSystem, Name: ClaimName("test", key)}, &l); err != nil {
		t.Fatal(err)
	}
	return ptr.Deref(l.Spec.HolderIdentity, "")
}

// TestClaim covers the claim's rules against a real API server: replicas
// racing for one claim end with one owner; a live holder keeps it; a
// released claim, or one whose holder's membership expired, is taken; a
// replica back from a break in its membership reads its claims again
// rather than trusting them; and membership follows the Leases.
func TestClaim(t *testing.T) {
	c, clk, rings := newRings(t, "replica-a", "replica-b", "replica-c")
	a, b, cr := rings[0], rings[1], rings[2]
	if got := a.Members(); len(got) != 3 {
		t.Fatalf("members %v, want 3", got)
	}

	t.Run("race", func(t *testing.T) {
		// Every replica claims every key at once: each key has one
		// holder, and every replica was told that holder.
		const keys = 20
		got := make([][]string, len(rings))
		var wg sync.WaitGroup
		for i, r := range rings {
			got[i] = make([]string, keys)
			for k := range keys {
				wg.Add(1)
				go func() {
					defer wg.Done()
					h, err := r.Claim(context.Background(), fmt.Sprintf("race/c%d", k))
					if err != nil {
						t.Errorf("%s: %v", r.Identity, err)
					}
					got[i][k] = h
				}()
			}
		}
		wg.Wait()
		for k := range keys {
			key := fmt.Sprintf("race/c%d", k)
			holder := holderOf(t, c, key)
			for i := range rings {
				if got[i][k] != holder {
					t.Errorf("%s: %s was told holder %q, the claim says %q", key, rings[i].Identity, got[i][k], holder)
				}
			}
		}
	})

	t.Run("live holder keeps it, release hands it over", func(t *testing.T) {
		const key = "ns/held"
		if h, err := a.Claim(t.Context(), key); err != nil || h != a.Identity {
			t.Fatalf("a: holder %q, %v", h, err)
		}
		if h, err := b.Claim(t.Context(), key); err != nil || h != a.Identity {
			t.Fatalf("b took a live holder's claim: holder %q, %v", h, err)
		}
		if err := b.Forget(t.Context(), key); err != nil || holderOf(t, c, key) != a.Identity {
			t.Fatalf("b forgot a live holder's claim: %v", err)
		}
		if err := b.Release(t.Context(), key); err != nil || holderOf(t, c, key) != a.Identity {
			t.Fatalf("b released a's claim: %v", err)
		}
		before := b.Handovers()
		if err := a.Release(t.Context(), key); err != nil {
			t.Fatal(err)
		}
		if h, err := b.Claim(t.Context(), key); err != nil || h != b.Identity {
			t.Fatalf("b after a released: holder %q, %v", h, err)
		}
		if b.Handovers() != before+1 {
			t.Errorf("handovers %d, want %d", b.Handovers(), before+1)
		}
	})

	t.Run("expired holder", func(t *testing.T) {
		const key = "ns/orphan"
		if h, err := cr.Claim(t.Context(), key); err != nil || h != cr.Identity {
			t.Fatalf("c: holder %q, %v", h, err)
		}
		// c stops renewing; a and b go on. Not yet a Lease duration
		// later, c is live and keeps its claim.
		for _, step := range []time.Duration{time.Second, time.Second} {
			clk.Step(step)
			for _, r := range []*Ring{a, b} {
				if err := r.tick(t.Context()); err != nil {
					t.Fatal(err)
				}
			}
		}
		if h, _ := a.Claim(t.Context(), key); h != cr.Identity {
			t.Fatalf("a took the claim of c before its Lease expired: holder %q", h)
		}
		clk.Step(1500 * time.Millisecond)
		for _, r := range []*Ring{a, b} {
			if err := r.tick(t.Context()); err != nil {
				t.Fatal(err)
			}
		}
		if got := a.Members(); len(got) != 2 {
			t.Fatalf("a sees members %v after c's Lease expired", got)
		}
		// c itself stopped counting itself a member before: it serves
		// nothing once the others may take its claims.
		cr.mu.Lock()
		self := cr.liveLocked()
		cr.mu.Unlock()
		for _, m := range self {
			if m == cr.Identity {
				t.Errorf("c still counts itself a member %s after its last renewal", 3500*time.Millisecond)
			}
		}
		for i := range 50 {
			if k := fmt.Sprintf("ns/c%d", i); cr.Mine(k) {
				t.Fatalf("c, past its renew deadline, is still assigned %s", k)
			}
		}
		if _, err := cr.Claim(t.Context(), "ns/new"); err == nil {
			t.Error("c, past its renew deadline, took a claim")
		}
		if h, err := a.Claim(t.Context(), key); err != nil || h != a.Identity {
			t.Fatalf("a after c expired: holder %q, %v", h, err)
		}
		if err := b.Forget(t.Context(), key); err != nil || holderOf(t, c, key) != a.Identity {
			t.Fatalf("b forgot a's claim: %v", err)
		}
		// c comes back: it must not believe it still holds the claim.
		if err := cr.tick(t.Context()); err != nil {
			t.Fatal(err)
		}
		if h, err := cr.Claim(t.Context(), key); err != nil || h != a.Identity {
			t.Fatalf("c after its break: holder %q, %v; want %s", h, err, a.Identity)
		}
		if err := cr.Release(t.Context(), key); err != nil || holderOf(t, c, key) != a.Identity {
			t.Fatalf("c released a's claim: %v", err)
		}
	})

	t.Run("leave", func(t *testing.T) {
		if err := b.Leave(t.Context()); err != nil {
			t.Fatal(err)
		}
		if err := a.tick(t.Context()); err != nil {
			t.Fatal(err)
		}
		// c came back above; b is gone at once, not a Lease later.
		if got := a.Members(); !slices.Equal(got, []string{a.Identity, cr.Identity}) {
			t.Fatalf("a sees members %v after b left", got)
		}
		for i := range 50 {
			if key := fmt.Sprintf("ns/c%d", i); a.Owner(key) == b.Identity {
				t.Fatalf("%s is still assigned to b, which left", key)
			}
		}
	})
}

// TestAssign: keys spread over the members, and a member leaving moves
// only its own keys.
func TestAssign(t *testing.T) {
	members := []string{"a", "b", "c"}
	count := map[string]int{}
	moved := 0
	const keys = 3000
	for i := range keys {
		key := fmt.Sprintf("ns%d/cluster-%d", i%7, i)
		owner := Assign(key, members)
		count[owner]++
		after := Assign(key, []string{"a", "c"})
		if owner != "b" && after != owner {
			t.Fatalf("%s moved from %s to %s when b left", key, owner, after)
		}
		if owner == "b" {
			moved++
		}
	}
	for _, m := range members {
		if count[m] < keys/3*8/10 || count[m] > keys/3*12/10 {
			t.Errorf("member %s has %d of %d keys, want about a third", m, count[m], keys)
		}
	}
	if moved != count["b"] {
		t.Errorf("moved %d, b had %d", moved, count["b"])
	}
	if Assign("k", nil) != "" {
		t.Error("a key is assigned with no member")
	}
}
