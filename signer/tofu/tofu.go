// Package tofu is the signer's trust on first use: the first stable identity
// a Machine proves (a TPM's EK hash, a cloud instance ID) is recorded on the
// management cluster, and from then on that identity belongs to that
// Machine only, and that Machine has that identity only.
//
// A record is a ConfigMap in the Machine's namespace named "ka-tofu-" +
// hex(SHA-256(identity)), so that two requests racing to claim one identity
// cannot both create it; it is owned by the Machine, so the garbage
// collector deletes it with the Machine. A ConfigMap, not a custom resource:
// the record is three strings, nothing in it is secret, and every management
// cluster serves ConfigMaps, so there is no CRD to install, version and
// upgrade before attestation works. The state lives in the API server only,
// so it survives controller restarts and leader changes.
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
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
)

// Deny reasons.
const (
	// ReasonIdentityClaimedByOtherMachine: the identity is recorded for
	// another Machine that still exists.
	ReasonIdentityClaimedByOtherMachine = attestor.ReasonIdentityClaimedByOtherMachine
	// ReasonMachineIdentityMismatch: the Machine is recorded with another
	// identity.
	ReasonMachineIdentityMismatch = attestor.ReasonMachineIdentityMismatch
)

// Names, labels and keys of a record.
const (
	// NamePrefix starts every record's name.
	NamePrefix = "ka-tofu-"
	// LabelIdentity holds the first 63 hex digits of SHA-256(identity) (a
	// label value is at most 63 characters), to find an identity's record
	// in any namespace.
	LabelIdentity = "kubelet-authenticator.x-k8s.io/tofu-identity"
	// LabelMachineUID holds the owning Machine's UID, to find a Machine's
	// records.
	LabelMachineUID = "kubelet-authenticator.x-k8s.io/tofu-machine-uid"
	// KeyIdentity, KeyMachine and KeyMachineUID are the record's data.
	KeyIdentity   = "identity"
	KeyMachine    = "machine"
	KeyMachineUID = "machineUID"
)

// Name returns the name of identity's record.
func Name(identity string) string { return NamePrefix + digest(identity) }

func digest(identity string) string {
	h := sha256.Sum256([]byte(identity))
	return hex.EncodeToString(h[:])
}

// Store records identities in ConfigMaps. It implements
// engine.IdentityBinder.
type Store struct {
	// Client creates and deletes records.
	Client client.Writer
	// Reader reads records and Machines from the API server (not a cache:
	// a decision must see the other replica's and the last leader's
	// records).
	Reader client.Reader

	// mu serializes Bind in this process, so that two CSRs of one Machine
	// with different identities cannot both find no record and create one
	// each. Another process can only race with this one across a leader
	// change; checkAfterCreate settles that case.
	mu sync.Mutex
}

var _ engine.IdentityBinder = (*Store)(nil)

// Bind implements engine.IdentityBinder: it records identity for m on
// first use, and accepts it again for m only. A conflict is a
// *attestor.DenyError; any other error is transient.
func (s *Store) Bind(ctx context.Context, m *engine.Machine, identity string) error {
	if m.UID == "" || identity == "" {
		return errors.New("trust on first use needs the Machine's UID and an identity")
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	// The identity, in any namespace: one device is one Machine, whichever
	// namespace (tenant) it is in.
	var byID corev1.ConfigMapList
	if err := s.Reader.List(ctx, &byID, client.MatchingLabels{LabelIdentity: digest(identity)[:63]}); err != nil {
		return fmt.Errorf("unable to list trust-on-first-use records: %w", err)
	}
	for i := range byID.Items {
		rec := &byID.Items[i]
		if rec.Data[KeyIdentity] != identity {
			continue
		}
		if rec.Data[KeyMachineUID] == string(m.UID) {
			return nil // bound before: the common case, every renewal
		}
		if err := s.claimedByOther(ctx, rec, m, identity); err != nil {
			return err
		}
	}

	// The Machine's other identities.
	mine, err := s.machineRecords(ctx, m)
	if err != nil {
		return err
	}
	for _, rec := range mine {
		if rec.Data[KeyIdentity] != identity {
			return mismatch(m, identity, &rec)
		}
	}

	rec := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: m.Namespace,
			Name:      Name(identity),
			Labels: map[string]string{
				LabelIdentity:   digest(identity)[:63],
				LabelMachineUID: string(m.UID),
			},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: clusterv1.GroupVersion.String(),
				Kind:       "Machine",
				Name:       m.Name,
				UID:        m.UID,
			}},
		},
		Data: map[string]string{
			KeyIdentity:   identity,
			KeyMachine:    m.Name,
			KeyMachineUID: string(m.UID),
		},
	}
	err = s.Client.Create(ctx, rec)
	if apierrors.IsAlreadyExists(err) {
		// Created by someone else since the list: decide on it.
		existing := &corev1.ConfigMap{}
		if err := s.Reader.Get(ctx, client.ObjectKeyFromObject(rec), existing); err != nil {
			return fmt.Errorf("unable to read trust-on-first-use record %s/%s: %w", rec.Namespace, rec.Name, err)
		}
		if existing.Data[KeyMachineUID] == string(m.UID) && existing.Data[KeyIdentity] == identity {
			return nil
		}
		if err := s.claimedByOther(ctx, existing, m, identity); err != nil {
			return err
		}
		return fmt.Errorf("trust-on-first-use record %s/%s is not readable as a record", rec.Namespace, rec.Name)
	}
	if err != nil {
		return fmt.Errorf("unable to record identity %s for Machine %s/%s: %w", identity, m.Namespace, m.Name, err)
	}
	return s.checkAfterCreate(ctx, m, identity, rec)
}

