package challengekey

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

const overlap = 70 * time.Minute

// apiserver starts a kube-apiserver and returns a client of it.
func apiserver(t *testing.T, name string) client.WithWatch {
	t.Helper()
	if testing.Short() {
		t.Skip("needs kube-apiserver")
	}
	cp := harness.StartControlPlane(t, name)
	c, err := client.NewWithWatch(cp.AdminConfig, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func readSet(t *testing.T, c client.Client, nn types.NamespacedName) (*Set, *corev1.Secret) {
	t.Helper()
	var s corev1.Secret
	if err := c.Get(context.Background(), nn, &s); err != nil {
		t.Fatal(err)
	}
	set, err := FromSecret(&s)
	if err != nil {
		t.Fatal(err)
	}
	return set, &s
}

func ids(s *Set) []string {
	var out []string
	for _, k := range s.Keys {
		out = append(out, k.ID)
	}
	return out
}

// TestRotateOnDemandAndOnSchedule: the Secret is made with one key; the
// rotate annotation makes a new current key at the next sync (the previous
// one kept, the annotation gone); the interval makes another; a retired key
// is dropped once the overlap has passed, and a challenge naming it is then
// refused as rotated out.
func TestRotateOnDemandAndOnSchedule(t *testing.T) {
	c := apiserver(t, "challengekey-rotate")
	ctx := context.Background()
	nn := types.NamespacedName{Namespace: "default", Name: "challenge-keys"}
	clk := clocktesting.NewFakePassiveClock(time.Now().Truncate(time.Second))
	r := &Rotator{Client: c, Secret: nn, Ring: &Ring{}, Interval: 24 * time.Hour, Overlap: overlap, Clock: clk}

	if _, err := r.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if id, key := r.Ring.Current(); id != "k1" || len(key) != KeySize {
		t.Fatalf("new Secret: current key %q of %d bytes, want k1", id, len(key))
	}
	k1, _ := r.Ring.Key("k1")
	clk.SetTime(clk.Now().Add(time.Hour))
	if rotated, err := r.Sync(ctx); err != nil || rotated {
		t.Fatalf("rotated %v (%v) before the interval and without being asked", rotated, err)
	}

	// On demand: kubectl annotate secret challenge-keys <AnnotationRotate>=now
	_, s := readSet(t, c, nn)
	s.Annotations[AnnotationRotate] = "now"
	if err := c.Update(ctx, s); err != nil {
		t.Fatal(err)
	}
	if rotated, err := r.Sync(ctx); err != nil || !rotated {
		t.Fatalf("asked to rotate: rotated %v, %v", rotated, err)
	}
	set, s := readSet(t, c, nn)
	if got := ids(set); len(got) != 2 || got[0] != "k2" || got[1] != "k1" {
		t.Fatalf("after the on-demand rotation the Secret holds %v, want [k2 k1]", got)
	}
	if _, asked := s.Annotations[AnnotationRotate]; asked {
		t.Error("the rotate annotation was left on the Secret: every sync would rotate again")
	}
	if id, _ := r.Ring.Current(); id != "k2" {
		t.Errorf("the ring's current key is %q, want k2", id)
	}
	if key, err := r.Ring.Key("k1"); err != nil || !bytes.Equal(key, k1) {
		t.Errorf("the previous key is not kept for the challenges in flight: %v", err)
	}

	// On schedule: a day after k2 became current.
	clk.SetTime(clk.Now().Add(24 * time.Hour))
	if rotated, err := r.Sync(ctx); err != nil || !rotated {
		t.Fatalf("interval passed: rotated %v, %v", rotated, err)
	}
	// k1 was retired more than the overlap ago: dropped; k2 kept.
	set, _ = readSet(t, c, nn)
	if got := ids(set); len(got) != 2 || got[0] != "k3" || got[1] != "k2" {
		t.Fatalf("after the scheduled rotation the Secret holds %v, want [k3 k2]", got)
	}
	if _, err := r.Ring.Key("k1"); !errors.Is(err, attestor.ErrChallengeKeyRetired) {
		t.Errorf("a challenge under the dropped key k1: %v, want it refused as rotated out", err)
	}
	// And once the overlap has passed, k2 goes too, without a rotation.
	clk.SetTime(clk.Now().Add(overlap))
	if rotated, err := r.Sync(ctx); err != nil || rotated {
		t.Fatalf("dropping k2: rotated %v, %v", rotated, err)
	}
	if set, _ = readSet(t, c, nn); len(set.Keys) != 1 || set.Keys[0].ID != "k3" {
		t.Errorf("after the overlap the Secret holds %v, want [k3]", ids(set))
	}
}

// TestRotatorsRace: two replicas find the key due at the same moment and
// both try to rotate; the conditional update lets one win, the other adopts
// its key, and the Secret holds exactly one new key.
func TestRotatorsRace(t *testing.T) {
	c := apiserver(t, "challengekey-race")
	ctx := context.Background()
	nn := types.NamespacedName{Namespace: "default", Name: "challenge-keys"}
	clk := clocktesting.NewFakePassiveClock(time.Now().Truncate(time.Second))
	seed := &Rotator{Client: c, Secret: nn, Ring: &Ring{}, Interval: time.Hour, Overlap: overlap, Clock: clk}
	if _, err := seed.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	clk.SetTime(clk.Now().Add(2 * time.Hour))

	// Both replicas have read the Secret before either writes.
	var arrived sync.WaitGroup
	arrived.Add(2)
	barrier := interceptor.Funcs{Update: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.UpdateOption) error {
		arrived.Done()
		arrived.Wait()
		return c.Update(ctx, obj, opts...)
	}}
	replicas := []*Rotator{
		{Client: interceptor.NewClient(c, barrier), Secret: nn, Ring: &Ring{}, Interval: time.Hour, Overlap: overlap, Clock: clk},
		{Client: interceptor.NewClient(c, barrier), Secret: nn, Ring: &Ring{}, Interval: time.Hour, Overlap: overlap, Clock: clk},
	}
	results := make([]bool, 2)
	errs := make([]error, 2)
	var done sync.WaitGroup
	for i, r := range replicas {
		done.Add(1)
		go func() {
			defer done.Done()
			results[i], errs[i] = r.Sync(ctx)
		}()
	}
	done.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if results[0] == results[1] {
		t.Fatalf("rotated: %v; want exactly one replica to rotate", results)
	}
	set, _ := readSet(t, c, nn)
	if got := ids(set); len(got) != 2 || got[0] != "k2" {
		t.Fatalf("the Secret holds %v, want one rotation: [k2 k1]", got)
	}
	for i, r := range replicas {
		id, key := r.Ring.Current()
		if id != "k2" || !bytes.Equal(key, set.Keys[0].Secret) {
			t.Errorf("replica %d seals under %s %x…, not the Secret's current key", i, id, key[:4])
		}
	}
}

// TestUpgradeFromSingleKey: the first format (an immutable Secret with one
// key) is read as the legacy key k0, its challenges stay answerable after
// the first rotation, which replaces the Secret with the key set.
func TestUpgradeFromSingleKey(t *testing.T) {
	c := apiserver(t, "challengekey-upgrade")
	ctx := context.Background()
	nn := types.NamespacedName{Namespace: "default", Name: "challenge-keys"}
	legacy := bytes.Repeat([]byte{0x5a}, 32)
	if err := c.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: nn.Namespace, Name: nn.Name},
		Data:       map[string][]byte{LegacyDataKey: legacy},
		Immutable:  new(true),
	}); err != nil {
		t.Fatal(err)
	}
	clk := clocktesting.NewFakePassiveClock(time.Now().Truncate(time.Second))
	r := &Rotator{Client: c, Secret: nn, Ring: &Ring{}, Interval: 24 * time.Hour, Overlap: overlap, Clock: clk}
	if _, err := r.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if id, key := r.Ring.Current(); id != attestor.LegacyChallengeKeyID || !bytes.Equal(key, legacy) {
		t.Fatalf("first-format Secret read as %s %x", id, key)
	}
	clk.SetTime(clk.Now().Add(25 * time.Hour))
	if rotated, err := r.Sync(ctx); err != nil || !rotated {
		t.Fatalf("rotating the first-format Secret: %v, %v", rotated, err)
	}
	set, s := readSet(t, c, nn)
	if got := ids(set); len(got) != 2 || got[0] != "k1" || got[1] != attestor.LegacyChallengeKeyID {
		t.Fatalf("after the first rotation the Secret holds %v, want [k1 k0]", got)
	}
	if s.Immutable != nil && *s.Immutable {
		t.Error("the key set Secret is immutable: it could never rotate again")
	}
	if key, err := r.Ring.Key(attestor.LegacyChallengeKeyID); err != nil || !bytes.Equal(key, legacy) {
		t.Errorf("the legacy key is not kept for the challenges in flight: %v", err)
	}
}
