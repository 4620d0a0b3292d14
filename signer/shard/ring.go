// Package shard shares keys (the opted-in Clusters) among the replicas of
// a controller with Kubernetes primitives only: every replica holds a
// membership Lease in the controller's namespace, labelled with its ring;
// the live members are the Leases seen renewed within their duration; a key
// is assigned by rendezvous (highest random weight) hashing over the live
// members; and a replica serves a key only while it holds the key's claim,
// a Lease taken by a write conditional on its resourceVersion, from a
// holder that released it or whose membership Lease expired. Two replicas
// that disagree about the membership never both hold a claim.
package shard

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// Labels and annotations of the ring's Leases.
const (
	// LabelRing names the ring a Lease belongs to.
	LabelRing = "kubelet-authenticator.x-k8s.io/ring"
	// LabelKind says what a Lease of the ring is: KindMember or KindClaim.
	LabelKind = "kubelet-authenticator.x-k8s.io/shard-lease"
	// AnnotationKey is the key a claim Lease is for (namespace/name of a
	// Cluster): claim Leases are named by a hash of it.
	AnnotationKey = "kubelet-authenticator.x-k8s.io/key"
)

// Values of LabelKind.
const (
	KindMember = "member"
	KindClaim  = "claim"
)

// DefaultLeaseDuration is how long a membership Lease lasts without being
// renewed; it is renewed every third of it.
const DefaultLeaseDuration = 15 * time.Second

// Metrics counts what a replica does with the ring; may be nil.
type Metrics interface {
	// Handover counts a claim this replica took from a holder that
	// released it or whose membership expired.
	Handover()
}

// Ring is one replica's view of its ring and its claims. Join, then Run,
// then Leave; Mine, Claim, Release and Forget are safe for concurrent use.
type Ring struct {
	// Client reads and writes the Leases; it should not be cached (the
	// membership is read with a list each period).
	Client client.Client
	// Namespace holds the Leases: the controller's own.
	Namespace string
	// Name is the ring (a label value): replicas of one ring share keys.
	Name string
	// Identity names this replica and its membership Lease (a DNS
	// subdomain name).
	Identity string
	// LeaseDuration; 0 means DefaultLeaseDuration.
	LeaseDuration time.Duration
	// Changed, when set, is called (from Run's goroutine) when the live
	// members as seen here change: every key's assignment may have moved.
	Changed func()
	// Metrics; may be nil.
	Metrics Metrics
	// Clock; nil means the real clock.
	Clock clock.PassiveClock

	mu sync.Mutex
	// own is this replica's membership Lease as last written.
	own *coordinationv1.Lease
	// renewed is when own was last written (this replica's clock).
	renewed time.Time
	// seen are the other members' Leases: the resourceVersion last seen
	// and when it was first seen (this replica's clock), so that expiry
	// never compares another host's clock with ours.
	seen map[string]sighting
	// listed is when the members were last listed.
	listed time.Time
	live   []string
	joined bool
	// held are the keys whose claim this replica may hold: true when it
	// took the claim and has been a member without a break since (only
	// this replica releases its claims, so it need not read them again);
	// false when it must read the claim to know (a write whose outcome is
	// unknown, or it stopped counting itself a member since, and others
	// may have taken its claims).
	held map[string]bool

	handovers atomic.Int64
}

type sighting struct {
	rv       string
	at       time.Time
	duration time.Duration
}

// Validate says what is wrong with r's configuration.
func (r *Ring) Validate() error {
	var errs []error
	if r.Client == nil {
		errs = append(errs, errors.New("no client"))
	}
	if r.Namespace == "" {
		errs = append(errs, errors.New("no namespace"))
	}
	for _, msg := range validation.IsValidLabelValue(r.Name) {
		errs = append(errs, fmt.Errorf("ring name %q: %s", r.Name, msg))
	}
	if r.Name == "" {
		errs = append(errs, errors.New("no ring name"))
	}
	for _, msg := range validation.IsDNS1123Subdomain(r.Identity) {
		errs = append(errs, fmt.Errorf("identity %q: %s", r.Identity, msg))
	}
	if r.LeaseDuration < 0 || (r.LeaseDuration > 0 && r.LeaseDuration < 3*time.Second) {
		errs = append(errs, fmt.Errorf("lease duration %s: at least 3s", r.LeaseDuration))
	}
	return errors.Join(errs...)
}

