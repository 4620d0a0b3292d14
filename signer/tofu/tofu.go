// Package tofu is the signer's trust on first use: the first stable identity
// a Machine proves (a TPM's EK hash, a cloud instance ID) is recorded on the
// management cluster, and from then on that identity belongs to that
// Machine only, and that Machine has that identity only.
//
// A record is a ConfigMap named "ka-tofu-" + hex(SHA-256(identity)) in one
// namespace, the controller's own (Store.Namespace): only the controller
// (and the management cluster's administrators) can write there, never a
// tenant who administers the namespace of its Clusters and Machines. The
// name derived from the identity makes the identity unique across the whole
// management cluster, whichever namespace its Machine is in, and makes
// claiming it atomic: of two requests racing to claim one identity only one
// can create the record. Records of the old layout (in Machine namespaces,
// owned by the Machine) are not read.
//
// A record cannot be owned by its Machine (owner references do not cross
// namespaces), so Cleaner removes the records of a Machine once it is
// deleted.
//
// A ConfigMap, not a custom resource: the record is a few strings, nothing
// in it is secret, and every management cluster serves ConfigMaps, so there
// is no CRD to install, version and upgrade before attestation works. The
// state lives in the API server only, so it survives controller restarts
// and leader changes.
package tofu

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"sync"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"k8s.io/utils/keymutex"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
)

// ClaimedByOtherMessage is all a denied requester learns when its identity
// is bound to another Machine: that Machine may be another tenant's, so the
// workload cluster is not told which one. The controller's log says, which
// admin (Store.Administrator) can read.
func ClaimedByOtherMessage(admin string) string {
	return "this identity is bound to another Machine; one device serves one Machine; " + admin + " can see which one in the controller's log"
}

// DefaultAdministrator is who, in denial messages, can read the
// controller's log and delete records when Store.Administrator is empty.
const DefaultAdministrator = "the management cluster's administrator"

// Names, labels and keys of a record.
const (
	// NamePrefix starts every record's name.
	NamePrefix = "ka-tofu-"
	// LabelIdentity holds the first 63 hex digits of SHA-256(identity) (a
	// label value is at most 63 characters); every record has it.
	LabelIdentity = "kubelet-authenticator.x-k8s.io/tofu-identity"
	// LabelMachineUID holds the Machine's UID, to find a Machine's
	// records.
	LabelMachineUID = "kubelet-authenticator.x-k8s.io/tofu-machine-uid"
	// KeyIdentity, KeyMachineNamespace, KeyMachine and KeyMachineUID are
	// the record's data.
	KeyIdentity         = "identity"
	KeyMachineNamespace = "machineNamespace"
	KeyMachine          = "machine"
	KeyMachineUID       = "machineUID"
)

// Name returns the name of identity's record.
func Name(identity string) string { return NamePrefix + digest(identity) }

func digest(identity string) string {
	h := sha256.Sum256([]byte(identity))
	return hex.EncodeToString(h[:])
}

// Store records identities in ConfigMaps in Namespace. It implements
// engine.IdentityBinder.
type Store struct {
	// Namespace is where records are kept and looked up: the controller's
	// own, where tenants cannot write. Required.
	Namespace string
	// Client creates and deletes records.
	Client client.Writer
	// Reader reads records and Machines from the API server (not a cache:
	// a decision must see the other replica's and the last leader's
	// records).
	Reader client.Reader
	// Owners, when set, says whether a record's owner still exists in
	// place of Cluster API Machines (standalone mode: allowlist entries).
	Owners Owners
	// Administrator names, in denial messages, who can read the
	// controller's log and delete its records; empty means
	// DefaultAdministrator.
	Administrator string

	// machines serializes Bind per Machine UID in this process (in
	// bindLocks stripes), so that two CSRs of one Machine with different
	// identities cannot both find no record and create one each. Binds of
	// other Machines run at once (a fleet's first joins): two Machines
	// claiming one identity race on creating its one record, whose name the
	// identity decides, and the loser finds it. Another process can only
	// race with this one across a leader change; checkAfterCreate settles
	// that case.
	machines     keymutex.KeyMutex
	machinesOnce sync.Once
}

// Owners says whether the owner a record names still exists: the same
// namespace, name and UID. A lookup error is transient.
type Owners interface {
	OwnerExists(ctx context.Context, owner types.NamespacedName, uid types.UID) (bool, error)
}

// machineOwners are Cluster API Machines read through a client.
type machineOwners struct{ client.Reader }

func (m machineOwners) OwnerExists(ctx context.Context, owner types.NamespacedName, uid types.UID) (bool, error) {
	var machine clusterv1.Machine
	err := m.Get(ctx, owner, &machine)
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, err
	}
	return machine.UID == uid, nil
}

// owners returns the owner lookup: Owners, else Machines read through r.
func (s *Store) owners(r client.Reader) Owners {
	if s.Owners != nil {
		return s.Owners
	}
	return machineOwners{r}
}

// bindLocks is how many Binds of different Machines may run at once (the
// stripes of a hashed key mutex: two Machines may share one).
const bindLocks = 64

var _ engine.IdentityBinder = (*Store)(nil)

