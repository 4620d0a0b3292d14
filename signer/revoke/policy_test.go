package revoke

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clocktesting "k8s.io/utils/clock/testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// node is one client certificate of a node, and a client that uses it.
type node struct {
	name   string
	cert   *x509.Certificate
	client kubernetes.Interface
}

func newNode(t *testing.T, cp *harness.ControlPlane, name string) *node {
	t.Helper()
	certPEM, keyPEM := cp.IssueClientCert(t, attestor.NodeUserPrefix+name, attestor.NodesGroup)
	b, _ := pem.Decode(certPEM)
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cp.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}))
	if err != nil {
		t.Fatal(err)
	}
	return &node{name: name, cert: cert, client: cs}
}

// write labels the node's Node (creating it first), as a kubelet writes
// its Node.
func (n *node) write(ctx context.Context) error {
	nodes := n.client.CoreV1().Nodes()
	obj, err := nodes.Get(ctx, n.name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = nodes.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.name}}, metav1.CreateOptions{})
		return err
	}
	if err != nil {
		return err
	}
	obj.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, LastHeartbeatTime: metav1.Now()}}
	_, err = nodes.UpdateStatus(ctx, obj, metav1.UpdateOptions{})
	return err
}

// eventually waits until n's write is refused as revoked (refused) or
// succeeds (!refused).
func (n *node) eventually(t *testing.T, refused bool) {
	t.Helper()
	var last error
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		last = n.write(context.Background())
		isRefused := apierrors.IsForbidden(last) && strings.Contains(last.Error(), "node "+n.name+" was revoked")
		if isRefused == refused && (refused || last == nil) {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("%s (certificate %s): %v; want refused=%t", n.name, Fingerprint(n.cert)[:12], last, refused)
}

// tpmAttested is what the tests' certificates were issued after.
var tpmAttested = Attestation{Provider: "tpm", PolicySHA256: strings.Repeat("ab", 32)}

// TestRevoker: the policy against a real kube-apiserver, driven through a
// Revoker with a fake clock.
func TestRevoker(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "revoke")
	ctx := context.Background()
	clock := clocktesting.NewFakePassiveClock(time.Now())
	r := &Revoker{Client: cp.Client, Lifetime: 24 * time.Hour, Clock: clock}

	s, _, err := r.Ensure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Entries) != 0 {
		t.Fatalf("entries in a new cluster: %+v", s.Entries)
	}
	old, other := newNode(t, cp, "n1"), newNode(t, cp, "n2")
	old.eventually(t, false)
	other.eventually(t, false)

	deleted := Machine{Namespace: "team", Name: "n1", UID: "uid-1"}
	if _, _, err := r.Revoke(ctx, deleted, []string{"n1"}, nil); err != nil {
		t.Fatal(err)
	}
	old.eventually(t, true)
	other.eventually(t, false) // another node is not touched

	// A certificate issued to the deleted Machine itself is never accepted.
	if _, err := r.Accept(ctx, "n1", deleted, old.cert, tpmAttested); !errors.Is(err, ErrRevokedMachine) {
		t.Fatalf("Accept for the deleted Machine: %v, want ErrRevokedMachine", err)
	}
	// One issued to a new Machine is; the old one stays refused.
	fresh := newNode(t, cp, "n1")
	if e, err := r.Accept(ctx, "n1", Machine{Namespace: "team", Name: "n1", UID: "uid-2"}, fresh.cert, tpmAttested); err != nil || e == nil {
		t.Fatalf("Accept for the new Machine: %+v, %v", e, err)
	}
	fresh.eventually(t, false)
	old.eventually(t, true)
	// Accepting for a name that is not revoked changes nothing.
	if e, err := r.Accept(ctx, "n2", Machine{Namespace: "team", Name: "n2", UID: "uid-3"}, other.cert, tpmAttested); err != nil || e != nil {
		t.Fatalf("Accept for a name not revoked: %+v, %v", e, err)
	}
	// Every certificate is recorded with what was verified before it was
	// issued and when: pod certificates carry it.
	rec := recorded(ctx, t, cp.Client)
	if i := slices.IndexFunc(rec.Issued, func(c Credential) bool { return c.SHA256 == Fingerprint(other.cert) }); i < 0 {
		t.Fatalf("certificate of n2 not recorded: %+v", rec.Issued)
	} else if a := rec.Issued[i].Attested; a == nil || a.Provider != tpmAttested.Provider || a.PolicySHA256 != tpmAttested.PolicySHA256 ||
		!a.At.Equal(clock.Now().UTC().Truncate(time.Second)) {
		t.Fatalf("attestation recorded for n2: %+v, want %+v at %s", a, tpmAttested, clock.Now())
	}
	if _, err := r.Accept(ctx, "n2", Machine{Namespace: "team", Name: "n2", UID: "uid-3"}, other.cert, Attestation{Provider: "tpm", PolicySHA256: "ABC"}); err == nil {
		t.Fatal("Accept recorded a malformed policy digest")
	}

	// A deleted Machine's name that a live Machine claims too (a reused
	// Hostname): the deleted Machine's certificate is refused, the live
	// one's, issued before the deletion, still works.
	gone, live := Machine{Namespace: "team", Name: "a", UID: "uid-a"}, Machine{Namespace: "team", Name: "b", UID: "uid-b"}
	stolen, claimant := newNode(t, cp, "n3"), newNode(t, cp, "n3")
	for _, c := range []struct {
		m    Machine
		cert *x509.Certificate
	}{{gone, stolen.cert}, {live, claimant.cert}} {
		if e, err := r.Accept(ctx, "n3", c.m, c.cert, tpmAttested); err != nil || e != nil {
			t.Fatalf("Accept before any revocation of n3: %+v, %v", e, err)
		}
	}
	claims := func(node string, uid types.UID) bool { return node == "n3" && uid == live.UID }
	if _, listed, err := r.Revoke(ctx, gone, nil, claims); err != nil || len(listed) != 1 || listed[0] != "n3" {
		t.Fatalf("Revoke of the Machine issued for n3: listed %q, %v", listed, err)
	}
	stolen.eventually(t, true)
	claimant.eventually(t, false)

	// A record someone else edited is not overwritten: revocations stay as
	// they are, and the error says what to do.
	cms := cp.Client.CoreV1().ConfigMaps(Namespace)
	cm, err := cms.Get(ctx, ConfigMapName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	good := cm.Data[StateKey]
	cm.Data[StateKey] = strings.Replace(good, `{"version":"v2",`, `{"version":"v2","version":"v2",`, 1)
	if cm, err = cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Ensure(ctx); !errors.Is(err, ErrMalformed) {
		t.Fatalf("Ensure with an edited record: %v, want ErrMalformed", err)
	}
	old.eventually(t, true)
	cm.Data[StateKey] = good
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	// A deleted policy is restored from the record.
	if err := cp.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies().Delete(ctx, PolicyName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	old.eventually(t, false)
	if _, _, err := r.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	old.eventually(t, true)
	fresh.eventually(t, false)

	// Once every certificate issued before the revocation has expired, the
	// name is dropped.
	clock.SetTime(clock.Now().Add(24*time.Hour + Margin + time.Minute))
	s, dropped, err := r.Ensure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(dropped) != 2 || dropped[0] != "n1" || dropped[1] != "n3" || len(s.Entries) != 0 {
		t.Fatalf("after the lifetime: dropped %q, left %+v", dropped, s.Entries)
	}
	old.eventually(t, false)

	// Another replica writes between two of this Revoker's writes: what
	// this one decides next is decided on the record as the replica left
	// it, and the policy follows.
	replica := &Revoker{Client: cp.Client, Lifetime: 24 * time.Hour, Clock: clock}
	gone4 := Machine{Namespace: "team", Name: "n4", UID: "uid-4"}
	n4 := newNode(t, cp, "n4")
	if _, err := r.Accept(ctx, "n4", gone4, n4.cert, tpmAttested); err != nil {
		t.Fatal(err)
	}
	if _, listed, err := replica.Revoke(ctx, gone4, nil, nil); err != nil || len(listed) != 1 {
		t.Fatalf("Revoke by another replica: listed %q, %v", listed, err)
	}
	n4.eventually(t, true)
	// Decided before the replica revoked it, signed after: refused, though
	// this Revoker's last copy of the record knows nothing of it.
	if _, err := r.Accept(ctx, "n4", gone4, n4.cert, tpmAttested); !errors.Is(err, ErrRevokedMachine) {
		t.Fatalf("Accept for the Machine another replica revoked: %v, want ErrRevokedMachine", err)
	}
	fresh4 := newNode(t, cp, "n4")
	if e, err := r.Accept(ctx, "n4", Machine{Namespace: "team", Name: "n4", UID: "uid-5"}, fresh4.cert, tpmAttested); err != nil || e == nil {
		t.Fatalf("Accept for the new Machine after another replica's revocation: %+v, %v", e, err)
	}
	fresh4.eventually(t, false)
	n4.eventually(t, true)
}
