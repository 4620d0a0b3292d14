// Package revoke makes the node names of deleted Machines unusable in their
// workload cluster before the client certificates issued to them expire.
//
// Kubernetes has no revocation for client certificates: a kubelet whose
// Machine was deleted keeps its certificate, valid for days, and with it
// the node's write access. In each workload cluster the controller keeps a
// ValidatingAdmissionPolicy and its binding (PolicyName) that list the
// revoked node names. The policy refuses every write (create, update,
// patch, delete, connect) by a
// requester named system:node:<name> whose name is listed, unless the
// client certificate it authenticated with (its fingerprint, which
// kube-apiserver puts in the user's extra
// authentication.kubernetes.io/credential-id as X509SHA256=<hex>) was issued
// by the controller to a live Machine of that name: a new Machine that
// joined after the revocation, or another Machine that already claimed the
// name (the same Hostname or InternalDNS address) when it was revoked.
//
// Every certificate the controller hands out is recorded first (State's
// Issued: fingerprint, node name, Machine, expiry). When a Machine is
// deleted, its node names are revoked whoever else claims them, the names
// it was issued certificates for among them, and the certificates issued
// for those names to the Machines that still claim them are accepted: the
// deleted Machine's certificates are refused, the live claimant's work.
//
// A name is listed for the longest lifetime of a client certificate (the
// signer's cap) after the revocation: by then every certificate issued
// before it has expired and the entry is dropped, so the list stays bounded.
// A name is lifted only for the certificates the controller signs for a
// live Machine: a Machine object of that name alone lifts nothing.
//
// # Where it is kept
//
// The record is a ConfigMap (Namespace/ConfigMapName) whose key State.json
// holds the entries (strict JSON, "version": "v2", "shards": ShardCount).
// The issued certificates and the denials, which grow with the fleet, are
// in ShardCount shards next to it (ShardName: the record's name, a dash,
// two digits), ConfigMaps of the same labels and format whose State.json
// holds the certificates and denials of the node names that hash to it
// (ShardOf: the first byte of the SHA-256 of the name). A certificate
// takes about 370 bytes: at 20,000 live certificates (5,000 nodes with
// renewals overlapping) a shard holds about 310 of them, about 115 KiB; a
// shard fills the API server's 1 MiB at about 2,800, near 170,000 in the
// cluster. The record holds about 1 KB per revoked name. A join writes
// its node's shard (and the record only when its name is revoked).
//
// The policy is derived from the record on every change: the revoked
// names, their messages and the accepted certificates are literals in the
// policy's CEL variables. The policy does not take the ConfigMap as its
// parameter: kube-apiserver 1.36 stops its informer of a built-in
// parameter kind when the last binding that uses it goes away and never
// restarts it (the shared informer factory starts a type once), so after
// a binding is deleted and created again, changes to the parameter are not
// seen until kube-apiserver restarts. A policy that carries its data has
// no such cache.
//
// # Accept against Revoke, across objects
//
// Accept records a certificate c for name X in X's shard, then reads the
// record: if X is revoked (for another Machine), it accepts c there. Revoke
// writes X's entry in the record, then reads X's shard: every certificate
// recorded there for X whose Machine still claims X is accepted. Each
// write is conditional on the version read (a conflict reads again), and
// a read without a resourceVersion is served at the API server's latest
// (etcd's linearizable read). A batch (update) ends only with a round that
// has nothing left to write, decided on the record read after every
// write of the batch, and, where it wrote entries, on their shards read
// after that. So, for a concurrent Accept of c (Machine L, X) and Revoke of
// X (Machine m):
//
//   - If Accept's last read of the record comes after Revoke's write of
//     X's entry, Accept sees the entry: L is not m, so c is accepted; L is
//     m, so Accept returns ErrRevokedMachine, c is not handed out, and its
//     record is dropped.
//   - Otherwise Accept's write of c came before that read, before Revoke's
//     write, before Revoke's last read of X's shard: Revoke sees c and
//     accepts it if L claims X (never if L is m).
//
// Both may see each other: accepting twice is one acceptance. Neither
// ever accepts a certificate of m for a name m's deletion revoked.
//
// A batch cut short (a crash, a lost connection, conflicts given up on)
// leaves the objects as its last round left them. A certificate recorded
// in a shard and not accepted has not been handed out (Accept returns
// only after its last round). An entry written in Revoke's first round
// may lack a certificate that Revoke's next round would have accepted
// (recorded between its read of the shards and its write): the policy,
// derived from the record when the next Ensure runs, then refuses that
// certificate until Revoke is done again, which the caller does right
// after (a deleted Machine's revocation stays pending in the management
// cluster until Revoke returns). Revoke forgets the deleted Machine's
// issued certificates only in a round after every name they name is
// listed, so a Revoke done again still finds them.
//
// # Other versions
//
// A record of version "v1" (releases without shards) holds the issued
// certificates and denials itself. It is read as it is (its certificates
// are honoured: Revoke finds them, the pod signer reads their
// attestations), and the first write moves them to their shards: the
// record is rewritten as "v2" first, still holding them, then the shards
// are written, then the record without them; a move cut short leaves a
// certificate in both, read once. A release without shards refuses a "v2"
// record (ErrMalformed) and never overwrites it: during a rolling upgrade
// an older replica serving a Cluster after a newer one signs without
// recording (Unenforceable), retries its revocations (kept pending until
// a newer replica writes them) and issues no pod certificate, rather than
// decide on a record whose certificates it cannot see.
package revoke

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/validate/content"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	admissionregistrationv1client "k8s.io/client-go/kubernetes/typed/admissionregistration/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"

	sigsjson "sigs.k8s.io/json"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Names of what the controller keeps in each workload cluster.
