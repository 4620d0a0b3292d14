package revoke

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
)

// batcher writes a Revoker's record one batch of changes at a time: while
// one caller writes, the others queue their changes, and the next of them
// writes all that queued meanwhile. Every certificate handed out is
// recorded first (Accept), so that a fleet's joins, decided in parallel,
// would otherwise each read, decode, encode and write the whole record in
// turn, and conflict with one another.
type batcher struct {
	mu     sync.Mutex
	queue  []*pending
	writer chan struct{} // holds a token while a batch is written; made on first use

	// Held by the writer (the token's holder) only.
	//
	// last is the record as this Revoker last read or wrote it, nil when
	// unknown (never read, or a write or read failed since).
	last *record
	// ensured is what this Revoker knows of the policy: it made the
	// policy say what the record at resourceVersion rv says (spec), and
	// nobody wrote the record since but this Revoker, without changing
	// what the policy says. Zero when it knows nothing.
	ensured struct {
		rv   string
		spec *admissionregistrationv1.ValidatingAdmissionPolicySpec
	}
}

// pending is one caller's change, and what its batch returned.
type pending struct {
	always bool
	change func(*State) bool
	done   chan struct{} // closed once out and err are set
	out    *State
	err    error
}

// record is the ConfigMap as read or written, and the state it holds;
// neither is ever changed. cm is nil where the ConfigMap is missing, and
// holds only the object's metadata otherwise (every write replaces its
// data): the state is kept once, decoded.
type record struct {
	cm    *corev1.ConfigMap
	state *State
}

func newRecord(cm *corev1.ConfigMap, s *State) *record {
	return &record{cm: &corev1.ConfigMap{TypeMeta: cm.TypeMeta, ObjectMeta: cm.ObjectMeta, Immutable: cm.Immutable}, state: s}
}

// update applies change to the state and writes the state when change
// reports a change or the ConfigMap is missing (conflicts are retried);
// then, when always is set or it wrote something the policy says, it makes
// the policy say what the state says. The state returned is shared: read
// it, never change it.
//
// Concurrent calls are written together: the change of each is applied in
// turn to the state the one before left, in one read and one write, and
// each call returns once the write holding its change succeeded or failed.
// A change may run more than once (once per try, each time on a fresh copy
// of the state) and must set what it reports anew each time.
//
// The record is read again only when needed. A change to the record as
// this Revoker last read or wrote it is written conditionally on that
// version: if someone else wrote since, the write conflicts and the record
// is read again. A change that writes nothing is decided on the record as
// read now, and so is every call with always (the periodic Ensure, which
// also restores a policy someone else deleted or changed).
func (r *Revoker) update(ctx context.Context, always bool, change func(*State) bool) (*State, error) {
	b := &r.batch
	p := &pending{always: always, change: change, done: make(chan struct{})}
	b.mu.Lock()
	b.queue = append(b.queue, p)
	if b.writer == nil {
		b.writer = make(chan struct{}, 1)
	}
	writer := b.writer
	b.mu.Unlock()
	select {
	case writer <- struct{}{}:
	case <-p.done:
		return p.out, p.err
	case <-ctx.Done():
		// Once taken into a batch the change may still be written: as with
		// a request cut short, an unanswered caller hands out nothing.
		b.withdraw(p)
		return nil, ctx.Err()
	}
	defer func() { <-writer }()
	b.mu.Lock()
	batch := b.queue
	b.queue = nil
	b.mu.Unlock()
	if len(batch) > 0 {
		out, err := r.write(ctx, batch)
		for _, q := range batch {
			q.out, q.err = out, err
			close(q.done)
		}
	}
	// p was in this batch or in one written before this caller took the
	// token.
	<-p.done
	return p.out, p.err
}

// withdraw takes p out of the queue if no batch has taken it yet.
func (b *batcher) withdraw(p *pending) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.queue = slices.DeleteFunc(b.queue, func(q *pending) bool { return q == p })
}

