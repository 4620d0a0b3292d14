package revoke

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"maps"
	"reflect"
	"strconv"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// A fleet's joins, decided in parallel, are recorded in batches: the
// callers that queue while one batch is written are written together, in
// one write, and the record is not read again before each write. Every
// certificate is recorded, and the policy, which none of them changes, is
// written once.
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