const (
	// PolicyName names the ValidatingAdmissionPolicy and its binding.
	PolicyName = "kubelet-authenticator-revoked-nodes"
	// Namespace and ConfigMapName name the policy's parameter.
	Namespace     = metav1.NamespaceSystem
	ConfigMapName = "kubelet-authenticator-revoked-nodes"
	// StateKey is the ConfigMap key holding the entries.
	StateKey = "State.json"
	// CredentialIDExtra is the user info extra kube-apiserver sets to an
	// authenticating client certificate's fingerprint (X509SHA256=<hex>).
	CredentialIDExtra = "authentication.kubernetes.io/credential-id"
	// FieldManager is the manager of the controller's writes.
	FieldManager = "node-attestation-controller"
	// stateVersion is the version of State.json the controller writes:
	// the record holds the entries, the shards the issued certificates
	// and the denials. legacyVersion is the record of releases without
	// shards, which held them all; it is read, and moved to shards at
	// the first write.
	stateVersion  = "v2"
	legacyVersion = "v1"
	// ShardCount is the number of shard ConfigMaps (ShardName) the issued
	// certificates and the denials are spread over by node name.
	ShardCount = 64
	// maxAllowed bounds the certificates accepted per revoked name: a
	// node renews a few times within a certificate lifetime.
	maxAllowed = 32
	// Margin is added to how long a name stays listed, for clock skew
	// between the controller's replicas and the API server.
	Margin = 5 * time.Minute
)

// managedLabels mark the objects the controller keeps.
var managedLabels = map[string]string{"app.kubernetes.io/managed-by": "node-attestation-controller", "app.kubernetes.io/part-of": "kubelet-authenticator"}

// Machine is a deleted Machine, as a revocation names it.
type Machine struct {
	Namespace string    `json:"namespace"`
	Name      string    `json:"name"`
	UID       types.UID `json:"uid"`
	// Source is what the Machine is: "" a Cluster API Machine,
	// SourceAllowlist an allowlist entry of standalone mode.
	Source string `json:"source,omitempty"`
}

// SourceAllowlist is the Source of a standalone mode allowlist entry.
const SourceAllowlist = "allowlist"

func (m Machine) String() string { return m.Namespace + "/" + m.Name }

// valid reports whether m's names are what the API server accepts for a
// Machine (they are written into the policy).
func (m Machine) valid() bool {
	return len(validation.IsDNS1123Label(m.Namespace)) == 0 && len(validation.IsDNS1123Subdomain(m.Name)) == 0
}

// Entry is one revoked node name.
type Entry struct {
	// Node is the node name.
	Node string `json:"node"`
	// Machine is the deleted Machine that was the node.
	Machine Machine `json:"machine"`
	// RevokedAt is when the controller saw the Machine gone; Until is when
	// every certificate issued before then has expired.
	RevokedAt time.Time `json:"revokedAt"`
	Until     time.Time `json:"until"`
	// Accepted are the certificates the controller issued for the name
	// after the revocation (to a new Machine).
	Accepted []Credential `json:"accepted,omitempty"`
}

// Credential is a certificate the controller issued.
type Credential struct {
	// SHA256 is the lower-case hex SHA-256 of the certificate's DER.
	SHA256 string `json:"sha256"`
	// Node is the node name it was issued for (in State.Issued; an
	// entry's accepted certificates are its node's).
	Node string `json:"node,omitempty"`
	// Machine is the Machine it was issued for.
	Machine  Machine   `json:"machine"`
	NotAfter time.Time `json:"notAfter"`
	// Attested is what the controller verified before it issued the
	// certificate (in State.Issued); nil in records written before it was
	// kept.
	Attested *Attestation `json:"attested,omitempty"`
}

// Attestation is what the controller verified before it issued a node's
// client certificate. The pod certificates issued for the node's pods carry
// it (package signer/podcert/podattest).
type Attestation struct {
	// Provider is the attestor whose evidence was verified (tpm, aws, ...).
	Provider string `json:"provider"`
	// PolicySHA256 is the lower-case hex SHA-256 of the provider's policy
	// document the evidence passed (the TPM boot policy); empty when the
	// Cluster has none for the provider.
	PolicySHA256 string `json:"policySHA256,omitempty"`
	// At is when the certificate was recorded, right after its evidence
	// was verified (set by Accept).
	At time.Time `json:"at"`
}

// valid reports whether a is what Accept records.
func (a *Attestation) valid() bool {
	if a == nil {
		return true
	}
	if !attestor.ValidProviderName(a.Provider) || a.At.IsZero() {
		return false
	}
	if a.PolicySHA256 == "" {
		return true
	}
	b, err := hex.DecodeString(a.PolicySHA256)
	return err == nil && len(b) == sha256.Size && strings.ToLower(a.PolicySHA256) == a.PolicySHA256
}

// State is what State.json holds.
type State struct {
	Version string `json:"version"`
	// Shards is the number of shards (ShardCount) in the record and in
	// each shard; absent in a legacy record.
	Shards  int     `json:"shards,omitempty"`
	Entries []Entry `json:"entries"`
	// Issued are the unexpired client certificates the controller issued
	// in the cluster, recorded before they were handed out, at most
	// maxAllowed per Machine in a shard: when a Machine is deleted they
	// tell its certificates from those of another Machine claiming its
	// name. Kept in the shards of their node names (a legacy record holds
	// them until its first write moves them); a state holds those of the
	// shards it was read from, each node's in the order recorded.
	Issued []Credential `json:"issued,omitempty"`
	// Denied are the latest denied renewals of the nodes Issued holds a
	// certificate of, at most one per node, recorded before the denial
	// was written (Deny), kept with Issued: the pod signer issues nothing for a node whose
	// renewal was denied after its current certificate, long after the
	// workload cluster has deleted the denied request.
	Denied []Denial `json:"denied,omitempty"`

	// unknown are the top-level fields of State.json this version does
	// not know (a newer controller's), kept as read and written back.
	unknown map[string]json.RawMessage
}