// Bind implements engine.IdentityBinder: it records identity for m on
// first use, and accepts it again for m only. A conflict is a
// *attestor.DenyError; any other error is transient. A denial's message
// names no other Machine; the log of ctx does.
func (s *Store) Bind(ctx context.Context, m *engine.Machine, identity string) error {
	if s.Namespace == "" {
		return errors.New("trust on first use has no namespace to keep its records in")
	}
	if m.UID == "" || identity == "" {
		return errors.New("trust on first use needs the Machine's UID and an identity")
	}
	s.machinesOnce.Do(func() { s.machines = keymutex.NewHashed(bindLocks) })
	s.machines.LockKey(string(m.UID))
	defer func() { _ = s.machines.UnlockKey(string(m.UID)) }() // a hashed key mutex always unlocks

	// The identity's record, wherever its Machine is: one device is one
	// Machine, whichever namespace (tenant) it is in.
	key := types.NamespacedName{Namespace: s.Namespace, Name: Name(identity)}
	rec := &corev1.ConfigMap{}
	err := s.Reader.Get(ctx, key, rec)
	switch {
	case err == nil:
		return s.decide(ctx, rec, m, identity)
	case !apierrors.IsNotFound(err):
		return fmt.Errorf("unable to read trust-on-first-use record %s: %w", key, err)
	}

	// The Machine's other identities.
	mine, err := s.machineRecords(ctx, m.UID)
	if err != nil {
		return err
	}
	for i := range mine {
		if mine[i].Data[KeyIdentity] != identity {
			return s.mismatch(m, identity, &mine[i])
		}
	}

	rec = &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: key.Namespace,
			Name:      key.Name,
			Labels: map[string]string{
				LabelIdentity:                  digest(identity)[:63],
				LabelMachineUID:                string(m.UID),
				"app.kubernetes.io/managed-by": "node-attestation-controller",
			},
		},
		Data: map[string]string{
			KeyIdentity:         identity,
			KeyMachineNamespace: m.Namespace,
			KeyMachine:          m.Name,
			KeyMachineUID:       string(m.UID),
		},
	}
	err = s.Client.Create(ctx, rec)
	if apierrors.IsAlreadyExists(err) {
		// Created by someone else since the read: decide on it.
		existing := &corev1.ConfigMap{}
		if err := s.Reader.Get(ctx, key, existing); err != nil {
			return fmt.Errorf("unable to read trust-on-first-use record %s: %w", key, err)
		}
		return s.decide(ctx, existing, m, identity)
	}
	if err != nil {
		return fmt.Errorf("unable to record identity %s for Machine %s: %w", identity, m, err)
	}
	return s.checkAfterCreate(ctx, m, identity, rec)
}

// decide decides on the existing record of identity.
func (s *Store) decide(ctx context.Context, rec *corev1.ConfigMap, m *engine.Machine, identity string) error {
	if rec.Data[KeyIdentity] != identity || rec.Data[KeyMachineUID] == "" || rec.Data[KeyMachineNamespace] == "" || rec.Data[KeyMachine] == "" {
		return fmt.Errorf("trust-on-first-use record %s/%s is not readable as a record of %s", rec.Namespace, rec.Name, identity)
	}
	if rec.Data[KeyMachineUID] == string(m.UID) {
		return nil // bound before: the common case, every renewal
	}
	return s.claimedByOther(ctx, rec, m, identity)
}

// claimedByOther decides on a record of identity for another Machine: a
// denial when that Machine exists, else (a Machine deleted or replaced under
// the same name, whose record Cleaner has not removed yet) the stale record
// is removed and the caller retries.
func (s *Store) claimedByOther(ctx context.Context, rec *corev1.ConfigMap, m *engine.Machine, identity string) error {
	owner := types.NamespacedName{Namespace: rec.Data[KeyMachineNamespace], Name: rec.Data[KeyMachine]}
	exists, err := s.owners(s.Reader).OwnerExists(ctx, owner, types.UID(rec.Data[KeyMachineUID]))
	switch {
	case err != nil:
		return fmt.Errorf("unable to read Machine %s that identity %s is bound to: %w", owner, identity, err)
	case exists:
		// The other Machine may be another tenant's: the requester (the
		// workload cluster's CSR condition, the Machine's Event) is told
		// only that it is another; the management cluster's log says which.
		klog.FromContext(ctx).Info("Identity is bound to another Machine",
			"identity", identity, "requestingMachine", m.String(), "boundMachine", owner.String(),
			"boundSince", rec.CreationTimestamp.UTC().Format("2006-01-02T15:04:05Z"),
			"record", types.NamespacedName{Namespace: rec.Namespace, Name: rec.Name}.String(),
			"fix", "if the device moved on purpose, delete the bound Machine or the record")
		return &attestor.DenyError{Reason: attestor.ReasonIdentityClaimedByOtherMachine, Message: ClaimedByOtherMessage(s.administrator())}
	}
	if err := s.remove(ctx, rec); err != nil {
		return fmt.Errorf("unable to remove the stale trust-on-first-use record %s/%s of deleted Machine %s: %w", rec.Namespace, rec.Name, owner, err)
	}
	return fmt.Errorf("removed the stale trust-on-first-use record %s/%s of deleted Machine %s; deciding again", rec.Namespace, rec.Name, owner)
}