func (r *Ring) duration() time.Duration { return cmp.Or(r.LeaseDuration, DefaultLeaseDuration) }

// period is how often the membership Lease is renewed and the members
// listed.
func (r *Ring) period() time.Duration { return r.duration() / 3 }

// renewDeadline is how long after its last renewal this replica still
// counts itself a member: well before any other replica can see its Lease
// expire (a full duration after it last saw it change), so that it stops
// serving before its claims can be taken.
func (r *Ring) renewDeadline() time.Duration { return r.duration() * 2 / 3 }

func (r *Ring) now() time.Time {
	if r.Clock == nil {
		return time.Now()
	}
	return r.Clock.Now()
}

// Join writes this replica's membership Lease and lists the members, and
// retries until both succeed or ctx is done.
func (r *Ring) Join(ctx context.Context) error {
	if err := r.Validate(); err != nil {
		return fmt.Errorf("shard ring: %w", err)
	}
	return wait.PollUntilContextCancel(ctx, r.period()/2, true, func(ctx context.Context) (bool, error) {
		if err := r.tick(ctx); err != nil {
			klog.FromContext(ctx).Info("Unable to join the shard ring, will retry", "ring", r.Name, "err", err.Error())
			return false, nil
		}
		r.mu.Lock()
		r.joined = true
		r.mu.Unlock()
		return true, nil
	})
}

// Run renews the membership Lease and lists the members every third of the
// Lease duration until ctx is done.
func (r *Ring) Run(ctx context.Context) {
	logger := klog.FromContext(ctx).WithValues("ring", r.Name)
	go r.watchdog(ctx)
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		if err := r.tick(ctx); err != nil && ctx.Err() == nil {
			logger.Info("Unable to renew the shard membership or list the members, will retry", "err", err.Error())
		}
	}, r.period())
}

// Leave deletes this replica's membership Lease: its keys move at once
// to the others (call it after releasing the claims).
func (r *Ring) Leave(ctx context.Context) error {
	r.mu.Lock()
	own := r.own
	r.own, r.joined = nil, false
	r.mu.Unlock()
	if own == nil {
		return nil
	}
	uid := own.UID
	if err := r.Client.Delete(ctx, own, client.Preconditions{UID: &uid}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("unable to delete the membership Lease %s/%s: %w", r.Namespace, r.Identity, err)
	}
	return nil
}

// tick renews, lists and recomputes the live members, calling Changed when
// they changed.
func (r *Ring) tick(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, r.period())
	defer cancel()
	renewErr := r.renew(ctx)
	listErr := r.list(ctx)
	r.refresh()
	return errors.Join(renewErr, listErr)
}

// refresh recomputes the live members, calling Changed when they changed.
func (r *Ring) refresh() {
	r.mu.Lock()
	live := r.liveLocked()
	changed := !slices.Equal(live, r.live)
	r.live = live
	if !slices.Contains(live, r.Identity) {
		r.doubtLocked()
	}
	r.mu.Unlock()
	if changed && r.Changed != nil {
		r.Changed()
	}
}

// watchdog drops this replica from its own view of the members as soon as
// its renew deadline passes without a renewal, whatever its renewals are
// waiting for: it must stop serving before the others can take its claims.
func (r *Ring) watchdog(ctx context.Context) {
	for {
		r.mu.Lock()
		wait := r.renewed.Add(r.renewDeadline()).Sub(r.now())
		r.mu.Unlock()
		if wait <= 0 {
			wait = r.period() / 4 // lapsed: look again soon
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait + 10*time.Millisecond):
		}
		r.refresh()
	}
}