// Denial is a denied renewal: a client certificate request filed with a
// node's own credential (requester system:node:<name>) that the
// controller denied.
type Denial struct {
	// Node is the node name.
	Node string `json:"node"`
	// Request is the name of the CertificateSigningRequest denied.
	Request string `json:"request"`
	// Reason is the reason of its Denied condition.
	Reason string `json:"reason"`
	// At is when the denial was recorded, right before it was written.
	At time.Time `json:"at"`
}

// FindDenial returns the recorded denial of node's renewal, or nil. It is
// later than every certificate State.Issued holds for node: recording a
// newer certificate drops it (Accept).
func (s *State) FindDenial(node string) *Denial {
	for i := range s.Denied {
		if s.Denied[i].Node == node {
			return &s.Denied[i]
		}
	}
	return nil
}

// maxReasonLength bounds a denial's reason, as the API server bounds a
// condition's.
const maxReasonLength = 1024

// valid reports whether d is what Deny records.
func (d *Denial) valid() bool {
	return len(validation.IsDNS1123Subdomain(d.Node)) == 0 && validCSRName(d.Request) && !d.At.IsZero() &&
		len(d.Reason) <= maxReasonLength && conditionReason.MatchString(d.Reason)
}

// conditionReason is what the API server accepts as a condition's reason
// (metav1.Condition): the signer's reasons are CamelCase.
var conditionReason = regexp.MustCompile(`^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`)

// validCSRName reports whether name is a name the API server accepts for a
// CertificateSigningRequest (a path segment) of at most 253 bytes.
func validCSRName(name string) bool {
	return len(name) > 0 && len(name) <= validation.DNS1123SubdomainMaxLength && len(content.IsPathSegmentName(name)) == 0 &&
		strings.IndexFunc(name, func(r rune) bool { return r < 0x20 || r == 0x7f }) < 0
}

// Find returns the entry of node, or nil.
func (s *State) Find(node string) *Entry {
	for i := range s.Entries {
		if s.Entries[i].Node == node {
			return &s.Entries[i]
		}
	}
	return nil
}

// Message is what the policy answers a refused request of e's node.
func (e *Entry) Message() string {
	if e.Machine.Source == SourceAllowlist {
		return fmt.Sprintf("node %s was revoked: its entry was taken out of the allowlist in namespace %s at %s; "+
			"certificates issued to the node before then are refused until %s. A node allowlisted again joins through "+
			"the node-attestation-controller, which accepts the certificates it issues to it",
			e.Node, e.Machine.Namespace, e.RevokedAt.UTC().Format(time.RFC3339), e.Until.UTC().Format(time.RFC3339))
	}
	return fmt.Sprintf("node %s was revoked: its Machine %s was deleted from the management cluster at %s; "+
		"certificates issued to the node before then are refused until %s. A new Machine of this name joins through "+
		"the node-attestation-controller, which accepts the certificates it issues to it",
		e.Node, e.Machine, e.RevokedAt.UTC().Format(time.RFC3339), e.Until.UTC().Format(time.RFC3339))
}

// Fingerprint returns the credential ID hex of cert (SHA-256 of its DER).
func Fingerprint(cert *x509.Certificate) string {
	sum := sha256.Sum256(cert.Raw)
	return hex.EncodeToString(sum[:])
}

// ErrMalformed is returned when the ConfigMap is not what the controller
// writes: someone else edited it. The controller does not overwrite it (it
// would drop revocations); delete it and the controller writes a new one
// (and forgets the revocations it held).
var ErrMalformed = errors.New("not written by node-attestation-controller")

// Unenforceable reports whether err, from Accept or Deny, says that
// revocation cannot work in the cluster until someone fixes it (its RBAC,
// an API server without ValidatingAdmissionPolicy, a record someone else
// edited): the certificate is then handed out without waiting for that,
// since were its name revoked the node would be refused until the fix and
// a renewal; the denial is written, since the pod signer, which reads the
// same record, issues nothing while it cannot read it (and where only the
// policy is missing, the record was written).
func Unenforceable(err error) bool {
	return err != nil && !errors.Is(err, ErrRevokedMachine) &&
		(apierrors.IsForbidden(err) || apierrors.IsNotFound(err) || errors.Is(err, ErrMalformed))
}

// ErrRevokedMachine is returned by Accept for a certificate issued to the
// very Machine whose deletion revoked the name.
var ErrRevokedMachine = errors.New("the certificate was issued to the deleted Machine")

