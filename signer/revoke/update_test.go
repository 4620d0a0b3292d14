package revoke

import (
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// A fleet's joins, decided in parallel, are recorded in batches: the
// callers that queue while one batch is written are written together,
// each shard they touch once, then the record read once. Every certificate
// is recorded, and the policy, which none of them changes, is written
// once.
func TestAcceptBatches(t *testing.T) {
	ctx := context.Background()
	c := fake.NewClientset()
	r := &Revoker{Client: c, Lifetime: 24 * time.Hour}
	var (
		mu      sync.Mutex
		actions = map[string]int{}
		version int
	)
	release := make(chan struct{})
	c.PrependReactor("*", "*", func(a k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		actions[a.GetVerb()+" "+a.GetResource().Resource]++
		first := a.GetVerb() == "create" && a.GetResource().Resource == "configmaps" && actions["create configmaps"] == 1
		if w, ok := a.(k8stesting.CreateAction); ok { // updates too
			// As the API server does (the fake's tracker does not).
			if o, ok := w.GetObject().(metav1.Object); ok {
				version++
				o.SetResourceVersion(strconv.Itoa(version))
			}
		}
		mu.Unlock()
		if first {
			<-release // the other joins queue meanwhile
		}
		return false, nil, nil
	})
	const n = 50
	cert := func(i int) *x509.Certificate {
		return &x509.Certificate{Raw: fmt.Appendf(nil, "cert-%d", i), NotAfter: time.Now().Add(time.Hour)}
	}
	errs := make(chan error, n)
	accept := func(i int) {
		node := fmt.Sprintf("node-%d", i)
		_, err := r.Accept(ctx, node, Machine{Namespace: "team", Name: node, UID: types.UID("uid-" + node[5:])}, cert(i), Attestation{Provider: "insecure"})
		errs <- err
	}
	go accept(0)
	// The first join writes the record; the others queue behind it.
	waitFor(t, func() bool { mu.Lock(); defer mu.Unlock(); return actions["create configmaps"] == 1 })
	for i := 1; i < n; i++ {
		go accept(i)
	}
	waitFor(t, func() bool { r.batch.mu.Lock(); defer r.batch.mu.Unlock(); return len(r.batch.queue) == n-1 })
	close(release)
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	got := maps.Clone(actions)
	mu.Unlock()
	s := recorded(ctx, t, c)
	if len(s.Issued) != n {
		t.Errorf("%d certificates recorded, want %d", len(s.Issued), n)
	}
	// The first join creates the record, then its shard, and reads the
	// record again; the others write each shard they touch once, reading
	// those not read yet, then the record again.
	first, rest := ShardOf("node-0"), map[int]bool{}
	for i := 1; i < n; i++ {
		rest[ShardOf(fmt.Sprintf("node-%d", i))] = true
	}
	unread := len(rest)
	if rest[first] {
		unread--
	}
	want := map[string]int{
		"get configmaps": 3 + unread + 1, "create configmaps": 1 + 1 + unread, "update configmaps": len(rest) - unread,
		"get validatingadmissionpolicies": 1, "create validatingadmissionpolicies": 1,
		"get validatingadmissionpolicybindings": 1, "create validatingadmissionpolicybindings": 1,
	}
	for k, v := range want {
		if v == 0 {
			delete(want, k)
		}
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("API requests of %d joins: %v, want %v", n, got, want)
	}
}

// A record and shard deleted behind the Revoker's back are written anew,
// with the certificate being handed out: it is never handed out
// unrecorded.
func TestAcceptRecordDeleted(t *testing.T) {
	ctx := context.Background()
	c := fake.NewClientset()
	r := &Revoker{Client: c, Lifetime: 24 * time.Hour}
	m := Machine{Namespace: "team", Name: "worker-a", UID: "u1"}
	cert := func(raw string) *x509.Certificate {
		return &x509.Certificate{Raw: []byte(raw), NotAfter: time.Now().Add(time.Hour)}
	}
	if _, err := r.Accept(ctx, "worker-a", m, cert("first"), Attestation{Provider: "tpm"}); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{ConfigMapName, ShardName(ShardOf("worker-a"))} {
		if err := c.CoreV1().ConfigMaps(Namespace).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := r.Accept(ctx, "worker-a", m, cert("second"), Attestation{Provider: "tpm"}); err != nil {
		t.Fatal(err)
	}
	s := recorded(ctx, t, c)
	if len(s.Issued) != 1 || s.Issued[0].SHA256 != Fingerprint(cert("second")) {
		t.Errorf("recorded after the record was deleted: %+v, want the second certificate", s.Issued)
	}
}

// A state's clone shares nothing with it: every change is made on a clone
// of the record as read, which stays as read.
func TestStateClone(t *testing.T) {
	s := sample()
	s.Issued[0].Attested = &Attestation{Provider: "tpm", At: t0}
	s.unknown = map[string]json.RawMessage{"later": json.RawMessage(`1`)}
	c := s.clone()
	if !reflect.DeepEqual(c, s) {
		t.Fatalf("clone %+v, want %+v", c, s)
	}
	scramble(reflect.ValueOf(c).Elem())
	want := sample()
	want.Issued[0].Attested = &Attestation{Provider: "tpm", At: t0}
	want.unknown = map[string]json.RawMessage{"later": json.RawMessage(`1`)}
	if !reflect.DeepEqual(s, want) {
		t.Errorf("changing the clone changed the state: %+v", s)
	}
}

// scramble changes every value v reaches through pointers, slices, maps
// and structs.
func scramble(v reflect.Value) {
	switch v.Kind() {
	case reflect.Pointer:
		if !v.IsNil() {
			scramble(v.Elem())
		}
	case reflect.Struct:
		if v.Type() == reflect.TypeFor[time.Time]() {
			v.Set(reflect.ValueOf(time.Unix(1, 0)))
			return
		}
		for i := range v.NumField() {
			f := v.Field(i)
			if f.CanSet() {
				scramble(f)
			} else {
				scramble(reflect.NewAt(f.Type(), f.Addr().UnsafePointer()).Elem())
			}
		}
	case reflect.Slice:
		if v.Type().Elem().Kind() == reflect.Uint8 {
			for i := range v.Len() {
				v.Index(i).SetUint(0)
			}
			return
		}
		for i := range v.Len() {
			scramble(v.Index(i))
		}
	case reflect.Map:
		for _, k := range v.MapKeys() {
			v.SetMapIndex(k, reflect.Zero(v.Type().Elem()))
		}
	case reflect.String:
		v.SetString("scrambled")
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(time.Millisecond)
	}
}

// hooked is a workload client whose ConfigMap requests call hook first,
// with the verb, the name and (create, update) the object written: a test
// holds a Revoker between two of its requests, fails one (a crash), or
// counts what is written.
type hooked struct {
	kubernetes.Interface
	hook func(verb, name string, cm *corev1.ConfigMap) error
}

func (h hooked) CoreV1() corev1client.CoreV1Interface {
	return hookedCore{CoreV1Interface: h.Interface.CoreV1(), hook: h.hook}
}

type hookedCore struct {
	corev1client.CoreV1Interface
	hook func(verb, name string, cm *corev1.ConfigMap) error
}

func (c hookedCore) ConfigMaps(ns string) corev1client.ConfigMapInterface {
	return hookedConfigMaps{ConfigMapInterface: c.CoreV1Interface.ConfigMaps(ns), hook: c.hook}
}

type hookedConfigMaps struct {
	corev1client.ConfigMapInterface
	hook func(verb, name string, cm *corev1.ConfigMap) error
}

func (c hookedConfigMaps) Get(ctx context.Context, name string, o metav1.GetOptions) (*corev1.ConfigMap, error) {
	if err := c.hook("get", name, nil); err != nil {
		return nil, err
	}
	return c.ConfigMapInterface.Get(ctx, name, o)
}

func (c hookedConfigMaps) Create(ctx context.Context, cm *corev1.ConfigMap, o metav1.CreateOptions) (*corev1.ConfigMap, error) {
	if err := c.hook("create", cm.Name, cm); err != nil {
		return nil, err
	}
	return c.ConfigMapInterface.Create(ctx, cm, o)
}

func (c hookedConfigMaps) Update(ctx context.Context, cm *corev1.ConfigMap, o metav1.UpdateOptions) (*corev1.ConfigMap, error) {
	if err := c.hook("update", cm.Name, cm); err != nil {
		return nil, err
	}
	return c.ConfigMapInterface.Update(ctx, cm, o)
}

// fleet returns a state recording perNode certificates for each of nodes
// nodes, each node its own Machine's, as renewals overlap.
func fleet(nodes, perNode int, now time.Time) *State {
	s := &State{Version: stateVersion, Shards: ShardCount}
	for i := range nodes {
		node := fmt.Sprintf("md-0-%05d", i)
		m := Machine{Namespace: "team", Name: node, UID: types.UID(fmt.Sprintf("00000000-0000-0000-0000-%012d", i))}
		for j := range perNode {
			sum := sha256.Sum256(fmt.Appendf(nil, "%s/%d", node, j))
			s.Issued = append(s.Issued, Credential{SHA256: hex.EncodeToString(sum[:]), Node: node, Machine: m, NotAfter: now.Add(24 * time.Hour).UTC().Truncate(time.Second),
				Attested: &Attestation{Provider: "tpm", PolicySHA256: strings.Repeat("ab", 32), At: now.Add(time.Duration(j-perNode) * time.Hour).UTC().Truncate(time.Second)}})
		}
	}
	return s
}

// seed writes s as a new record and its shards, through r's writer; it
// returns the size of the largest shard's data.
func seed(ctx context.Context, t *testing.T, r *Revoker, s *State) int {
	t.Helper()
	parts := make([]*State, ShardCount)
	for k := range parts {
		parts[k] = &State{Version: stateVersion, Shards: ShardCount}
	}
	rec, shards, err := split(s, parts)
	if err != nil {
		t.Fatal(err)
	}
	largest := 0
	for k, p := range shards {
		if len(p.Issued)+len(p.Denied) == 0 {
			continue
		}
		if _, err := r.writeObject(ctx, ShardName(k), &record{}, p, ""); err != nil {
			t.Fatal(err)
		}
		d, _ := data(p)
		largest = max(largest, len(d[StateKey]))
	}
	if _, err := r.writeObject(ctx, ConfigMapName, &record{}, rec, ""); err != nil {
		t.Fatal(err)
	}
	return largest
}

// legacyData returns State.json as a release without shards writes it:
// version v1, every certificate and denial in the record.
func legacyData(t *testing.T, s *State) string {
	t.Helper()
	l := s.clone()
	l.Version, l.Shards = legacyVersion, 0
	d, err := data(l)
	if err != nil {
		t.Fatal(err)
	}
	return d[StateKey]
}

// bytesWritten returns a Revoker on c that counts the bytes of ConfigMap
// data it writes.
func bytesWritten(c kubernetes.Interface) (*Revoker, *atomic.Int64) {
	var n atomic.Int64
	return &Revoker{Client: hooked{Interface: c, hook: func(_, _ string, cm *corev1.ConfigMap) error {
		if cm != nil {
			for k, v := range cm.Data {
				n.Add(int64(len(k) + len(v)))
			}
		}
		return nil
	}}, Lifetime: 24 * time.Hour}, &n
}

// What a join writes does not grow with the fleet beyond its shard: at
// 1,000 and 5,000 recorded certificates, the bytes an Accept writes
// against what a record holding them all (the layout without shards)
// would rewrite on each join.
func TestAcceptBytesWritten(t *testing.T) {
	ctx := context.Background()
	for _, n := range []int{1000, 5000, 20000} {
		c := fake.NewClientset()
		r, written := bytesWritten(c)
		s := fleet(n/4, 4, time.Now())
		seed(ctx, t, r, s)
		before := len(legacyData(t, s))
		written.Store(0)
		const joins = 20
		for i := range joins {
			node := fmt.Sprintf("new-%d", i)
			cert := &x509.Certificate{Raw: []byte(node), NotAfter: time.Now().Add(time.Hour)}
			if _, err := r.Accept(ctx, node, Machine{Namespace: "team", Name: node, UID: types.UID("uid-" + node)}, cert, Attestation{Provider: "tpm"}); err != nil {
				t.Fatal(err)
			}
		}
		after := int(written.Load()) / joins
		t.Logf("%d certificates recorded: %d bytes written per Accept (one shard), %d without shards (the whole record)", n, after, before)
		// A shard holds 1/64 of the fleet's certificates; 4x leaves room
		// for an uneven hash.
		if limit := 4 * before / ShardCount; after > limit {
			t.Errorf("%d certificates: %d bytes written per Accept, want at most %d", n, after, limit)
		}
	}
}

// TestShardedRecord: a record of 20,000 live certificates (5,000 nodes,
// renewals overlapping) in a real API server, each object well under its
// limit; a Machine deletion then revokes exactly its names, keeps the
// certificates of a live Machine claiming one of them accepted, forgets
// the deleted Machine's, and touches no other certificate.
func TestShardedRecord(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "revoke-shards")
	ctx := context.Background()
	clock := clocktesting.NewFakePassiveClock(time.Now())
	r := &Revoker{Client: cp.Client, Lifetime: 24 * time.Hour, Clock: clock}
	s := fleet(5000, 4, clock.Now())
	// The node of Machine md-0-00042 is deleted; a live Machine claims its
	// name too (a reused Hostname) and holds two of its certificates; the
	// deleted Machine was also issued one for another name.
	gone := s.Issued[42*4].Machine
	live := Machine{Namespace: "team", Name: "other", UID: "uid-live"}
	stolen, claimant := newNode(t, cp, gone.Name), newNode(t, cp, gone.Name)
	s.Issued[42*4+2].Machine, s.Issued[42*4+3].Machine = live, live
	s.Issued[42*4+3].SHA256 = Fingerprint(claimant.cert)
	s.Issued[42*4+1].SHA256 = Fingerprint(stolen.cert)
	s.Issued = append(s.Issued, Credential{SHA256: strings.Repeat("ef", 32), Node: "gone-hostname", Machine: gone, NotAfter: clock.Now().Add(time.Hour).UTC().Truncate(time.Second)})
	start := time.Now()
	largest := seed(ctx, t, r, s)
	t.Logf("%d certificates written in %s; largest shard %d bytes", len(s.Issued), time.Since(start).Round(time.Millisecond), largest)
	if largest > 256<<10 {
		t.Errorf("largest shard of %d certificates is %d bytes, want at most 256 KiB (a quarter of the limit)", len(s.Issued), largest)
	}
	if _, _, err := r.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	stolen.eventually(t, false)
	claimant.eventually(t, false)

	claims := func(node string, uid types.UID) bool { return node == gone.Name && uid == live.UID }
	start = time.Now()
	out, listed, err := r.Revoke(ctx, gone, []string{gone.Name}, claims)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("revoked in %s", time.Since(start).Round(time.Millisecond))
	if want := []string{"gone-hostname", gone.Name}; !reflect.DeepEqual(listed, want) {
		t.Errorf("listed %q, want %q", listed, want)
	}
	e := out.Find(gone.Name)
	if e == nil || len(e.Accepted) != 2 || e.Accepted[0].Machine != live || e.Accepted[1].SHA256 != Fingerprint(claimant.cert) {
		t.Errorf("entry of %s: %+v, want the live Machine's two certificates accepted", gone.Name, e)
	}
	stolen.eventually(t, true)
	claimant.eventually(t, false)
	got := recorded(ctx, t, cp.Client)
	if len(got.Entries) != 2 {
		t.Errorf("entries %+v, want the two names", got.Entries)
	}
	if want := len(s.Issued) - 3; len(got.Issued) != want {
		t.Errorf("%d certificates recorded after the revocation, want %d", len(got.Issued), want)
	}
	for _, c := range got.Issued {
		if c.Machine.UID == gone.UID {
			t.Errorf("certificate of the deleted Machine kept: %+v", c)
		}
	}
	// A join in the cluster writes only its node's shard.
	sizes, written := bytesWritten(cp.Client)
	if _, err := sizes.Accept(ctx, "md-0-00007", s.Issued[7*4].Machine, &x509.Certificate{Raw: []byte("renewal"), NotAfter: clock.Now().Add(time.Hour)},
		Attestation{Provider: "tpm"}); err != nil {
		t.Fatal(err)
	}
	t.Logf("an Accept among %d certificates wrote %d bytes", len(got.Issued), written.Load())
}

// gate holds a Revoker at one of its requests until released.
type gate struct {
	at      func(verb, name string) bool
	reached chan struct{}
	release chan struct{}
	once    sync.Once
}

func newGate(at func(verb, name string) bool) *gate {
	return &gate{at: at, reached: make(chan struct{}), release: make(chan struct{})}
}

func (g *gate) hook(verb, name string, _ *corev1.ConfigMap) error {
	if g.at(verb, name) {
		hold := false
		g.once.Do(func() { hold = true })
		if hold {
			close(g.reached)
			<-g.release
		}
	}
	return nil
}

// TestAcceptRevokeRace: an Accept and a Revoke of the same name, by two
// replicas, forced into each interleaving of their writes and reads
// across the record and the shard: the live Machine's certificate ends
// accepted, the deleted Machine's refused.
func TestAcceptRevokeRace(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "revoke-race")
	ctx := context.Background()
	for i, tc := range []struct {
		name string
		// acceptAt and revokeAt say where the acceptor and the revoker are
		// held; revokerFirst: the revoker runs while the acceptor is held
		// (else the other way round), sequential: neither is held, the
		// revoker runs first.
		acceptAt, revokeAt func(shard string) func(verb, name string) bool
		revokerFirst       bool
		sequential         bool
		// self: the Accept is of the deleted Machine itself.
		self bool
		// unseen: the Accept reads the record before the name is listed,
		// and returns no entry.
		unseen bool
		// unrecorded: the deleted Machine's certificate was issued before
		// the record of issued certificates (nothing of it in the shard).
		unrecorded bool
	}{{
		name: "accept-records-then-revoke-runs",
		acceptAt: func(string) func(string, string) bool {
			wrote := false
			return func(verb, name string) bool {
				if verb != "get" {
					wrote = wrote || strings.HasPrefix(name, ConfigMapName+"-")
				}
				return wrote && verb == "get" && name == ConfigMapName
			}
		},
		revokerFirst: true,
	}, {
		name: "revoke-lists-then-accept-runs",
		revokeAt: func(shard string) func(string, string) bool {
			wrote := false
			return func(verb, name string) bool {
				wrote = wrote || (verb != "get" && name == ConfigMapName)
				return wrote && verb == "get" && name == shard
			}
		},
	}, {
		// Only the revoker's second read of the shard finds the
		// certificate: recorded after its first, and the Accept read the
		// record before the entry was written.
		name: "revoke-reads-shards-then-accept-runs-then-revoke-lists",
		revokeAt: func(string) func(string, string) bool {
			return func(verb, name string) bool { return verb != "get" && name == ConfigMapName }
		},
		unseen:     true,
		unrecorded: true,
	}, {
		// Only the acceptor's read of the record after its write finds the
		// entry: its copy of the record is from before the revocation.
		name:       "revoke-done-then-accept-from-a-stale-copy",
		sequential: true,
		unrecorded: true,
	}, {
		name: "deleted-machine-accept-records-then-revoke-runs",
		acceptAt: func(string) func(string, string) bool {
			wrote := false
			return func(verb, name string) bool {
				if verb != "get" {
					wrote = wrote || strings.HasPrefix(name, ConfigMapName+"-")
				}
				return wrote && verb == "get" && name == ConfigMapName
			}
		},
		revokerFirst: true,
		self:         true,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			nodeName := fmt.Sprintf("race-%d", i)
			gone := Machine{Namespace: "team", Name: nodeName, UID: types.UID(fmt.Sprintf("uid-gone-%d", i))}
			live := Machine{Namespace: "team", Name: nodeName + "-b", UID: types.UID(fmt.Sprintf("uid-live-%d", i))}
			old, fresh := newNode(t, cp, nodeName), newNode(t, cp, nodeName)
			setup := &Revoker{Client: cp.Client, Lifetime: 24 * time.Hour}
			if !tc.unrecorded {
				if _, err := setup.Accept(ctx, nodeName, gone, old.cert, tpmAttested); err != nil {
					t.Fatal(err)
				}
			}
			shard := ShardName(ShardOf(nodeName))
			never := func(string, string) bool { return false }
			ag, rg := newGate(never), newGate(never)
			if tc.acceptAt != nil {
				ag = newGate(tc.acceptAt(shard))
			}
			if tc.revokeAt != nil {
				rg = newGate(tc.revokeAt(shard))
			}
			acceptor := &Revoker{Client: hooked{Interface: cp.Client, hook: ag.hook}, Lifetime: 24 * time.Hour}
			revoker := &Revoker{Client: hooked{Interface: cp.Client, hook: rg.hook}, Lifetime: 24 * time.Hour}
			// Both replicas have read the record before: their copies are
			// what the other changes.
			for _, r := range []*Revoker{acceptor, revoker} {
				if _, _, err := r.Ensure(ctx); err != nil {
					t.Fatal(err)
				}
			}
			claims := func(node string, uid types.UID) bool { return node == nodeName && uid == live.UID }
			accepting, acceptingCert := live, fresh.cert
			if tc.self {
				accepting, acceptingCert = gone, fresh.cert
			}
			type result struct {
				e   *Entry
				err error
			}
			accepted, revoked := make(chan result, 1), make(chan error, 1)
			accept := func() {
				e, err := acceptor.Accept(ctx, nodeName, accepting, acceptingCert, tpmAttested)
				accepted <- result{e, err}
			}
			revoke := func() {
				_, _, err := revoker.Revoke(ctx, gone, []string{nodeName}, claims)
				revoked <- err
			}
			switch {
			case tc.sequential:
				revoke()
				if err := <-revoked; err != nil {
					t.Fatal(err)
				}
				accept()
			case tc.revokerFirst:
				go accept()
				<-ag.reached // the certificate is recorded in its shard
				revoke()
				if err := <-revoked; err != nil {
					t.Fatal(err)
				}
				close(ag.release)
			default:
				go revoke()
				<-rg.reached // the name is listed in the record
				accept()
				close(rg.release)
				if err := <-revoked; err != nil {
					t.Fatal(err)
				}
			}
			res := <-accepted
			got := recorded(ctx, t, cp.Client)
			e := got.Find(nodeName)
			if e == nil {
				t.Fatalf("%s not revoked", nodeName)
			}
			isAccepted := slices.ContainsFunc(e.Accepted, func(c Credential) bool { return c.SHA256 == Fingerprint(fresh.cert) })
			old.eventually(t, true)
			if tc.self {
				if !errors.Is(res.err, ErrRevokedMachine) {
					t.Errorf("Accept for the deleted Machine: %v, want ErrRevokedMachine", res.err)
				}
				if isAccepted || slices.ContainsFunc(got.Issued, func(c Credential) bool { return c.Machine.UID == gone.UID }) {
					t.Errorf("the deleted Machine's certificate is accepted (%t) or still recorded: %+v", isAccepted, got.Issued)
				}
				fresh.eventually(t, true)
				return
			}
			if res.err != nil || (res.e == nil) != tc.unseen {
				t.Errorf("Accept for the live Machine: %+v, %v; want the entry: %t", res.e, res.err, !tc.unseen)
			}
			if !isAccepted || len(e.Accepted) != 1 {
				t.Errorf("accepted for %s: %+v, want only the live Machine's certificate", nodeName, e.Accepted)
			}
			fresh.eventually(t, false)
		})
	}
}

