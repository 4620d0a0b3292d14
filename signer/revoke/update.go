package revoke

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"sync"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
)

// batcher writes a Revoker's record and shards one batch of changes at a
// time: while one caller writes, the others queue their changes, and the
// next of them writes all that queued meanwhile. Every certificate handed
// out is recorded first (Accept), so that a fleet's joins, decided in
// parallel, would otherwise each read, decode, encode and write in turn,
// and conflict with one another.
type batcher struct {
	mu     sync.Mutex
	queue  []*pending
	writer chan struct{} // holds a token while a batch is written; made on first use

	// Held by the writer (the token's holder) only.
	//
	// last is the record as this Revoker last read or wrote it, nil when
	// unknown (never read, or a write or read failed since); shards[k]
	// likewise shard k.
	last   *record
	shards [ShardCount]*record
	// ensured is what this Revoker knows of the policy: it made the
	// policy say what the record at resourceVersion rv says (spec), and
	// nobody wrote the record since but this Revoker, without changing
	// what the policy says. Zero when it knows nothing.
	ensured struct {
		rv   string
		spec *admissionregistrationv1.ValidatingAdmissionPolicySpec
	}
}

// scope is what a change reads and writes besides the record's entries.
type scope struct {
	// always: decide on the record as read now, and make the policy say
	// what it says (Ensure, which restores a policy someone else deleted
	// or changed).
	always bool
	// all: every shard, as read now (Revoke).
	all bool
	// nodes: the shards of these node names (Accept, Deny).
	nodes []string
}

// pending is one caller's change, and what its batch returned.
type pending struct {
	scope
	change func(*State) bool
	done   chan struct{} // closed once out and err are set
	out    *State
	err    error
}

// record is a ConfigMap (the record or a shard) as read or written, and
// the state it holds; neither is ever changed. cm is nil where the
// ConfigMap is missing, and holds only the object's metadata otherwise
// (every write replaces its data): the state is kept once, decoded.
type record struct {
	cm    *corev1.ConfigMap
	state *State
	// encoded is state as data writes it, "" until known (encode).
	// Records are used by the batch's writer alone.
	encoded string
}

// newRecord returns the record of cm holding s; encoded is s as data
// writes it, "" when not known.
func newRecord(cm *corev1.ConfigMap, s *State, encoded string) *record {
	return &record{cm: &corev1.ConfigMap{TypeMeta: cm.TypeMeta, ObjectMeta: cm.ObjectMeta, Immutable: cm.Immutable}, state: s, encoded: encoded}
}

// encode returns the record's state as data writes it, encoded once: a
// batch compares what it would write with what the objects hold in every
// round, and what a batch wrote is what the next one compares with.
func (rec *record) encode() (string, error) {
	if rec.encoded == "" {
		d, err := data(rec.state)
		if err != nil {
			return "", err
		}
		rec.encoded = d[StateKey]
	}
	return rec.encoded, nil
}

// maxRounds bounds the rounds of one batch (write): a batch that others'
// writes keep from settling fails, and its callers retry.
const maxRounds = 10