// Decode reads the state held by the record (the ConfigMap ConfigMapName)
// and by shards, any of the shard ConfigMaps (ShardName): the entries of
// the record, and the issued certificates and denials of the shards given
// (with those a legacy record still holds, not yet moved to their shards).
// A nil record is a missing one. Duplicate fields, field names that differ
// from the state's only in case, trailing data, a shard holding what
// belongs to another (or entries), and every value this version reads but
// does not accept are errors.
//
// Fields this version does not know are ignored: the record is written
// only by controllers, of this version or a newer one during a rolling
// upgrade, and a newer one may add fields; an older replica that refused
// them would stop issuing and revoking in the cluster until the upgrade
// ends. Every field read is still validated strictly. Unknown top-level
// fields are written back as read (data); unknown fields inside an entry
// are dropped when this version rewrites the record, so a newer version
// adds what an older replica must keep at the top level.
func Decode(record *corev1.ConfigMap, shards ...*corev1.ConfigMap) (*State, error) {
	s := &State{Version: stateVersion, Shards: ShardCount}
	if record != nil {
		var err error
		if s, err = decodeObject(record, -1); err != nil {
			return nil, err
		}
	}
	parts := make([]*State, ShardCount)
	for _, cm := range shards {
		k, ok := shardIndex(cm.Name)
		if !ok {
			return nil, fmt.Errorf("ConfigMap %s/%s is not a shard of the record", cm.Namespace, cm.Name)
		}
		p, err := decodeObject(cm, k)
		if err != nil {
			return nil, err
		}
		parts[k] = p
	}
	return merge(s, parts), nil
}

// Read reads, as they are now, the record and the shards of nodes (every
// shard when no node is given) and returns their state (Decode). A missing
// shard holds nothing; a missing record is an error (NotFound). What it
// reads is bounded by the number of ConfigMaps (at most ShardCount+1) and
// the API server's bound on each.
func Read(ctx context.Context, c corev1client.ConfigMapsGetter, nodes ...string) (*State, error) {
	cms := c.ConfigMaps(Namespace)
	rec, err := cms.Get(ctx, ConfigMapName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("unable to read ConfigMap %s/%s: %w", Namespace, ConfigMapName, err)
	}
	want := map[int]bool{}
	for _, n := range nodes {
		want[ShardOf(n)] = true
	}
	var shards []*corev1.ConfigMap
	for k := range ShardCount {
		if len(nodes) > 0 && !want[k] {
			continue
		}
		cm, err := cms.Get(ctx, ShardName(k), metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("unable to read ConfigMap %s/%s: %w", Namespace, ShardName(k), err)
		}
		shards = append(shards, cm)
	}
	return Decode(rec, shards...)
}

// decodeObject decodes and validates the record (shard < 0) or the shard
// of that index.
func decodeObject(cm *corev1.ConfigMap, shard int) (*State, error) {
	raw, ok := cm.Data[StateKey]
	if !ok {
		return nil, fmt.Errorf("ConfigMap %s/%s has no %s: %w", cm.Namespace, cm.Name, StateKey, ErrMalformed)
	}
	s, err := decodeState([]byte(raw))
	if err != nil {
		return nil, fmt.Errorf("ConfigMap %s/%s %s: %w: %w", cm.Namespace, cm.Name, StateKey, err, ErrMalformed)
	}
	switch {
	case shard < 0 && s.Version == legacyVersion && s.Shards == 0:
	case s.Version == stateVersion && s.Shards == ShardCount:
	default:
		return nil, fmt.Errorf("ConfigMap %s/%s %s has version %q of %d shards, want %q of %d: %w", cm.Namespace, cm.Name, StateKey, s.Version, s.Shards,
			stateVersion, ShardCount, ErrMalformed)
	}
	if shard >= 0 && len(s.Entries) > 0 {
		return nil, fmt.Errorf("ConfigMap %s/%s %s is a shard holding entries: %w", cm.Namespace, cm.Name, StateKey, ErrMalformed)
	}
	for _, e := range s.Entries {
		if len(validation.IsDNS1123Subdomain(e.Node)) > 0 || !e.Machine.valid() {
			return nil, fmt.Errorf("ConfigMap %s/%s %s has an entry for node %q, Machine %q: %w", cm.Namespace, cm.Name, StateKey, e.Node, e.Machine, ErrMalformed)
		}
		for _, c := range e.Accepted {
			if !validFingerprint(c.SHA256) || !c.Machine.valid() {
				return nil, fmt.Errorf("ConfigMap %s/%s %s has a malformed fingerprint for node %q: %w", cm.Namespace, cm.Name, StateKey, e.Node, ErrMalformed)
			}
		}
	}
	for _, c := range s.Issued {
		if !validFingerprint(c.SHA256) || !c.Machine.valid() || len(validation.IsDNS1123Subdomain(c.Node)) > 0 || !c.Attested.valid() ||
			(shard >= 0 && ShardOf(c.Node) != shard) {
			return nil, fmt.Errorf("ConfigMap %s/%s %s has a malformed issued certificate for node %q: %w", cm.Namespace, cm.Name, StateKey, c.Node, ErrMalformed)
		}
	}
	for i, d := range s.Denied {
		if !d.valid() || slices.ContainsFunc(s.Denied[:i], func(o Denial) bool { return o.Node == d.Node }) || (shard >= 0 && ShardOf(d.Node) != shard) {
			return nil, fmt.Errorf("ConfigMap %s/%s %s has a malformed denial for node %q: %w", cm.Namespace, cm.Name, StateKey, d.Node, ErrMalformed)
		}
	}
	return s, nil
}

func validFingerprint(fp string) bool {
	b, err := hex.DecodeString(fp)
	return err == nil && len(b) == sha256.Size && strings.ToLower(fp) == fp
}

// ShardOf returns the index of the shard holding node's issued
// certificates and denial: the first byte of the SHA-256 of its name,
// modulo ShardCount (a divisor of 256, so every shard is as likely).
func ShardOf(node string) int {
	sum := sha256.Sum256([]byte(node))
	return int(sum[0]) % ShardCount
}

// ShardName returns the name of the ConfigMap, next to the record, that
// is the shard of that index.
func ShardName(shard int) string { return fmt.Sprintf("%s-%02d", ConfigMapName, shard) }