// TestRevokeCutShort: a Revoke cut short after it listed the names (the
// controller crashed before it read the shards again) leaves the deleted
// Machine's certificates recorded; done again by another replica, it
// lists every name they name, accepts the live claimant's certificate
// recorded in between, and forgets the deleted Machine's.
func TestRevokeCutShort(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "revoke-crash")
	ctx := context.Background()
	gone := Machine{Namespace: "team", Name: "crash", UID: "uid-gone"}
	live := Machine{Namespace: "team", Name: "crash-b", UID: "uid-live"}
	old, fresh := newNode(t, cp, "crash"), newNode(t, cp, "crash")
	r := &Revoker{Client: cp.Client, Lifetime: 24 * time.Hour}
	for _, c := range []struct {
		node string
		cert *x509.Certificate
	}{{"crash", old.cert}, {"crash-hostname", &x509.Certificate{Raw: []byte("hostname"), NotAfter: time.Now().Add(time.Hour)}}} {
		if _, err := r.Accept(ctx, c.node, gone, c.cert, tpmAttested); err != nil {
			t.Fatal(err)
		}
	}
	crashed := errors.New("crashed")
	listedOnce := false
	dying := &Revoker{Client: hooked{Interface: cp.Client, hook: func(verb, name string, _ *corev1.ConfigMap) error {
		if verb != "get" && name == ConfigMapName {
			listedOnce = true
			return nil
		}
		if listedOnce {
			return crashed
		}
		return nil
	}}, Lifetime: 24 * time.Hour}
	claims := func(node string, uid types.UID) bool { return node == "crash" && uid == live.UID }
	if _, _, err := dying.Revoke(ctx, gone, []string{"crash"}, claims); !errors.Is(err, crashed) {
		t.Fatalf("Revoke cut short: %v", err)
	}
	got := recorded(ctx, t, cp.Client)
	if got.Find("crash") == nil || got.Find("crash-hostname") == nil ||
		!slices.ContainsFunc(got.Issued, func(c Credential) bool { return c.Machine.UID == gone.UID }) {
		t.Fatalf("after the first round: entries %+v, issued %+v; want both names listed, the certificates kept", got.Entries, got.Issued)
	}
	// The live claimant joins meanwhile; the name is revoked, so it is
	// accepted at once.
	if e, err := r.Accept(ctx, "crash", live, fresh.cert, tpmAttested); err != nil || e == nil {
		t.Fatalf("Accept for the live claimant: %+v, %v", e, err)
	}
	next := &Revoker{Client: cp.Client, Lifetime: 24 * time.Hour}
	_, listed, err := next.Revoke(ctx, gone, []string{"crash"}, claims)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"crash", "crash-hostname"}; !reflect.DeepEqual(listed, want) {
		t.Errorf("done again: listed %q, want %q", listed, want)
	}
	got = recorded(ctx, t, cp.Client)
	if slices.ContainsFunc(got.Issued, func(c Credential) bool { return c.Machine.UID == gone.UID }) {
		t.Errorf("the deleted Machine's certificates are still recorded: %+v", got.Issued)
	}
	if e := got.Find("crash"); e == nil || len(e.Accepted) != 1 || e.Accepted[0].SHA256 != Fingerprint(fresh.cert) {
		t.Errorf("entry of crash: %+v, want the live claimant's certificate accepted", e)
	}
	old.eventually(t, true)
	fresh.eventually(t, false)
}