// update applies change to the state and writes what it changed (the
// record's entries, the shards' certificates and denials; conflicts are
// retried); then, when always is set or it wrote the record, it makes the
// policy say what the state says. The state change is given holds the
// record's entries and the certificates and denials of the shards of
// sc.nodes (every shard with sc.all); the state returned is that, shared:
// read it, never change it.
//
// Concurrent calls are written together: the change of each is applied in
// turn to the state the one before left, and each call returns once the
// writes holding its change succeeded or failed. A change runs once per
// round (write), each time on a fresh copy of the state as read then,
// which holds what earlier rounds wrote: what it reports covers every
// round.
func (r *Revoker) update(ctx context.Context, sc scope, change func(*State) bool) (*State, error) {
	b := &r.batch
	p := &pending{scope: sc, change: change, done: make(chan struct{})}
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

// errConflict ends a round whose conditional write conflicted.
var errConflict = errors.New("written by someone else meanwhile")

// write applies a batch's changes and writes what they change (update);
// the caller holds the writer token. It works in rounds: read (the
// record, the shards in scope), apply every change, write the shards that
// changed, then the record if it changed. A batch ends with the first
// round that has nothing to write, decided on the record read in that
// round and, where the batch wrote entries, on their shards read in that
// round: read after every write of the batch (the package comment says
// why that orders Accept against Revoke).
func (r *Revoker) write(ctx context.Context, batch []*pending) (*State, error) {
	b := &r.batch
	var always, all bool
	need := map[int]bool{}
	for _, p := range batch {
		always, all = always || p.always, all || p.all
		for _, n := range p.nodes {
			need[ShardOf(n)] = true
		}
	}
	// freshShards are the shards read now in every round: those of the
	// entries the batch wrote. With all, the first round reads every shard
	// now.
	freshShards := map[int]bool{}
	if all {
		for k := range ShardCount {
			need[k] = true
		}
	}
	freshRecord := always || all
	var (
		out     *State
		final   *record // the record out was decided on
		written bool    // the record was written
		// chain: every write of the record since b.ensured.rv was this
		// batch's, ownRV the last.
		chain = b.ensured.spec != nil && b.ensured.rv != ""
		ownRV = b.ensured.rv
	)
	// settled: the batch's last write was the record's, and the record
	// cached is that write.
	settled := false
	backoff := retry.DefaultRetry
	for round := 0; out == nil; round++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if round == maxRounds {
			return nil, errors.New("the revocation record did not settle: written by others meanwhile")
		}
		rec, recNow, err := r.read(ctx, freshRecord)
		if err != nil {
			return nil, err
		}
		if rec.cm == nil || rec.cm.ResourceVersion != ownRV {
			chain = false
		}
		base := rec.copyState()
		for _, c := range base.Issued { // a legacy record's: moved now
			need[ShardOf(c.Node)] = true
		}
		for _, d := range base.Denied {
			need[ShardOf(d.Node)] = true
		}
		shards := make([]*record, ShardCount)
		parts := make([]*State, ShardCount)
		for _, k := range slices.Sorted(maps.Keys(need)) {
			if shards[k], err = r.readShard(ctx, k, freshShards[k] || (all && round == 0)); err != nil {
				return nil, err
			}
			parts[k] = shards[k].copyState()
		}
		s := merge(base, parts)
		for _, p := range batch {
			p.change(s)
		}
		newRec, newShards, err := split(s, parts)
		if err != nil {
			return nil, err
		}
		var dirty []int
		encoded := make([]string, ShardCount) // of the dirty shards
		for k, p := range newShards {
			if p == nil {
				continue
			}
			must, enc, err := shardChanged(shards[k], p)
			if err != nil {
				return nil, err
			}
			if must {
				dirty, encoded[k] = append(dirty, k), enc
			}
		}
		recDirty, recEncoded, err := changed(rec, newRec)
		if err != nil {
			return nil, err
		}
		recDirty = recDirty || rec.cm == nil
		wrote, recordLast := false, false
		switch {
		case len(dirty) > 0 && (rec.cm == nil || rec.state.Version != stateVersion):
			// Shards are written only under a record of this version: an
			// older replica, which reads no shard, stands off such a record
			// (ErrMalformed) rather than decide without them.
			up := base.clone()
			up.Version, up.Shards = stateVersion, ShardCount
			err = r.writeRecord(ctx, rec, up, "", &chain, &ownRV)
			wrote, written, recordLast = err == nil, written || err == nil, err == nil
		default:
			for _, k := range dirty {
				if err = r.writeShard(ctx, k, shards[k], newShards[k], encoded[k]); err != nil {
					if errors.Is(err, errConflict) {
						freshShards[k] = true
					}
					break
				}
				wrote = true
			}
			if err == nil && recDirty {
				for _, n := range changedEntries(base, newRec) {
					freshShards[ShardOf(n)], need[ShardOf(n)] = true, true
				}
				err = r.writeRecord(ctx, rec, newRec, recEncoded, &chain, &ownRV)
				wrote, written, recordLast = wrote || err == nil, written || err == nil, err == nil
			}
		}
		switch {
		case errors.Is(err, errConflict):
			freshRecord, settled = true, false
			time.Sleep(backoff.Step())
		case err != nil:
			return nil, err
		case wrote:
			// The record as written last is as it was when written: read
			// after the batch's other writes (conditional writes, the
			// record last).
			settled = recordLast
			freshRecord = !settled
		case recNow || settled:
			out, final = s, rec
		default:
			freshRecord = true
		}
	}
	if !written && !always {
		return out, nil
	}
	want, err := Policy(out)
	if err != nil {
		return nil, err
	}
	// Every write of the record since the policy was last made the
	// cluster's was this Revoker's, and the policy says the same: the
	// cluster's says it already. A policy someone else deleted or changed
	// is restored by the next Ensure.
	if !always && chain && equality.Semantic.DeepEqual(want.Spec, *b.ensured.spec) {
		b.ensured.rv = final.cm.ResourceVersion
		return out, nil
	}
	b.ensured.rv, b.ensured.spec = "", nil
	if err := r.ensurePolicy(ctx, want); err != nil {
		return nil, err
	}
	b.ensured.rv, b.ensured.spec = final.cm.ResourceVersion, &want.Spec
	return out, nil
}