// shardIndex returns the index of the shard named name.
func shardIndex(name string) (int, bool) {
	rest, ok := strings.CutPrefix(name, ConfigMapName+"-")
	if !ok || len(rest) != 2 {
		return 0, false
	}
	k, err := strconv.Atoi(rest)
	if err != nil || k < 0 || k >= ShardCount || ShardName(k) != name {
		return 0, false
	}
	return k, true
}

// merge returns the state of the record rec and of the shards given
// (shards[k] nil: not read): rec's entries and unknown top-level fields,
// the issued certificates and denials a legacy record still holds that no
// shard given holds too (a move cut short), then those of each shard, in
// shard order. The issued certificates of one node are in the order they
// were recorded: a legacy record's are older than every shard's (the
// record is moved to this version before any shard is written).
func merge(rec *State, shards []*State) *State {
	s := rec.clone()
	s.Version, s.Shards = stateVersion, ShardCount
	s.Issued, s.Denied = nil, nil
	for _, c := range rec.Issued {
		if p := shards[ShardOf(c.Node)]; p == nil || !slices.ContainsFunc(p.Issued, func(o Credential) bool { return o.SHA256 == c.SHA256 }) {
			s.Issued = append(s.Issued, c)
		}
	}
	for _, d := range rec.Denied {
		if p := shards[ShardOf(d.Node)]; p == nil || p.FindDenial(d.Node) == nil {
			s.Denied = append(s.Denied, d)
		}
	}
	for _, p := range shards {
		if p != nil {
			s.Issued = append(s.Issued, p.Issued...)
			s.Denied = append(s.Denied, p.Denied...)
		}
	}
	s.Issued, s.Denied = cloneCredentials(s.Issued), slices.Clone(s.Denied)
	return s
}

// decodeState parses raw: case-sensitive field names, no duplicate
// fields, no field named like one of the state's but in another case,
// nothing after the value; unknown fields are ignored, those at the top
// level kept in State.unknown.
func decodeState(raw []byte) (*State, error) {
	var s State
	strict, err := sigsjson.UnmarshalStrict(raw, &s, sigsjson.DisallowDuplicateFields)
	if err == nil {
		err = errors.Join(strict...)
	}
	if err != nil {
		return nil, err
	}
	var doc any
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&doc); err != nil {
		return nil, err
	}
	if err := caseFolded(doc); err != nil {
		return nil, err
	}
	top, ok := doc.(map[string]any)
	if !ok {
		return nil, errors.New("not a JSON object")
	}
	for k := range top {
		if stateFields[k] {
			continue
		}
		v, err := json.Marshal(top[k])
		if err != nil {
			return nil, err
		}
		if s.unknown == nil {
			s.unknown = map[string]json.RawMessage{}
		}
		s.unknown[k] = v
	}
	return &s, nil
}

// stateFields are State's JSON field names; fieldNames those of every
// struct State.json holds.
var stateFields, fieldNames = func() (map[string]bool, map[string]bool) {
	top, all := map[string]bool{}, map[string]bool{}
	var walk func(t reflect.Type, into map[string]bool)
	walk = func(t reflect.Type, into map[string]bool) {
		for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice {
			t = t.Elem()
		}
		if t.Kind() != reflect.Struct || t == reflect.TypeFor[time.Time]() {
			return
		}
		for f := range t.Fields() {
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			if !f.IsExported() || name == "" || name == "-" {
				continue
			}
			into[name], all[name] = true, true
			walk(f.Type, map[string]bool{})
		}
	}
	walk(reflect.TypeFor[State](), top)
	return top, all
}()

// caseFolded returns an error for an object key in doc that names one of
// the state's fields in another case: a hand edit the strict decoder of
// older versions refused, and one this version must not silently ignore.
func caseFolded(doc any) error {
	switch v := doc.(type) {
	case map[string]any:
		for k, e := range v {
			if !fieldNames[k] {
				for name := range fieldNames {
					if strings.EqualFold(k, name) {
						return fmt.Errorf("field %q is %q in another case", k, name)
					}
				}
			}
			if err := caseFolded(e); err != nil {
				return err
			}
		}
	case []any:
		for _, e := range v {
			if err := caseFolded(e); err != nil {
				return err
			}
		}
	}
	return nil
}

// data returns the ConfigMap data of s.
func data(s *State) (map[string]string, error) {
	raw, err := json.Marshal(s)
	if err != nil {
		return nil, err
	}
	if len(s.unknown) > 0 {
		var all map[string]json.RawMessage
		if err := json.Unmarshal(raw, &all); err != nil {
			return nil, err
		}
		for k, v := range s.unknown {
			if _, ok := all[k]; !ok {
				all[k] = v
			}
		}
		if raw, err = json.Marshal(all); err != nil {
			return nil, err
		}
	}
	return map[string]string{StateKey: string(raw)}, nil
}

// prune drops entries and accepted certificates that have expired at now.
func (s *State) prune(now time.Time) (dropped []string) {
	s.Entries = slices.DeleteFunc(s.Entries, func(e Entry) bool {
		if !now.Before(e.Until) {
			dropped = append(dropped, e.Node)
			return true
		}
		return false
	})
	for i := range s.Entries {
		s.Entries[i].Accepted = slices.DeleteFunc(s.Entries[i].Accepted, func(c Credential) bool { return !now.Before(c.NotAfter) })
	}
	s.pruneIssued(now)
	return dropped
}

// pruneIssued drops the issued certificates that have expired at now.
func (s *State) pruneIssued(now time.Time) {
	s.Issued = slices.DeleteFunc(s.Issued, func(c Credential) bool { return !now.Before(c.NotAfter) })
}

