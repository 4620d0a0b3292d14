package trust

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

func TestPolicyValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    Policy
		bad  []string
	}{
		{"defaults", Policy{}, nil},
		{"short lifetimes for tests", Policy{Lifetime: 10 * time.Hour, RotateBefore: 4 * time.Hour}, nil},
		{"rotate before as long as the lifetime", Policy{Lifetime: 48 * time.Hour, RotateBefore: 48 * time.Hour}, []string{"shorter than its lifetime"}},
		{"default rotate before longer than the lifetime", Policy{Lifetime: 30 * 24 * time.Hour}, []string{"shorter than its lifetime"}},
		{"lifetime too short, negative rotate before", Policy{Lifetime: time.Minute, RotateBefore: -time.Second}, []string{"at least 1h", "must be positive"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.p.Validate()
			if len(tc.bad) == 0 {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil {
				t.Fatal("accepted")
			}
			for _, b := range tc.bad {
				if !strings.Contains(err.Error(), b) {
					t.Errorf("error %q does not say %q", err, b)
				}
			}
		})
	}
}

type countRotations struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *countRotations) Rotated(cluster string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[cluster]++
}

func (c *countRotations) get(cluster string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[cluster]
}

// TestStoreRotation walks a serving CA through its life with a fake clock
// against a real API server: made once, rotated RotateBefore its expiry
// (once, even with two controllers racing), both trusted until the old one
// expires, then the old one dropped; and a CA found already expired
// replaced at once.
func TestStoreRotation(t *testing.T) {
	if testing.Short() {
		t.Skip("needs kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "trust-store")
	ctx := context.Background()
	c, err := client.New(cp.AdminConfig, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now().Truncate(time.Second)
	clk := clocktesting.NewFakePassiveClock(t0)
	metrics := &countRotations{}
	policy := Policy{Lifetime: 10 * time.Hour, RotateBefore: 4 * time.Hour}
	newStore := func() *Store { return &Store{Client: c, Reader: c, Clock: clk, Policy: policy, Metrics: metrics} }
	ref := SecretRef{NamespacedName: types.NamespacedName{Namespace: "default", Name: "wl-kubelet-serving-ca"}, Cluster: "default/wl",
		Labels: map[string]string{"cluster.x-k8s.io/cluster-name": "wl"}}
	ensure := func(s *Store) *Authority {
		t.Helper()
		a, err := s.Ensure(ctx, ref)
		if err != nil {
			t.Fatal(err)
		}
		for _, cert := range a.Trusted {
			if !clk.Now().Before(cert.NotAfter) {
				t.Errorf("expired CA %q (%s) still trusted at %s", cert.Subject, cert.NotAfter, clk.Now())
			}
		}
		if a.Trusted[0] != a.Signing.Cert {
			t.Error("the signing CA is not the first trusted one")
		}
		return a
	}

	first := ensure(newStore())
	if cn := first.Signing.Cert.Subject.CommonName; !strings.HasPrefix(cn, "kubelet-serving-ca default/wl ") {
		t.Errorf("serving CA named %q", cn)
	}
	podRef := ref
	podRef.Name, podRef.CommonName = "wl-pod-ca", "pod-identity-ca"
	if pod, err := newStore().Ensure(ctx, podRef); err != nil {
		t.Fatal(err)
	} else if cn := pod.Signing.Cert.Subject.CommonName; !strings.HasPrefix(cn, "pod-identity-ca default/wl ") {
		t.Errorf("pod CA named %q", cn)
	}
	if len(first.Trusted) != 1 || first.Signing.Cert.NotAfter.Sub(t0) != 10*time.Hour {
		t.Fatalf("first CA: %d trusted, expires %s", len(first.Trusted), first.Signing.Cert.NotAfter)
	}
	if k, ok := first.Signing.Cert.PublicKey.(*ecdsa.PublicKey); !ok || k.Curve != elliptic.P256() {
		t.Errorf("CA key %T, want ECDSA P-256", first.Signing.Cert.PublicKey)
	}
	if !first.NextChange.Equal(t0.Add(6 * time.Hour)) {
		t.Errorf("next change %s, want rotation at %s", first.NextChange, t0.Add(6*time.Hour))
	}
	var sec corev1.Secret
	if err := c.Get(ctx, ref.NamespacedName, &sec); err != nil {
		t.Fatal(err)
	}
	if sec.Type != corev1.SecretTypeTLS || sec.Labels["cluster.x-k8s.io/cluster-name"] != "wl" {
		t.Errorf("secret %s labels %v", sec.Type, sec.Labels)
	}

	clk.SetTime(t0.Add(6*time.Hour - time.Second))
	if a := ensure(newStore()); a.Fingerprint() != first.Fingerprint() {
		t.Fatal("rotated before it was due")
	}

	// Due: two controllers race; one rotation, both see the same result.
	clk.SetTime(t0.Add(6 * time.Hour))
	var wg sync.WaitGroup
	got := make([]*Authority, 2)
	for i := range got {
		wg.Go(func() { got[i] = ensure(newStore()) })
	}
	wg.Wait()
	rotated := got[0]
	if got[1].Fingerprint() != rotated.Fingerprint() {
		t.Fatal("racing controllers disagree on the rotated CAs")
	}
	if n := metrics.get("default/wl"); n != 1 {
		t.Errorf("%d rotations counted, want 1", n)
	}
	if len(rotated.Trusted) != 2 || !rotated.Trusted[1].Equal(first.Signing.Cert) || rotated.Signing.Cert.Equal(first.Signing.Cert) {
		t.Fatalf("after rotation: want the new CA signing and the old one trusted, got %d trusted", len(rotated.Trusted))
	}
	if rotated.Signing.Cert.Subject.CommonName == first.Signing.Cert.Subject.CommonName {
		t.Errorf("both CAs are named %q", rotated.Signing.Cert.Subject.CommonName)
	}
	if !rotated.NextChange.Equal(first.Signing.Cert.NotAfter) {
		t.Errorf("next change %s, want the old CA's expiry %s", rotated.NextChange, first.Signing.Cert.NotAfter)
	}

	// A restarted controller (a new Store, nothing in memory) carries on.
	clk.SetTime(t0.Add(10*time.Hour - time.Second))
	if a := ensure(newStore()); a.Fingerprint() != rotated.Fingerprint() {
		t.Fatal("the rotation changed before the old CA expired")
	}
	clk.SetTime(t0.Add(10 * time.Hour))
	pruned := ensure(newStore())
	if len(pruned.Trusted) != 1 || !pruned.Signing.Cert.Equal(rotated.Signing.Cert) {
		t.Fatalf("after the old CA expired: %d trusted", len(pruned.Trusted))
	}
	if err := c.Get(ctx, ref.NamespacedName, &sec); err != nil {
		t.Fatal(err)
	}
	if _, ok := sec.Data[SecretPreviousKey]; ok {
		t.Error("the expired CA is still stored")
	}

	// Controller off for longer than a CA lives: replaced at once, the
	// expired one not trusted.
	clk.SetTime(t0.Add(100 * time.Hour))
	fresh := ensure(newStore())
	if len(fresh.Trusted) != 1 || fresh.Signing.Cert.Equal(pruned.Signing.Cert) {
		t.Fatalf("expired signing CA: %d trusted", len(fresh.Trusted))
	}
}

// TestPublish publishes serving CAs as signer-linked ClusterTrustBundles in
// a real API server, as a user with only the RBAC docs/serving-ca.md
// gives: names with the required prefix, one bundle per signer name and CA,
// rotation pairs, removal, repair, other bundles left alone, and no
// publication without the attest verb.
func TestPublish(t *testing.T) {
	if testing.Short() {
		t.Skip("needs kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "trust-publish")
	ctx := context.Background()
	ctbs := cp.Client.CertificatesV1beta1().ClusterTrustBundles()

	const user = "serving-ca-publisher"
	certPEM, keyPEM := cp.IssueClientCert(t, user)
	cfg := cp.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM})
	signers := []string{"cluster.x-k8s.io/kubelet-serving-aws", "cluster.x-k8s.io/kubelet-serving-tpm"}
	pub := newTestPublisher(t, cfg, signers)

	clk := time.Now()
	ca1, ca2 := newCA(t, clk), newCA(t, clk)

	// Without the attest verb on the signer, kube-apiserver refuses.
	grant(t, cp, user, false)
	if err := pub.Publish(ctx, []*x509.Certificate{ca1}); !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "attest") {
		t.Fatalf("published without the attest verb: %v", err)
	}
	grant(t, cp, user, true)

	other, err := ctbs.Create(ctx, &certificatesv1beta1.ClusterTrustBundle{
		ObjectMeta: metav1.ObjectMeta{Name: "cluster.x-k8s.io:kubelet-serving-tpm:someone-elses"},
		Spec:       certificatesv1beta1.ClusterTrustBundleSpec{SignerName: "cluster.x-k8s.io/kubelet-serving-tpm", TrustBundle: string(encodeCerts([]*x509.Certificate{ca2}))},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	expect := func(cas ...*x509.Certificate) {
		t.Helper()
		list, err := ctbs.List(ctx, metav1.ListOptions{LabelSelector: LabelServingCA + "=true"})
		if err != nil {
			t.Fatal(err)
		}
		var want, got []string
		for _, s := range signers {
			for _, c := range cas {
				want = append(want, BundleName(s, c))
			}
		}
		for _, o := range list.Items {
			got = append(got, o.Name)
			certs, err := parseCerts([]byte(o.Spec.TrustBundle))
			if err != nil || len(certs) != 1 || BundleName(o.Spec.SignerName, certs[0]) != o.Name {
				t.Errorf("bundle %s (signer %s) holds %d certificates (%v), not its CA", o.Name, o.Spec.SignerName, len(certs), err)
			}
		}
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Fatalf("published %q, want %q", got, want)
		}
		if _, err := ctbs.Get(ctx, other.Name, metav1.GetOptions{}); err != nil {
			t.Fatalf("someone else's bundle: %v", err)
		}
	}
	publish := func(cas ...*x509.Certificate) {
		t.Helper()
		if err := pub.Publish(ctx, cas); err != nil {
			t.Fatal(err)
		}
	}

	publish(ca1)
	expect(ca1)
	if n := BundleName(signers[0], ca1); !strings.HasPrefix(n, "cluster.x-k8s.io:kubelet-serving-aws:") || len(n) > 253 {
		t.Errorf("name %q", n)
	}
	publish(ca2, ca1)
	expect(ca1, ca2)

	// Repaired: edited by hand, deleted by hand.
	name := BundleName(signers[1], ca1)
	o, err := ctbs.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	o.Spec.TrustBundle = string(encodeCerts([]*x509.Certificate{ca2}))
	if _, err := ctbs.Update(ctx, o, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := ctbs.Delete(ctx, BundleName(signers[0], ca2), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	publish(ca2, ca1)
	expect(ca1, ca2)

	publish(ca2)
	expect(ca2)

	// A publisher of another CA under its own label (the pod CA) leaves
	// the serving bundles alone, and they leave its bundles alone.
	podPub := newTestPublisher(t, cfg, []string{"cluster.x-k8s.io/pod-identity"})
	podPub.Label = "kubelet-authenticator.x-k8s.io/pod-ca"
	if err := podPub.Publish(ctx, []*x509.Certificate{ca1}); err != nil {
		t.Fatal(err)
	}
	expect(ca2)
	publish(ca2)
	if _, err := ctbs.Get(ctx, BundleName("cluster.x-k8s.io/pod-identity", ca1), metav1.GetOptions{}); err != nil {
		t.Fatalf("pod CA bundle after the serving publisher ran: %v", err)
	}
}

func newTestPublisher(t *testing.T, cfg *rest.Config, signers []string) *Publisher {
	t.Helper()
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &Publisher{Client: dyn, Discovery: dc, SignerNames: signers}
}

func newCA(t *testing.T, now time.Time) *x509.Certificate {
	t.Helper()
	s := &Store{Policy: Policy{Lifetime: 10 * time.Hour, RotateBefore: time.Hour}}
	ca, _, _, err := s.newCA(SecretRef{Cluster: "test/" + t.Name()}, now)
	if err != nil {
		t.Fatal(err)
	}
	return ca.Cert
}

// grant gives user the ClusterRole docs/serving-ca.md describes, with or
// without the attest verb on the serving signers.
func grant(t *testing.T, cp *harness.ControlPlane, user string, attest bool) {
	t.Helper()
	ctx := context.Background()
	rules := []rbacv1.PolicyRule{
		{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"clustertrustbundles"}, Verbs: []string{"get", "list", "watch", "create", "update", "delete"}},
	}
	if attest {
		rules = append(rules, rbacv1.PolicyRule{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"signers"},
			ResourceNames: []string{"cluster.x-k8s.io/*"}, Verbs: []string{"attest"}})
	}
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "kubelet-authenticator:serving-ca-publisher"}, Rules: rules}
	roles := cp.Client.RbacV1().ClusterRoles()
	if existing, err := roles.Get(ctx, role.Name, metav1.GetOptions{}); err == nil {
		existing.Rules = rules
		if _, err := roles.Update(ctx, existing, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	} else if _, err := roles.Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err := cp.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: role.Name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: "User", Name: user}},
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	// RBAC is read from an informer: wait until the change is in force.
	waitAllowed(t, cp, user, attest)
}