// claimedByOther decides on a record of identity for another Machine: a
// denial when that Machine exists, else (a Machine deleted or replaced under
// the same name, whose record the garbage collector has not removed yet)
// the stale record is removed and the caller retries.
func (s *Store) claimedByOther(ctx context.Context, rec *corev1.ConfigMap, m *engine.Machine, identity string) error {
	owner := rec.Data[KeyMachine]
	var other clusterv1.Machine
	err := s.Reader.Get(ctx, types.NamespacedName{Namespace: rec.Namespace, Name: owner}, &other)
	switch {
	case err == nil && string(other.UID) == rec.Data[KeyMachineUID]:
		return &attestor.DenyError{Reason: ReasonIdentityClaimedByOtherMachine, Message: fmt.Sprintf(
			"identity %s is bound to Machine %s/%s since %s (record ConfigMap %s/%s); one device serves one Machine. If the device moved to %s/%s on purpose, delete the old Machine or that ConfigMap",
			identity, rec.Namespace, owner, rec.CreationTimestamp.UTC().Format("2006-01-02T15:04:05Z"), rec.Namespace, rec.Name, m.Namespace, m.Name)}
	case err == nil || apierrors.IsNotFound(err):
		uid := rec.UID
		if derr := s.Client.Delete(ctx, rec, client.Preconditions{UID: &uid}); derr != nil && !apierrors.IsNotFound(derr) {
			return fmt.Errorf("unable to remove the stale trust-on-first-use record %s/%s of deleted Machine %s: %w", rec.Namespace, rec.Name, owner, derr)
		}
		return fmt.Errorf("removed the stale trust-on-first-use record %s/%s of deleted Machine %s; deciding again", rec.Namespace, rec.Name, owner)
	default:
		return fmt.Errorf("unable to read Machine %s/%s that identity %s is bound to: %w", rec.Namespace, owner, identity, err)
	}
}

func (s *Store) machineRecords(ctx context.Context, m *engine.Machine) ([]corev1.ConfigMap, error) {
	var list corev1.ConfigMapList
	if err := s.Reader.List(ctx, &list, client.InNamespace(m.Namespace), client.MatchingLabels{LabelMachineUID: string(m.UID)}); err != nil {
		return nil, fmt.Errorf("unable to list the trust-on-first-use records of Machine %s/%s: %w", m.Namespace, m.Name, err)
	}
	return list.Items, nil
}

// checkAfterCreate settles a race between two processes (across a leader
// change) that each recorded a different identity for m: the older record
// (by creation time, then name) stands and the other is removed.
func (s *Store) checkAfterCreate(ctx context.Context, m *engine.Machine, identity string, created *corev1.ConfigMap) error {
	mine, err := s.machineRecords(ctx, m)
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
	uid := created.UID
	if err := s.Client.Delete(ctx, created, client.Preconditions{UID: &uid}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("unable to withdraw trust-on-first-use record %s/%s: %w", created.Namespace, created.Name, err)
	}
	return mismatch(m, identity, &mine[0])
}

func mismatch(m *engine.Machine, identity string, rec *corev1.ConfigMap) error {
	return &attestor.DenyError{Reason: ReasonMachineIdentityMismatch, Message: fmt.Sprintf(
		"Machine %s/%s is bound to identity %s since %s (record ConfigMap %s/%s), not %s; if the machine's device was replaced on purpose, delete that ConfigMap",
		m.Namespace, m.Name, rec.Data[KeyIdentity], rec.CreationTimestamp.UTC().Format("2006-01-02T15:04:05Z"), rec.Namespace, rec.Name, identity)}
}