// pruneDenied drops the denials recorded keep or longer before now (every
// certificate issued before them has expired) and those of nodes Issued
// holds no certificate of any more. It reports whether it dropped any.
func (s *State) pruneDenied(now time.Time, keep time.Duration) bool {
	n := len(s.Denied)
	s.Denied = slices.DeleteFunc(s.Denied, func(d Denial) bool {
		return !now.Before(d.At.Add(keep)) || !slices.ContainsFunc(s.Issued, func(c Credential) bool { return c.Node == d.Node })
	})
	return len(s.Denied) != n
}

// Client is what a Revoker uses of a workload cluster's API: the
// admission policy, its binding, the record and its shards.
type Client interface {
	CoreV1() corev1client.CoreV1Interface
	AdmissionregistrationV1() admissionregistrationv1client.AdmissionregistrationV1Interface
}

// Revoker keeps the revocations of one workload cluster. Its methods are
// safe for concurrent use; a Revoker must not be copied after first use.
type Revoker struct {
	// Client talks to the workload cluster.
	Client Client
	// Lifetime is the longest a client certificate issued for the cluster
	// lives (the signer's cap): how long a name stays listed.
	Lifetime time.Duration
	// Clock; nil means the real clock.
	Clock clock.PassiveClock

	// batch is the writing of the record, one batch of changes at a time
	// (update.go).
	batch batcher
}

func (r *Revoker) now() time.Time {
	if r.Clock == nil {
		return time.Now()
	}
	return r.Clock.Now()
}

// Ensure makes the policy, its binding and its record exist as the
// controller writes them (restoring what someone deleted or changed),
// drops expired entries, and the expired certificates and denials of every
// shard, and returns the state and the names it dropped.
func (r *Revoker) Ensure(ctx context.Context) (*State, []string, error) {
	var dropped []string
	s, err := r.update(ctx, scope{always: true, all: true}, func(s *State) bool {
		n := len(s.Issued)
		// Dropped by this round, or by an earlier one whose write stands.
		now := s.prune(r.now())
		dropped = append(dropped, now...)
		denied := s.pruneDenied(r.now(), r.Lifetime+Margin)
		return len(now) > 0 || len(s.Issued) != n || denied
	})
	if err != nil {
		return nil, nil, err
	}
	slices.Sort(dropped)
	return s, slices.Compact(dropped), nil
}

// Revoke lists names as revoked for the deleted Machine m, and with them
// every name a certificate was issued for to m (the shards' issued
// certificates). A name listed already (for an earlier Machine) is listed
// again from now. The certificates issued or accepted for a name stay
// accepted only where claims reports that their Machine, another than m,
// still claims the name (a live Machine with that Hostname, say): every
// other certificate of the name, m's above all, is refused. m's issued
// certificates are forgotten once the names are listed. It returns the
// state written and the names listed.
func (r *Revoker) Revoke(ctx context.Context, m Machine, names []string, claims func(node string, uid types.UID) bool) (*State, []string, error) {
	if !m.valid() {
		return nil, nil, fmt.Errorf("%q is not a Machine's namespace and name", m)
	}
	for _, n := range names {
		if errs := validation.IsDNS1123Subdomain(n); len(errs) > 0 {
			return nil, nil, fmt.Errorf("%q is not a node name: %s", n, strings.Join(errs, "; "))
		}
	}
	if claims == nil {
		claims = func(string, types.UID) bool { return false }
	}
	now := r.now()
	revokedAt, until := now.UTC().Truncate(time.Second), now.Add(r.Lifetime+Margin).UTC().Truncate(time.Second).Add(time.Second)
	var listed []string
	s, err := r.update(ctx, scope{all: true}, func(s *State) bool {
		all := slices.Clone(names)
		for _, c := range s.Issued {
			if c.Machine.UID == m.UID {
				all = append(all, c.Node)
			}
		}
		for _, e := range s.Entries {
			// Listed by an earlier round of this call, whose issued
			// certificates of m are forgotten since.
			if e.Machine.UID == m.UID && e.RevokedAt.Equal(revokedAt) {
				all = append(all, e.Node)
			}
		}
		slices.Sort(all)
		listed = slices.Compact(all)
		// m's issued certificates tell which names it was issued for:
		// they are forgotten only once every such name is listed in the
		// record, so that a write cut short is done again in full.
		committed := true
		for _, n := range listed {
			e := Entry{Node: n, Machine: m, RevokedAt: revokedAt, Until: until}
			var kept []Credential
			if old := s.Find(n); old != nil {
				kept = old.Accepted
				committed = committed && old.Machine.UID == m.UID && old.RevokedAt.Equal(revokedAt)
			} else {
				committed = false
			}
			for _, c := range s.Issued {
				if c.Node == n {
					kept = append(kept, Credential{SHA256: c.SHA256, Machine: c.Machine, NotAfter: c.NotAfter})
				}
			}
			for _, c := range kept {
				if c.Machine.UID != m.UID && claims(n, c.Machine.UID) && !slices.ContainsFunc(e.Accepted, func(a Credential) bool { return a.SHA256 == c.SHA256 }) {
					e.Accepted = append(e.Accepted, c)
				}
			}
			if old := s.Find(n); old != nil {
				*old = e
			} else {
				s.Entries = append(s.Entries, e)
			}
		}
		if committed {
			s.Issued = slices.DeleteFunc(s.Issued, func(c Credential) bool { return c.Machine.UID == m.UID })
			s.pruneDenied(now, r.Lifetime+Margin)
		}
		slices.SortFunc(s.Entries, func(a, b Entry) int { return strings.Compare(a.Node, b.Node) })
		return len(listed) > 0
	})
	if err != nil {
		return nil, nil, err
	}
	return s, listed, nil
}

