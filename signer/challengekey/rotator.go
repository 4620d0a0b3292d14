package challengekey

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"maps"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// DefaultRotationInterval is how long a key stays current unless the
// controller is told otherwise.
const DefaultRotationInterval = 30 * 24 * time.Hour

// DefaultResync is how often a replica reads the Secret again: the longest
// a replica goes on sealing under a key another replica has retired, and
// the longest an on-demand rotation waits.
const DefaultResync = 30 * time.Second

// Rotator keeps a replica's Ring in step with the key Secret, creating the
// Secret when it is missing, and rotates the key when it is due or asked
// for. Every write is conditional on what was read (create, or update or
// delete on the resourceVersion), so replicas racing to rotate make one
// rotation and all end up with its key.
type Rotator struct {
	// Client reads and writes the Secret.
	Client client.Client
	// Secret names the key Secret.
	Secret types.NamespacedName
	// Ring receives every key set read or written.
	Ring *Ring
	// Interval is how long a key stays current; 0 rotates only on demand.
	Interval time.Duration
	// Overlap is how long a retired key is kept: at least the longest
	// lifetime of a challenge plus Resync, so that every challenge made
	// under it expires first.
	Overlap time.Duration
	// Clock is the clock; nil means the real one.
	Clock clock.PassiveClock
	// Rand is the randomness of new keys; nil means crypto/rand.
	Rand io.Reader
}

func (r *Rotator) now() time.Time {
	if r.Clock == nil {
		return time.Now()
	}
	return r.Clock.Now()
}

func (r *Rotator) rand() io.Reader {
	if r.Rand == nil {
		return rand.Reader
	}
	return r.Rand
}

// Run calls Sync every resync until ctx ends, logging failures.
func (r *Rotator) Run(ctx context.Context, resync time.Duration) {
	log := klog.FromContext(ctx).WithValues("secret", r.Secret)
	t := time.NewTicker(resync)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if _, err := r.Sync(ctx); err != nil {
			log.Error(err, "Unable to sync the challenge keys")
		}
	}
}

// Sync reads the key Secret into the Ring, creating it when missing, and
// writes a rotation when one is due (the current key is older than
// Interval, or the Secret carries AnnotationRotate) and drops the retired
// keys older than Overlap. It reports whether this call rotated the key;
// losing a race to another replica is not an error (the Ring then holds
// that replica's key set).
func (r *Rotator) Sync(ctx context.Context) (rotated bool, err error) {
	var s corev1.Secret
	err = r.Client.Get(ctx, r.Secret, &s)
	if apierrors.IsNotFound(err) {
		return false, r.create(ctx)
	}
	if err != nil {
		return false, fmt.Errorf("unable to read the challenge key Secret %s: %w", r.Secret, err)
	}
	set, err := FromSecret(&s)
	if err != nil {
		return false, fmt.Errorf("the challenge key Secret %s: %w", r.Secret, err)
	}
	r.Ring.Store(set)

	now := r.now()
	_, asked := s.Annotations[AnnotationRotate]
	due := r.Interval > 0 && now.Sub(set.Current().Since) >= r.Interval
	next := set
	if asked || due {
		if next, err = set.Rotated(now, r.rand()); err != nil {
			return false, err
		}
	}
	next, dropped := next.Pruned(now, r.Overlap)
	if !asked && !due && !dropped {
		return false, nil
	}
	won, err := r.write(ctx, &s, next)
	if err != nil || !won {
		return false, err
	}
	r.Ring.Store(next)
	klog.FromContext(ctx).Info("Challenge keys changed", "secret", r.Secret, "current", next.Current().ID,
		"previous", set.Current().ID, "rotated", asked || due, "onDemand", asked, "kept", len(next.Keys))
	return asked || due, nil
}

// create makes the Secret with one new key; when another replica created
// it first, that one is read.
func (r *Rotator) create(ctx context.Context) error {
	k, err := newKey(1, r.now(), r.rand())
	if err != nil {
		return err
	}
	set := &Set{Keys: []Key{k}}
	s, err := r.newSecret(set)
	if err != nil {
		return err
	}
	err = r.Client.Create(ctx, s)
	if apierrors.IsAlreadyExists(err) {
		return r.read(ctx)
	}
	if err != nil {
		return fmt.Errorf("unable to create the challenge key Secret %s: %w", r.Secret, err)
	}
	r.Ring.Store(set)
	return nil
}

// read reads the Secret into the Ring, writing nothing.
func (r *Rotator) read(ctx context.Context) error {
	var s corev1.Secret
	if err := r.Client.Get(ctx, r.Secret, &s); err != nil {
		return fmt.Errorf("unable to read the challenge key Secret %s: %w", r.Secret, err)
	}
	set, err := FromSecret(&s)
	if err != nil {
		return fmt.Errorf("the challenge key Secret %s: %w", r.Secret, err)
	}
	r.Ring.Store(set)
	return nil
}

func (r *Rotator) newSecret(set *Set) (*corev1.Secret, error) {
	data, err := set.encode()
	if err != nil {
		return nil, fmt.Errorf("unable to encode the challenge keys: %w", err)
	}
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: r.Secret.Namespace,
			Name:      r.Secret.Name,
			Labels:    map[string]string{"app.kubernetes.io/managed-by": "node-attestation-controller"},
			Annotations: map[string]string{
				"kubelet-authenticator.x-k8s.io/purpose": "TPM challenges are sealed and their secrets derived under these keys; " +
					"annotate with " + AnnotationRotate + "=<anything> to rotate",
			},
		},
		Type: corev1.SecretTypeOpaque,
		Data: map[string][]byte{SetDataKey: data},
	}, nil
}

// write replaces the Secret s was read as with one holding set, on the
// condition that nobody changed it since. won is false when somebody did
// (the Ring then holds what they wrote). A Secret of the first format is
// immutable: it is deleted (on the same condition) and made anew.
func (r *Rotator) write(ctx context.Context, s *corev1.Secret, set *Set) (won bool, err error) {
	data, err := set.encode()
	if err != nil {
		return false, fmt.Errorf("unable to encode the challenge keys: %w", err)
	}
	lost := func(err error) (bool, error) {
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) || apierrors.IsAlreadyExists(err) {
			klog.FromContext(ctx).V(2).Info("Another replica changed the challenge keys first", "secret", r.Secret, "err", err)
			return false, r.read(ctx)
		}
		return false, fmt.Errorf("unable to write the challenge key Secret %s: %w", r.Secret, err)
	}
	if s.Immutable != nil && *s.Immutable {
		uid, rv := s.UID, s.ResourceVersion
		if err := r.Client.Delete(ctx, s, client.Preconditions{UID: &uid, ResourceVersion: &rv}); err != nil {
			return lost(err)
		}
		fresh, err := r.newSecret(set)
		if err != nil {
			return false, err
		}
		if err := r.Client.Create(ctx, fresh); err != nil {
			return lost(err)
		}
		return true, nil
	}
	next := s.DeepCopy() // keeps the resourceVersion read: a conditional update
	next.Data = map[string][]byte{SetDataKey: data}
	next.Annotations = maps.Clone(s.Annotations)
	delete(next.Annotations, AnnotationRotate)
	if err := r.Client.Update(ctx, next); err != nil {
		return lost(err)
	}
	return true, nil
}