// remove deletes rec, the very object read (UID precondition).
func (s *Store) remove(ctx context.Context, rec *corev1.ConfigMap) error {
	uid := rec.UID
	if err := s.Client.Delete(ctx, rec, client.Preconditions{UID: &uid}); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return err
	}
	return nil
}

func (s *Store) machineRecords(ctx context.Context, uid types.UID) ([]corev1.ConfigMap, error) {
	var list corev1.ConfigMapList
	if err := s.Reader.List(ctx, &list, client.InNamespace(s.Namespace), client.MatchingLabels{LabelMachineUID: string(uid)}); err != nil {
		return nil, fmt.Errorf("unable to list the trust-on-first-use records of Machine UID %s: %w", uid, err)
	}
	return list.Items, nil
}

// checkAfterCreate settles a race between two processes (across a leader
// change) that each recorded a different identity for m: the older record
// (by creation time, then name) stands and the other is removed.
func (s *Store) checkAfterCreate(ctx context.Context, m *engine.Machine, identity string, created *corev1.ConfigMap) error {
	mine, err := s.machineRecords(ctx, m.UID)
	if err != nil {
		return err
	}
	slices.SortFunc(mine, func(a, b corev1.ConfigMap) int {
		if c := a.CreationTimestamp.Compare(b.CreationTimestamp.Time); c != 0 {
			return c
		}
		if a.Name < b.Name {
			return -1
		}
		return 1
	})
	if len(mine) == 0 || mine[0].Data[KeyIdentity] == identity {
		return nil
	}
	if err := s.remove(ctx, created); err != nil {
		return fmt.Errorf("unable to withdraw trust-on-first-use record %s/%s: %w", created.Namespace, created.Name, err)
	}
	return s.mismatch(m, identity, &mine[0])
}

// mismatch denies m another identity than its recorded one. The message
// names only the requester's own Machine and identities.
func (s *Store) mismatch(m *engine.Machine, identity string, rec *corev1.ConfigMap) error {
	return &attestor.DenyError{Reason: attestor.ReasonMachineIdentityMismatch, Message: fmt.Sprintf(
		"%s is bound to identity %s since %s, not %s; if the machine's device was replaced on purpose, %s deletes the record %s/%s",
		m.Describe(), rec.Data[KeyIdentity], rec.CreationTimestamp.UTC().Format("2006-01-02T15:04:05Z"), identity, s.administrator(), rec.Namespace, rec.Name)}
}

func (s *Store) administrator() string {
	if s.Administrator == "" {
		return DefaultAdministrator
	}
	return s.Administrator
}

// Forget removes the records of the Machine with uid, once it is deleted.
func (s *Store) Forget(ctx context.Context, uid types.UID) error {
	recs, err := s.machineRecords(ctx, uid)
	if err != nil {
		return err
	}
	var errs []error
	for i := range recs {
		if err := s.remove(ctx, &recs[i]); err != nil {
			errs = append(errs, fmt.Errorf("unable to remove trust-on-first-use record %s/%s: %w", recs[i].Namespace, recs[i].Name, err))
		}
	}
	return errors.Join(errs...)
}

// Sweep removes every record whose Machine no longer exists (or exists
// under a new UID): the ones whose deletion was not seen. Machines are
// looked up in cached first, when it is not nil (the manager's cache), and
// a Machine it does not have is confirmed gone from the API server before
// its record is removed. It returns the names of the records removed.
func (s *Store) Sweep(ctx context.Context, cached client.Reader) ([]string, error) {
	var list corev1.ConfigMapList
	if err := s.Reader.List(ctx, &list, client.InNamespace(s.Namespace), client.HasLabels{LabelIdentity}); err != nil {
		return nil, fmt.Errorf("unable to list trust-on-first-use records: %w", err)
	}
	var removed []string
	var errs []error
	for i := range list.Items {
		rec := &list.Items[i]
		owner := types.NamespacedName{Namespace: rec.Data[KeyMachineNamespace], Name: rec.Data[KeyMachine]}
		if owner.Namespace == "" || owner.Name == "" {
			continue // not a record this package wrote: not ours to remove
		}
		uid := types.UID(rec.Data[KeyMachineUID])
		if cached != nil && s.Owners == nil {
			if ok, err := s.owners(cached).OwnerExists(ctx, owner, uid); err == nil && ok {
				continue
			}
		}
		ok, err := s.owners(s.Reader).OwnerExists(ctx, owner, uid)
		if err != nil {
			errs = append(errs, fmt.Errorf("unable to read Machine %s: %w", owner, err))
			continue
		}
		if ok {
			continue
		}
		if err := s.remove(ctx, rec); err != nil {
			errs = append(errs, fmt.Errorf("unable to remove trust-on-first-use record %s/%s: %w", rec.Namespace, rec.Name, err))
			continue
		}
		removed = append(removed, rec.Name)
	}
	return removed, errors.Join(errs...)
}