// Accept is called before a client certificate for node, issued for
// Machine m, is handed out: the certificate is recorded as issued, in
// node's shard (so that m's deletion refuses it and another Machine's
// deletion does not), and when node is revoked it is accepted (it was
// issued after the revocation, to a live Machine) and Accept returns the
// entry; otherwise it returns nil. An error means the certificate must not
// be handed out yet. att is what was verified before the certificate was
// issued; Accept records it with the time.
func (r *Revoker) Accept(ctx context.Context, node string, m Machine, cert *x509.Certificate, att Attestation) (*Entry, error) {
	if !m.valid() {
		return nil, fmt.Errorf("%q is not a Machine's namespace and name", m)
	}
	att.At = r.now().UTC().Truncate(time.Second)
	if !att.valid() {
		return nil, fmt.Errorf("attestation of provider %q with policy digest %q is not recordable", att.Provider, att.PolicySHA256)
	}
	if len(validation.IsDNS1123Subdomain(node)) > 0 {
		// No node can register under it, and it is never revoked.
		return nil, nil
	}
	var out *Entry
	var refused error
	now := r.now()
	_, err := r.update(ctx, scope{nodes: []string{node}}, func(s *State) bool {
		out, refused = nil, nil
		fp := Fingerprint(cert)
		e := s.Find(node)
		if e != nil && e.Machine.UID == m.UID {
			// Decided before the Machine was gone, signed after. Recorded
			// by an earlier round, before the revocation was read: it is
			// never handed out, and forgotten.
			refused = fmt.Errorf("%w: node %s was revoked when its Machine %s was deleted", ErrRevokedMachine, node, m)
			n := len(s.Issued)
			s.Issued = slices.DeleteFunc(s.Issued, func(c Credential) bool { return c.SHA256 == fp })
			return len(s.Issued) != n
		}
		changed := false
		if !slices.ContainsFunc(s.Issued, func(c Credential) bool { return c.SHA256 == fp }) {
			// The shard is written: the certificates expired in it go.
			s.pruneIssued(now)
			s.pruneDenied(now, r.Lifetime+Margin)
			s.Issued = append(s.Issued, Credential{SHA256: fp, Node: node, Machine: m, NotAfter: cert.NotAfter.UTC(), Attested: &att})
			changed = true
			var mine []int
			for i, c := range s.Issued {
				if c.Machine.UID == m.UID {
					mine = append(mine, i)
				}
			}
			if len(mine) > maxAllowed {
				s.Issued = slices.Delete(s.Issued, mine[0], mine[0]+1)
			}
			// A certificate issued after the node's last denied renewal:
			// its attestation is current again.
			s.Denied = slices.DeleteFunc(s.Denied, func(d Denial) bool { return d.Node == node })
		}
		if e == nil {
			return changed
		}
		if !slices.ContainsFunc(e.Accepted, func(c Credential) bool { return c.SHA256 == fp }) {
			e.Accepted = append(e.Accepted, Credential{SHA256: fp, Machine: m, NotAfter: cert.NotAfter.UTC()})
			if len(e.Accepted) > maxAllowed {
				e.Accepted = e.Accepted[len(e.Accepted)-maxAllowed:]
			}
			changed = true
		}
		c := *e
		out = &c
		return changed
	})
	if err != nil {
		return nil, err
	}
	return out, refused
}

// Deny is called before a renewal of node's client certificate (request,
// filed with the node's own credential) is denied for reason: it records
// the denial as the node's latest (State.Denied), replacing an earlier
// one, so that the pod signer issues nothing for the certificates the node
// holds (engine.DecidePod) until one issued after it is recorded (Accept
// drops it) or the longest client certificate lifetime has passed. A node
// the record holds no certificate of gets no pod certificates anyway, and
// nothing is recorded for it. An error means the denial must not be
// written yet.
func (r *Revoker) Deny(ctx context.Context, node, request, reason string) error {
	if len(validation.IsDNS1123Subdomain(node)) > 0 {
		// No node can register under it, and it is never issued a
		// certificate.
		return nil
	}
	now := r.now()
	d := Denial{Node: node, Request: request, Reason: reason, At: now.UTC()}
	if !d.valid() {
		return fmt.Errorf("denial of request %q for reason %q is not recordable", request, reason)
	}
	_, err := r.update(ctx, scope{nodes: []string{node}}, func(s *State) bool {
		changed := s.pruneDenied(now, r.Lifetime+Margin)
		if !slices.ContainsFunc(s.Issued, func(c Credential) bool { return c.Node == node && now.Before(c.NotAfter) }) {
			return changed
		}
		if old := s.FindDenial(node); old != nil {
			if old.Request == d.Request && old.Reason == d.Reason {
				// Recorded by an earlier try whose denial was not
				// written; the first time stands.
				return changed
			}
			*old = d
			return true
		}
		s.Denied = append(s.Denied, d)
		return true
	})
	return err
}