// split returns what the record and the shards read (parts[k] non-nil)
// hold of s: the record its entries and unknown top-level fields, each
// shard the certificates and denials of its nodes (a legacy record's move
// to them). A certificate or denial of a shard not read is an error.
func split(s *State, parts []*State) (*State, []*State, error) {
	rec := &State{Version: stateVersion, Shards: ShardCount, Entries: s.Entries, unknown: s.unknown}
	shards := make([]*State, ShardCount)
	for k, p := range parts {
		if p != nil {
			shards[k] = &State{Version: stateVersion, Shards: ShardCount, unknown: p.unknown}
		}
	}
	for _, c := range s.Issued {
		p := shards[ShardOf(c.Node)]
		if p == nil {
			return nil, nil, fmt.Errorf("the certificate issued for node %s belongs to a shard not read", c.Node)
		}
		p.Issued = append(p.Issued, c)
	}
	for _, d := range s.Denied {
		p := shards[ShardOf(d.Node)]
		if p == nil {
			return nil, nil, fmt.Errorf("the denial of node %s belongs to a shard not read", d.Node)
		}
		p.Denied = append(p.Denied, d)
	}
	return rec, shards, nil
}

// changedEntries returns the nodes whose entries differ between two
// states.
func changedEntries(before, after *State) []string {
	var out []string
	for _, e := range after.Entries {
		if o := before.Find(e.Node); o == nil || !reflect.DeepEqual(*o, e) {
			out = append(out, e.Node)
		}
	}
	for _, e := range before.Entries {
		if after.Find(e.Node) == nil {
			out = append(out, e.Node)
		}
	}
	return out
}

// encode returns s as data writes it.
func encode(s *State) (string, error) {
	d, err := data(s)
	if err != nil {
		return "", err
	}
	return d[StateKey], nil
}

// changed reports whether st is written otherwise than cur's state, and
// returns st as encode writes it where it is ("" where it is not). A
// state equal to cur's (a round that changed nothing) is not encoded.
func changed(cur *record, st *State) (bool, string, error) {
	if cur.state != nil && reflect.DeepEqual(cur.state, st) {
		return false, "", nil
	}
	enc, err := encode(st)
	if err != nil {
		return false, "", err
	}
	if cur.state == nil {
		return true, enc, nil
	}
	have, err := cur.encode()
	return err != nil || have != enc, enc, nil
}

// shardChanged reports whether shard st must be written over cur, and
// returns st as encode writes it where it must: a missing shard is
// written once it holds something.
func shardChanged(cur *record, st *State) (bool, string, error) {
	if cur.cm == nil {
		if len(st.Issued) == 0 && len(st.Denied) == 0 && len(st.unknown) == 0 {
			return false, "", nil
		}
		enc, err := encode(st)
		return err == nil, enc, err
	}
	return changed(cur, st)
}