// write applies a batch's changes and writes the state (update); the
// caller holds the writer token.
func (r *Revoker) write(ctx context.Context, batch []*pending) (*State, error) {
	always := slices.ContainsFunc(batch, func(p *pending) bool { return p.always })
	apply := func(s *State) bool {
		changed := false
		for _, p := range batch {
			if p.change(s) {
				changed = true
			}
		}
		return changed
	}
	b := &r.batch
	var (
		out     *State
		base    *record // what the state was read from
		written bool
		rv      string // the resourceVersion written
	)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		api := r.Client.CoreV1().ConfigMaps(Namespace)
		cur, readNow, err := r.read(ctx, always)
		if err != nil {
			return err
		}
		s := cur.copyState()
		changed := apply(s)
		if !changed && cur.cm != nil && !readNow {
			// Nothing to write: decided on the record as it is now.
			if cur, _, err = r.read(ctx, true); err != nil {
				return err
			}
			s = cur.copyState()
			changed = apply(s)
		}
		if !changed && cur.cm != nil {
			out, base = s, cur
			return nil
		}
		d, err := data(s)
		if err != nil {
			return err
		}
		var cm *corev1.ConfigMap
		if cur.cm == nil {
			cm, err = api.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: Namespace, Name: ConfigMapName, Labels: managedLabels}, Data: d},
				metav1.CreateOptions{FieldManager: FieldManager})
			if apierrors.IsAlreadyExists(err) {
				err = apierrors.NewConflict(corev1.Resource("configmaps"), ConfigMapName, err)
			}
		} else {
			cm = cur.cm.DeepCopy()
			cm.Data, cm.BinaryData = d, nil
			cm, err = api.Update(ctx, cm, metav1.UpdateOptions{FieldManager: FieldManager})
			if apierrors.IsNotFound(err) {
				// Deleted since it was read: written anew on the next try.
				err = apierrors.NewConflict(corev1.Resource("configmaps"), ConfigMapName, err)
			}
		}
		if err != nil {
			b.last = nil
			if apierrors.IsConflict(err) {
				return err
			}
			return fmt.Errorf("unable to write ConfigMap %s/%s: %w", Namespace, ConfigMapName, err)
		}
		b.last = newRecord(cm, s)
		out, base, written, rv = s, cur, true, cm.ResourceVersion
		return nil
	})
	if err == nil && out == nil {
		// retry.OnError takes an error of fn that wraps a context error
		// (ctx canceled while a request was under way) for its own
		// interruption and returns the last conflict instead: none.
		if err = ctx.Err(); err == nil {
			err = errors.New("the revocation state was neither read nor written")
		}
	}
	if err != nil {
		return nil, err
	}
	if !written && !always {
		return out, nil
	}
	want, err := Policy(out)
	if err != nil {
		return nil, err
	}
	// The record written replaced one whose policy this Revoker made the
	// cluster's, and its policy says the same: the cluster's says it
	// already. A policy someone else deleted or changed is restored by the
	// next Ensure.
	if !always && written && rv != "" && base.cm != nil && base.cm.ResourceVersion == b.ensured.rv && b.ensured.spec != nil &&
		equality.Semantic.DeepEqual(want.Spec, *b.ensured.spec) {
		b.ensured.rv = rv
		return out, nil
	}
	b.ensured.rv, b.ensured.spec = "", nil
	if err := r.ensurePolicy(ctx, want); err != nil {
		return nil, err
	}
	b.ensured.rv, b.ensured.spec = rv, &want.Spec
	if !written {
		b.ensured.rv = base.cm.ResourceVersion
	}
	if b.ensured.rv == "" {
		b.ensured.spec = nil
	}
	return out, nil
}

// read returns the record: as this Revoker last read or wrote it unless
// fresh is set or it has none, else as read now (readNow). A missing
// ConfigMap is a record without one. A record read now is decoded once
// per version.
func (r *Revoker) read(ctx context.Context, fresh bool) (rec *record, readNow bool, err error) {
	b := &r.batch
	if !fresh && b.last != nil {
		return b.last, false, nil
	}
	cm, err := r.Client.CoreV1().ConfigMaps(Namespace).Get(ctx, ConfigMapName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		b.last = nil
		return &record{}, true, nil
	}
	if err != nil {
		b.last = nil
		return nil, true, fmt.Errorf("unable to read ConfigMap %s/%s: %w", Namespace, ConfigMapName, err)
	}
	if b.last != nil && cm.ResourceVersion != "" && b.last.cm.ResourceVersion == cm.ResourceVersion {
		return b.last, true, nil
	}
	s, err := Decode(cm)
	if err != nil {
		b.last = nil
		return nil, true, err
	}
	b.last = newRecord(cm, s)
	return b.last, true, nil
}

// copyState returns a copy of the record's state to change, or a new
// state where the ConfigMap is missing.
func (rec *record) copyState() *State {
	if rec.state == nil {
		return &State{Version: stateVersion}
	}
	return rec.state.clone()
}

// clone returns a copy of s that shares nothing a change writes.
func (s *State) clone() *State {
	c := *s
	c.Entries = slices.Clone(s.Entries)
	for i := range c.Entries {
		c.Entries[i].Accepted = cloneCredentials(c.Entries[i].Accepted)
	}
	c.Issued = cloneCredentials(s.Issued)
	c.Denied = slices.Clone(s.Denied)
	c.unknown = maps.Clone(s.unknown)
	return &c
}

func cloneCredentials(in []Credential) []Credential {
	out := slices.Clone(in)
	for i := range out {
		if a := out[i].Attested; a != nil {
			cp := *a
			out[i].Attested = &cp
		}
	}
	return out
}