// ensurePolicy creates, restores or updates the policy for s, then its
// binding.
func (r *Revoker) ensurePolicy(ctx context.Context, want *admissionregistrationv1.ValidatingAdmissionPolicy) error {
	api := r.Client.AdmissionregistrationV1()
	got, err := api.ValidatingAdmissionPolicies().Get(ctx, want.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		_, err = api.ValidatingAdmissionPolicies().Create(ctx, want, metav1.CreateOptions{FieldManager: FieldManager})
	case err == nil && !equality.Semantic.DeepEqual(got.Spec, want.Spec):
		got = got.DeepCopy()
		got.Spec = want.Spec
		_, err = api.ValidatingAdmissionPolicies().Update(ctx, got, metav1.UpdateOptions{FieldManager: FieldManager})
	}
	if err != nil {
		return fmt.Errorf("unable to write ValidatingAdmissionPolicy %s: %w", want.Name, err)
	}
	wantB := Binding()
	gotB, err := api.ValidatingAdmissionPolicyBindings().Get(ctx, wantB.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		_, err = api.ValidatingAdmissionPolicyBindings().Create(ctx, wantB, metav1.CreateOptions{FieldManager: FieldManager})
	case err == nil && !equality.Semantic.DeepEqual(gotB.Spec, wantB.Spec):
		gotB = gotB.DeepCopy()
		gotB.Spec = wantB.Spec
		_, err = api.ValidatingAdmissionPolicyBindings().Update(ctx, gotB, metav1.UpdateOptions{FieldManager: FieldManager})
	}
	if err != nil {
		return fmt.Errorf("unable to write ValidatingAdmissionPolicyBinding %s: %w", wantB.Name, err)
	}
	return nil
}

// The policy's expressions. matchCondition selects node identities only,
// so that nothing else in the cluster ever depends on this policy; the
// validation refuses a revoked name unless one of the requester's
// credential IDs is a certificate accepted for that very name.
const (
	matchNodeIdentity    = `request.userInfo.username.startsWith('system:node:')`
	nodeVariable         = `request.userInfo.username.substring(12)`
	validationExpression = `!(variables.node in variables.revoked) || ` +
		`(has(request.userInfo.extra) && '` + CredentialIDExtra + `' in request.userInfo.extra && ` +
		`request.userInfo.extra['` + CredentialIDExtra + `'].exists(c, c.startsWith('X509SHA256=') && ` +
		`c.substring(11) in variables.accepted && variables.accepted[c.substring(11)] == variables.node))`
	messageExpression = `string(variables.revoked[variables.node])`
)

// celMap returns a CEL map literal of string keys and values. It refuses
// any character but printable ASCII other than the quote and the
// backslash, so that nothing it is given can end a literal.
func celMap(m map[string]string) (string, error) {
	var b strings.Builder
	b.WriteString("{")
	for i, k := range slices.Sorted(maps.Keys(m)) {
		if i > 0 {
			b.WriteString(", ")
		}
		for _, s := range []string{k, m[k]} {
			if strings.IndexFunc(s, func(r rune) bool { return r < 0x20 || r > 0x7e || r == '"' || r == '\\' }) >= 0 {
				return "", fmt.Errorf("%q cannot be written into the revocation policy", s)
			}
		}
		fmt.Fprintf(&b, "%q: %q", k, m[k])
	}
	b.WriteString("}")
	return b.String(), nil
}

// Policy returns the ValidatingAdmissionPolicy the controller keeps for s:
// the variable revoked maps each revoked name to the message of its
// refusal, accepted maps the fingerprint of each certificate accepted for a
// revoked name to that name.
//
// failurePolicy is Fail: if the policy cannot be evaluated, a revoked
// node's writes must not go through. Its blast radius is bounded by the
// match condition (requesters named system:node:*), so an error never
// stops an administrator or a controller from repairing the cluster.
func Policy(s *State) (*admissionregistrationv1.ValidatingAdmissionPolicy, error) {
	revoked, accepted := map[string]string{}, map[string]string{}
	for i := range s.Entries {
		e := &s.Entries[i]
		revoked[e.Node] = e.Message()
		for _, c := range e.Accepted {
			accepted[c.SHA256] = e.Node
		}
	}
	revokedLit, err := celMap(revoked)
	if err != nil {
		return nil, err
	}
	acceptedLit, err := celMap(accepted)
	if err != nil {
		return nil, err
	}
	return &admissionregistrationv1.ValidatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: PolicyName, Labels: managedLabels},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionregistrationv1.Fail),
			MatchConstraints: &admissionregistrationv1.MatchResources{
				NamespaceSelector: &metav1.LabelSelector{},
				ObjectSelector:    &metav1.LabelSelector{},
				MatchPolicy:       ptr.To(admissionregistrationv1.Equivalent),
				ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
					RuleWithOperations: admissionregistrationv1.RuleWithOperations{
						Operations: []admissionregistrationv1.OperationType{
							admissionregistrationv1.Create, admissionregistrationv1.Update,
							admissionregistrationv1.Delete, admissionregistrationv1.Connect,
						},
						Rule: admissionregistrationv1.Rule{
							APIGroups:   []string{"*"},
							APIVersions: []string{"*"},
							Resources:   []string{"*/*"}, // every resource and subresource
							Scope:       ptr.To(admissionregistrationv1.AllScopes),
						},
					},
				}},
			},
			MatchConditions: []admissionregistrationv1.MatchCondition{{Name: "node-identity", Expression: matchNodeIdentity}},
			Variables: []admissionregistrationv1.Variable{
				{Name: "node", Expression: nodeVariable},
				{Name: "revoked", Expression: revokedLit},
				{Name: "accepted", Expression: acceptedLit},
			},
			Validations: []admissionregistrationv1.Validation{{
				Expression:        validationExpression,
				MessageExpression: messageExpression,
				Reason:            ptr.To(metav1.StatusReasonForbidden),
			}},
		},
	}, nil
}

// Binding returns the policy's binding: cluster-wide, no parameter.
func Binding() *admissionregistrationv1.ValidatingAdmissionPolicyBinding {
	return &admissionregistrationv1.ValidatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: PolicyName, Labels: managedLabels},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{
			PolicyName:        PolicyName,
			ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny},
		},
	}
}