func waitAllowed(t *testing.T, cp *harness.ControlPlane, user string, attest bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		r, err := cp.Client.AuthorizationV1().SubjectAccessReviews().Create(context.Background(), &authorizationv1.SubjectAccessReview{
			Spec: authorizationv1.SubjectAccessReviewSpec{User: user, ResourceAttributes: &authorizationv1.ResourceAttributes{
				Group: "certificates.k8s.io", Resource: "signers", Name: "cluster.x-k8s.io/*", Verb: "attest", // the admission plugin asks for the signer name and for this
			}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if r.Status.Allowed == attest {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("attest allowed = %t after 10s", r.Status.Allowed)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestPublishOwners: two Clusters whose kubeconfigs reach one workload
// cluster each keep their own bundles (LabelOwner): neither removes the
// other's, a CA both publish stays with the first, and a bundle of no
// owner (an older release's) is taken over where wanted and removed where
// not.
func TestPublishOwners(t *testing.T) {
	if testing.Short() {
		t.Skip("needs kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "trust-owners")
	ctx := context.Background()
	ctbs := cp.Client.CertificatesV1beta1().ClusterTrustBundles()
	const user = "serving-ca-publisher"
	certPEM, keyPEM := cp.IssueClientCert(t, user)
	cfg := cp.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM})
	grant(t, cp, user, true)
	signers := []string{"cluster.x-k8s.io/kubelet-serving-tpm"}
	a, b := newTestPublisher(t, cfg, signers), newTestPublisher(t, cfg, signers)
	a.Owner, b.Owner = "uid-of-cluster-a", "uid-of-cluster-b"
	clk := time.Now()
	caA, caB, shared, legacyWanted, legacyGone := newCA(t, clk), newCA(t, clk), newCA(t, clk), newCA(t, clk), newCA(t, clk)

	// Bundles an older release published: labelled, no owner.
	for _, c := range []*x509.Certificate{legacyWanted, legacyGone} {
		if _, err := ctbs.Create(ctx, &certificatesv1beta1.ClusterTrustBundle{
			ObjectMeta: metav1.ObjectMeta{Name: BundleName(signers[0], c), Labels: map[string]string{LabelServingCA: "true"}},
			Spec:       certificatesv1beta1.ClusterTrustBundleSpec{SignerName: signers[0], TrustBundle: string(encodeCerts([]*x509.Certificate{c}))},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	owners := func() map[string]string {
		t.Helper()
		list, err := ctbs.List(ctx, metav1.ListOptions{LabelSelector: LabelServingCA + "=true"})
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, o := range list.Items {
			out[o.Name] = o.Labels[LabelOwner]
		}
		return out
	}
	publish := func(p *Publisher, cas ...*x509.Certificate) {
		t.Helper()
		if err := p.Publish(ctx, cas); err != nil {
			t.Fatal(err)
		}
	}
	name := func(c *x509.Certificate) string { return BundleName(signers[0], c) }

	publish(a, caA, shared, legacyWanted)
	publish(b, caB, shared)
	publish(a, caA, shared, legacyWanted)
	want := map[string]string{name(caA): a.Owner, name(shared): a.Owner, name(legacyWanted): a.Owner, name(caB): b.Owner}
	if got := owners(); !maps.Equal(got, want) {
		t.Fatalf("bundles and their owners %v, want %v", got, want)
	}

	// A bundle of another owner that someone edited is made right, and
	// stays its owner's.
	o, err := ctbs.Get(ctx, name(shared), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	o.Spec.TrustBundle = string(encodeCerts([]*x509.Certificate{caB}))
	if _, err := ctbs.Update(ctx, o, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	publish(b, caB, shared)
	if o, err = ctbs.Get(ctx, name(shared), metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	if certs, err := parseCerts([]byte(o.Spec.TrustBundle)); err != nil || len(certs) != 1 || !certs[0].Equal(shared) || o.Labels[LabelOwner] != a.Owner {
		t.Fatalf("shared bundle after b published: %d certificates (%v), owner %q; want the shared CA, owner a", len(certs), err, o.Labels[LabelOwner])
	}

	// b no longer publishes caB: its bundle goes, a's stay.
	publish(b, shared)
	delete(want, name(caB))
	if got := owners(); !maps.Equal(got, want) {
		t.Fatalf("bundles and their owners %v, want %v", got, want)
	}
}