// renew creates or updates this replica's membership Lease.
func (r *Ring) renew(ctx context.Context) error {
	now := r.now()
	r.mu.Lock()
	own := r.own.DeepCopy()
	r.mu.Unlock()
	if own == nil {
		own = &coordinationv1.Lease{}
		err := r.Client.Get(ctx, client.ObjectKey{Namespace: r.Namespace, Name: r.Identity}, own)
		switch {
		case apierrors.IsNotFound(err):
			own = &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: r.Namespace, Name: r.Identity,
				Labels: map[string]string{LabelRing: r.Name, LabelKind: KindMember}}}
			own.Spec = r.memberSpec(now)
			own.Spec.AcquireTime = own.Spec.RenewTime
			if err := r.Client.Create(ctx, own); err != nil {
				return fmt.Errorf("unable to create the membership Lease: %w", err)
			}
			r.renewedAt(own, now)
			return nil
		case err != nil:
			return fmt.Errorf("unable to read the membership Lease: %w", err)
		}
	}
	acquired := own.Spec.AcquireTime
	own.Spec = r.memberSpec(now)
	own.Spec.AcquireTime = cmp.Or(acquired, own.Spec.RenewTime)
	if err := r.Client.Update(ctx, own); err != nil {
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
			r.mu.Lock()
			r.own = nil // read it again next time
			r.mu.Unlock()
		}
		return fmt.Errorf("unable to renew the membership Lease: %w", err)
	}
	r.renewedAt(own, now)
	return nil
}

func (r *Ring) memberSpec(now time.Time) coordinationv1.LeaseSpec {
	return coordinationv1.LeaseSpec{
		HolderIdentity:       ptr.To(r.Identity),
		LeaseDurationSeconds: ptr.To(int32(r.duration() / time.Second)),
		RenewTime:            &metav1.MicroTime{Time: now},
	}
}

func (r *Ring) renewedAt(own *coordinationv1.Lease, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if now.Sub(r.renewed) >= r.renewDeadline() {
		r.doubtLocked() // a break in the membership: claims may be taken
	}
	r.own, r.renewed = own, now
}

// doubtLocked marks every claim this replica holds as to be read again.
func (r *Ring) doubtLocked() {
	for k := range r.held {
		r.held[k] = false
	}
}

// list reads the members' Leases and records when each changed.
func (r *Ring) list(ctx context.Context) error {
	now := r.now()
	var leases coordinationv1.LeaseList
	if err := r.Client.List(ctx, &leases, client.InNamespace(r.Namespace), client.MatchingLabels{LabelRing: r.Name, LabelKind: KindMember}); err != nil {
		return fmt.Errorf("unable to list the shard members: %w", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := make(map[string]sighting, len(leases.Items))
	for i := range leases.Items {
		l := &leases.Items[i]
		if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != l.Name {
			continue // not a member's own Lease
		}
		d := r.duration()
		if s := l.Spec.LeaseDurationSeconds; s != nil && *s > 0 {
			d = time.Duration(*s) * time.Second
		}
		s, ok := r.seen[l.Name]
		if !ok || s.rv != l.ResourceVersion {
			s = sighting{rv: l.ResourceVersion, at: now}
		}
		s.duration = d
		seen[l.Name] = s
	}
	r.seen, r.listed = seen, now
	return nil
}

// liveLocked are the live members, sorted: the others whose Lease changed
// within its duration before the last list (a failed list expires nobody),
// and this replica while it renewed within the renew deadline.
func (r *Ring) liveLocked() []string {
	var live []string
	for name, s := range r.seen {
		if name != r.Identity && r.listed.Sub(s.at) < s.duration {
			live = append(live, name)
		}
	}
	if r.own != nil && r.now().Sub(r.renewed) < r.renewDeadline() {
		live = append(live, r.Identity)
	}
	slices.Sort(live)
	return live
}

// Members are the live members as seen here, sorted.
func (r *Ring) Members() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.live)
}

// Handovers is how many claims this replica took from a holder that
// released it or whose membership expired.
func (r *Ring) Handovers() int64 { return r.handovers.Load() }