// writeRecord writes st over the record cur, conditionally on its version
// (errConflict); chain and ownRV follow the record's writes (write).
// encoded is st as encode writes it, "" to encode it here.
func (r *Revoker) writeRecord(ctx context.Context, cur *record, st *State, encoded string, chain *bool, ownRV *string) error {
	b := &r.batch
	next, err := r.writeObject(ctx, ConfigMapName, cur, st, encoded)
	if err != nil {
		b.last = nil
		return err
	}
	b.last = next
	if *chain {
		*ownRV = next.cm.ResourceVersion
	}
	return nil
}

// writeShard writes st over shard k as cur holds it, conditionally on its
// version (errConflict). encoded is st as encode writes it.
func (r *Revoker) writeShard(ctx context.Context, k int, cur *record, st *State, encoded string) error {
	b := &r.batch
	next, err := r.writeObject(ctx, ShardName(k), cur, st, encoded)
	if err != nil {
		b.shards[k] = nil
		return err
	}
	b.shards[k] = next
	return nil
}

// writeObject creates the ConfigMap name holding st, or updates it over
// cur; a conflict (someone else wrote it since cur, created or deleted
// it) is errConflict. encoded is st as encode writes it, "" to encode it
// here.
func (r *Revoker) writeObject(ctx context.Context, name string, cur *record, st *State, encoded string) (*record, error) {
	api := r.Client.CoreV1().ConfigMaps(Namespace)
	if encoded == "" {
		var err error
		if encoded, err = encode(st); err != nil {
			return nil, err
		}
	}
	d := map[string]string{StateKey: encoded}
	var (
		cm  *corev1.ConfigMap
		err error
	)
	if cur.cm == nil {
		cm, err = api.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: Namespace, Name: name, Labels: managedLabels}, Data: d},
			metav1.CreateOptions{FieldManager: FieldManager})
		if apierrors.IsAlreadyExists(err) {
			err = errConflict
		}
	} else {
		cm = &corev1.ConfigMap{ObjectMeta: *cur.cm.ObjectMeta.DeepCopy(), Data: d}
		cm, err = api.Update(ctx, cm, metav1.UpdateOptions{FieldManager: FieldManager})
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
			// Written or deleted since it was read: read again.
			err = errConflict
		}
	}
	if err != nil {
		if errors.Is(err, errConflict) {
			return nil, fmt.Errorf("ConfigMap %s/%s: %w", Namespace, name, err)
		}
		return nil, fmt.Errorf("unable to write ConfigMap %s/%s: %w", Namespace, name, err)
	}
	return newRecord(cm, st, encoded), nil
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
	rec, err = r.readObject(ctx, ConfigMapName, -1, b.last)
	b.last = rec
	return rec, true, err
}

// readShard returns shard k: as this Revoker last read or wrote it unless
// fresh is set or it has none, else as read now.
func (r *Revoker) readShard(ctx context.Context, k int, fresh bool) (*record, error) {
	b := &r.batch
	if !fresh && b.shards[k] != nil {
		return b.shards[k], nil
	}
	rec, err := r.readObject(ctx, ShardName(k), k, b.shards[k])
	b.shards[k] = rec
	return rec, err
}

// readObject reads and decodes the record (shard < 0) or a shard; last is
// its copy, reused when the version read is the same. Nil on an error.
func (r *Revoker) readObject(ctx context.Context, name string, shard int, last *record) (*record, error) {
	cm, err := r.Client.CoreV1().ConfigMaps(Namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return &record{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("unable to read ConfigMap %s/%s: %w", Namespace, name, err)
	}
	if last != nil && last.cm != nil && cm.ResourceVersion != "" && last.cm.ResourceVersion == cm.ResourceVersion {
		return last, nil
	}
	s, err := decodeObject(cm, shard)
	if err != nil {
		return nil, err
	}
	return newRecord(cm, s, ""), nil
}

// copyState returns a copy of the record's state to change, or a new
// state where the ConfigMap is missing.
func (rec *record) copyState() *State {
	if rec.state == nil {
		return &State{Version: stateVersion, Shards: ShardCount}
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