// TestLegacyRecord: a record written by a release without shards (version
// v1, every certificate and denial in it) is honoured as it is: Revoke
// finds its certificates, Decode of it alone gives their attestations;
// then its first write moves them to their shards, and the record, of
// version v2 now, is one an older replica refuses rather than overwrite.
func TestLegacyRecord(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "revoke-legacy")
	ctx := context.Background()
	now := time.Now()
	s := fleet(200, 2, now)
	gone, live := s.Issued[0].Machine, Machine{Namespace: "team", Name: "claimant", UID: "uid-claimant"}
	stolen, claimant := newNode(t, cp, s.Issued[0].Node), newNode(t, cp, s.Issued[0].Node)
	s.Issued[0].SHA256 = Fingerprint(stolen.cert)
	s.Issued[1].SHA256, s.Issued[1].Machine = Fingerprint(claimant.cert), live
	s.Denied = []Denial{{Node: s.Issued[10].Node, Request: "csr-denied", Reason: "SecureBootDisabled", At: now.UTC().Truncate(time.Second)}}
	cms := cp.Client.CoreV1().ConfigMaps(Namespace)
	if _, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: Namespace, Name: ConfigMapName, Labels: managedLabels},
		Data: map[string]string{StateKey: legacyData(t, s)}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cm, err := cms.Get(ctx, ConfigMapName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	alone, err := Decode(cm)
	if err != nil {
		t.Fatal(err)
	}
	if len(alone.Issued) != len(s.Issued) || alone.Issued[5].Attested == nil || alone.FindDenial(s.Issued[10].Node) == nil {
		t.Fatalf("legacy record read: %d certificates, attestation %+v", len(alone.Issued), alone.Issued[5].Attested)
	}

	r := &Revoker{Client: cp.Client, Lifetime: 24 * time.Hour}
	claims := func(node string, uid types.UID) bool { return uid == live.UID }
	if _, listed, err := r.Revoke(ctx, gone, nil, claims); err != nil || !reflect.DeepEqual(listed, []string{gone.Name}) {
		t.Fatalf("Revoke of a Machine the legacy record holds certificates of: listed %q, %v", listed, err)
	}
	stolen.eventually(t, true)
	claimant.eventually(t, false)

	cm, err = cms.Get(ctx, ConfigMapName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	raw := cm.Data[StateKey]
	if !strings.HasPrefix(raw, `{"version":"v2","shards":64,`) || strings.Contains(raw, `"issued"`) || strings.Contains(raw, `"denied"`) {
		t.Errorf("record after the first write: %.200s; want version v2 without certificates or denials", raw)
	}
	got := recorded(ctx, t, cp.Client)
	if len(got.Issued) != len(s.Issued)-1 || got.FindDenial(s.Issued[10].Node) == nil {
		t.Errorf("moved to the shards: %d certificates (want %d), denial %+v", len(got.Issued), len(s.Issued)-1, got.FindDenial(s.Issued[10].Node))
	}
	i := slices.IndexFunc(got.Issued, func(c Credential) bool { return c.SHA256 == s.Issued[5].SHA256 })
	if i < 0 || !reflect.DeepEqual(got.Issued[i], s.Issued[5]) {
		t.Errorf("certificate moved: %+v, want %+v", got.Issued[max(i, 0)], s.Issued[5])
	}
}

// BenchmarkAccept measures what recording one join's certificate costs the
// controller (the API server a fake one): 1,000 nodes' certificates
// recorded already, then one join at a time, each its shard's write and a
// read of the record.
func BenchmarkAccept(b *testing.B) {
	const fleet = 1000
	ctx := context.Background()
	// The simple tracker: the field-managed one builds a REST mapper per
	// write, a hundred times what the Revoker does.
	r := &Revoker{Client: fake.NewSimpleClientset(), Lifetime: 24 * time.Hour}
	cert := func(i int) *x509.Certificate {
		return &x509.Certificate{Raw: fmt.Appendf(nil, "cert-%d", i), NotAfter: time.Now().Add(time.Hour)}
	}
	accept := func(i int) {
		node := fmt.Sprintf("node-%d", i%fleet)
		if _, err := r.Accept(ctx, node, Machine{Namespace: "team", Name: node, UID: types.UID("uid-" + node)}, cert(i), Attestation{Provider: "insecure"}); err != nil {
			b.Fatal(err)
		}
	}
	for i := range fleet {
		accept(i)
	}
	i := fleet
	b.ReportAllocs()
	for b.Loop() {
		accept(i)
		i++
	}
}