// Owner is the live member key is assigned to, "" when none is live.
// This replica is left out as soon as its renew deadline passed.
func (r *Ring) Owner(key string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	live := r.live
	if r.now().Sub(r.renewed) >= r.renewDeadline() {
		live = slices.DeleteFunc(slices.Clone(live), func(m string) bool { return m == r.Identity })
	}
	return Assign(key, live)
}

// Mine reports whether key is assigned to this replica.
func (r *Ring) Mine(key string) bool { return r.Owner(key) == r.Identity }

// Assign returns the member of members key is assigned to by rendezvous
// hashing: the member with the highest weight hash(member, key). Adding or
// removing a member moves only the keys it gains or held. "" when members
// is empty.
func Assign(key string, members []string) string {
	var best string
	var bestWeight uint64
	for _, m := range members {
		h := sha256.New()
		h.Write([]byte(m))
		h.Write([]byte{0})
		h.Write([]byte(key))
		w := binary.BigEndian.Uint64(h.Sum(nil))
		if best == "" || w > bestWeight || (w == bestWeight && m < best) {
			best, bestWeight = m, w
		}
	}
	return best
}

// alive reports whether holder is a live member as seen here.
func (r *Ring) alive(holder string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Contains(r.live, holder)
}

// ClaimName is the name of key's claim Lease in ring.
func ClaimName(ring, key string) string {
	sum := sha256.Sum256([]byte(ring + "\x00" + key))
	return "claim-" + hex.EncodeToString(sum[:16])
}

// Claim makes this replica the holder of key's claim, unless a live member
// holds it; it returns the holder (this replica's identity when it is
// now). The claim is taken only by a create, or an update conditional on
// the resourceVersion read, of a claim released or held by a member whose
// Lease expired: of replicas racing, one wins and the others read it.
func (r *Ring) Claim(ctx context.Context, key string) (string, error) {
	r.mu.Lock()
	joined, certain := r.joined, r.held[key]
	lapsed := r.now().Sub(r.renewed) >= r.renewDeadline()
	r.mu.Unlock()
	if !joined || lapsed {
		return "", errors.New("not a live member of the shard ring")
	}
	if certain {
		return r.Identity, nil
	}
	holder, err := r.claim(ctx, key)
	switch {
	case holder == r.Identity:
		r.hold(key, true)
	case err != nil && !apierrors.IsConflict(err) && !apierrors.IsAlreadyExists(err):
		r.mayHold(key) // perhaps taken: Release reads it back
	default:
		r.hold(key, false)
	}
	return holder, err
}

// hold records that this replica holds key's claim (true) or does not.
func (r *Ring) hold(key string, held bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.held == nil {
		r.held = map[string]bool{}
	}
	if held {
		r.held[key] = true
	} else {
		delete(r.held, key)
	}
}

// mayHold records that this replica may hold key's claim.
func (r *Ring) mayHold(key string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.held == nil {
		r.held = map[string]bool{}
	}
	if !r.held[key] {
		r.held[key] = false
	}
}

func (r *Ring) claim(ctx context.Context, key string) (string, error) {
	nn := client.ObjectKey{Namespace: r.Namespace, Name: ClaimName(r.Name, key)}
	var lastErr error
	for range 3 {
		var l coordinationv1.Lease
		err := r.Client.Get(ctx, nn, &l)
		if apierrors.IsNotFound(err) {
			l = coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: nn.Namespace, Name: nn.Name,
				Labels:      map[string]string{LabelRing: r.Name, LabelKind: KindClaim},
				Annotations: map[string]string{AnnotationKey: key}}}
			l.Spec = r.claimSpec(0)
			err = r.Client.Create(ctx, &l)
			if apierrors.IsAlreadyExists(err) {
				lastErr = err
				continue
			}
			if err != nil {
				return "", fmt.Errorf("unable to create the claim of %s: %w", key, err)
			}
			return r.Identity, nil
		}
		if err != nil {
			return "", fmt.Errorf("unable to read the claim of %s: %w", key, err)
		}
		if l.Annotations[AnnotationKey] != key {
			return "", fmt.Errorf("claim Lease %s/%s is for %q, not %q", l.Namespace, l.Name, l.Annotations[AnnotationKey], key)
		}
		holder := ptr.Deref(l.Spec.HolderIdentity, "")
		if holder == r.Identity || (holder != "" && r.alive(holder)) {
			return holder, nil
		}
		l.Spec = r.claimSpec(ptr.Deref(l.Spec.LeaseTransitions, 0) + 1)
		err = r.Client.Update(ctx, &l) // conditional on l.ResourceVersion
		if apierrors.IsConflict(err) {
			lastErr = err
			continue
		}
		if err != nil {
			return "", fmt.Errorf("unable to take the claim of %s: %w", key, err)
		}
		r.handovers.Add(1)
		if r.Metrics != nil {
			r.Metrics.Handover()
		}
		return r.Identity, nil
	}
	return "", fmt.Errorf("unable to take the claim of %s: %w", key, lastErr)
}

func (r *Ring) claimSpec(transitions int32) coordinationv1.LeaseSpec {
	now := &metav1.MicroTime{Time: r.now()}
	return coordinationv1.LeaseSpec{HolderIdentity: ptr.To(r.Identity), AcquireTime: now, RenewTime: now, LeaseTransitions: ptr.To(transitions)}
}

// Release gives up key's claim if this replica holds it: the next member
// it is assigned to takes it at once. Call it after this replica stopped
// serving key.
func (r *Ring) Release(ctx context.Context, key string) error {
	r.mu.Lock()
	_, held := r.held[key]
	r.mu.Unlock()
	if !held {
		return nil
	}
	var l coordinationv1.Lease
	err := r.Client.Get(ctx, client.ObjectKey{Namespace: r.Namespace, Name: ClaimName(r.Name, key)}, &l)
	if apierrors.IsNotFound(err) {
		r.hold(key, false)
		return nil
	}
	if err != nil {
		return fmt.Errorf("unable to read the claim of %s: %w", key, err)
	}
	if ptr.Deref(l.Spec.HolderIdentity, "") != r.Identity {
		r.hold(key, false)
		return nil
	}
	l.Spec.HolderIdentity, l.Spec.RenewTime = nil, &metav1.MicroTime{Time: r.now()}
	if err := r.Client.Update(ctx, &l); err != nil { // conditional on l.ResourceVersion
		return fmt.Errorf("unable to release the claim of %s: %w", key, err)
	}
	r.hold(key, false)
	return nil
}

// ReleaseAll releases every claim this replica holds (it is stopping and
// serves nothing any more).
func (r *Ring) ReleaseAll(ctx context.Context) error {
	r.mu.Lock()
	keys := slices.Sorted(maps.Keys(r.held))
	r.mu.Unlock()
	var errs []error
	for _, k := range keys {
		errs = append(errs, r.Release(ctx, k))
	}
	return errors.Join(errs...)
}

// Forget deletes key's claim (key is no longer served by anyone: its
// Cluster is gone or opted out) when it is released, held by this replica
// or held by a member whose Lease expired.
func (r *Ring) Forget(ctx context.Context, key string) error {
	var l coordinationv1.Lease
	err := r.Client.Get(ctx, client.ObjectKey{Namespace: r.Namespace, Name: ClaimName(r.Name, key)}, &l)
	if apierrors.IsNotFound(err) {
		r.hold(key, false)
		return nil
	}
	if err != nil {
		return fmt.Errorf("unable to read the claim of %s: %w", key, err)
	}
	if holder := ptr.Deref(l.Spec.HolderIdentity, ""); holder != "" && holder != r.Identity && r.alive(holder) {
		r.hold(key, false)
		return nil
	}
	uid, rv := l.UID, l.ResourceVersion
	if err := r.Client.Delete(ctx, &l, client.Preconditions{UID: &uid,
		ResourceVersion: &rv}); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("unable to delete the claim of %s: %w", key, err)
	}
	r.hold(key, false)
	return nil
}
