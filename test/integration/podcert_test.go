package integration

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert/podattest"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// podEnv is a signer serving pod certificates for its workload cluster.
type podEnv struct {
	*signerEnv
	ns string
}

func startPodSigner(t *testing.T) *podEnv {
	t.Helper()
	e := &podEnv{signerEnv: startSigner(t, harness.WithPodCertificates()), ns: "payments"}
	ctx := context.Background()
	obj := &unstructured.Unstructured{}
	obj.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
	obj.SetNamespace(signerNS)
	obj.SetName(signerCluster)
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		return e.mgmt.Client.Patch(ctx, obj, client.RawPatch(types.MergePatchType, []byte(
			`{"spec":{"authorizedAttestors":["insecure"],"podCertificates":{"trustDomain":"wl.example","allowed":[{"namespace":"payments","serviceAccounts":["api"]}]}}}`))) == nil, nil
	})
	wl := e.wl.Client
	if _, err := wl.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: e.ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, sa := range []string{"api", "batch"} {
		if _, err := wl.CoreV1().ServiceAccounts(e.ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// The pod CA is published for the pod signer once pod certificates
	// are on.
	harness.WaitFor(t, 90*time.Second, func() (bool, error) {
		return len(e.podBundle(t)) > 0, nil
	})
	// Requests are trusted once the admission policy that stamps their
	// creator is in force.
	b, err := wl.AdmissionregistrationV1().MutatingAdmissionPolicyBindings().Get(ctx, podcert.AdmissionPolicyName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Until(b.CreationTimestamp.Add(podcert.AdmissionSettle + time.Second)))
	return e
}

// podBundle returns the published pod CAs.
func (e *podEnv) podBundle(t *testing.T) []*x509.Certificate {
	t.Helper()
	list, err := e.wl.Client.CertificatesV1beta1().ClusterTrustBundles().List(context.Background(), metav1.ListOptions{LabelSelector: capi.LabelPodCA + "=true"})
	if err != nil {
		return nil
	}
	var out []*x509.Certificate
	for _, b := range list.Items {
		if b.Spec.SignerName != podcert.DefaultSignerName {
			t.Fatalf("pod CA bundle %s is for signer %q", b.Name, b.Spec.SignerName)
		}
		rest := []byte(b.Spec.TrustBundle)
		for {
			var blk *pem.Block
			if blk, rest = pem.Decode(rest); blk == nil {
				break
			}
			c, err := x509.ParseCertificate(blk.Bytes)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, c)
		}
	}
	return out
}

// node joins node (a Machine and an attested client certificate), and
// writes its Node object.
func (e *podEnv) node(t *testing.T, node string) (*kubelet, *corev1.Node) {
	t.Helper()
	e.mgmt.CreateMachine(t, signerNS, signerCluster, node, "test:///"+node, true)
	k := e.join(t, node+"-1", node, "test:///"+node)
	k.expectWorks(t)
	n, err := e.wl.Client.CoreV1().Nodes().Get(context.Background(), node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return k, n
}

// pod creates a pod of ServiceAccount sa bound to node.
func (e *podEnv) pod(t *testing.T, name, sa, node string) *corev1.Pod {
	t.Helper()
	p, err := e.wl.Client.CoreV1().Pods(e.ns).Create(context.Background(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{ServiceAccountName: sa, NodeName: node, AutomountServiceAccountToken: ptr.To(false),
			Containers: []corev1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// podKey is a pod's key pair.
type podKey struct {
	pub  ed25519.PublicKey
	priv ed25519.PrivateKey
}

// request creates, as kubelet k, the PodCertificateRequest of pod p on
// node n, as kubelet does; it returns the key and the API server's answer.
func (e *podEnv) request(t *testing.T, k *kubelet, p *corev1.Pod, n *corev1.Node, name string, mutate func(*certificatesv1beta1.PodCertificateRequest)) (*podKey, *certificatesv1beta1.PodCertificateRequest, error) {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	// The stub PKCS#10 request of kubelet 1.36 (pkixPublicKey and
	// proofOfPossession are deprecated): empty but for the key.
	stub, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, priv)
	if err != nil {
		t.Fatal(err)
	}
	sa, err := e.wl.Client.CoreV1().ServiceAccounts(e.ns).Get(context.Background(), p.Spec.ServiceAccountName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pcr := &certificatesv1beta1.PodCertificateRequest{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
		Spec: certificatesv1beta1.PodCertificateRequestSpec{
			SignerName: podcert.DefaultSignerName,
			PodName:    p.Name, PodUID: p.UID,
			ServiceAccountName: sa.Name, ServiceAccountUID: sa.UID,
			NodeName: types.NodeName(n.Name), NodeUID: n.UID,
			MaxExpirationSeconds: ptr.To(int32(86400)),
			StubPKCS10Request:    stub,
		},
	}
	if mutate != nil {
		mutate(pcr)
	}
	out, err := k.client.CertificatesV1beta1().PodCertificateRequests(e.ns).Create(context.Background(), pcr, metav1.CreateOptions{})
	return &podKey{pub: pub, priv: priv}, out, err
}

// decided waits for the request's Issued or Denied condition.
func (e *podEnv) decided(t *testing.T, name string) (*certificatesv1beta1.PodCertificateRequest, *metav1.Condition) {
	t.Helper()
	var pcr *certificatesv1beta1.PodCertificateRequest
	var cond *metav1.Condition
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		var err error
		pcr, err = e.wl.Client.CertificatesV1beta1().PodCertificateRequests(e.ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for i := range pcr.Status.Conditions {
			cond = &pcr.Status.Conditions[i]
			return true, nil
		}
		return false, nil
	})
	return pcr, cond
}

func (e *podEnv) expectDeniedPod(t *testing.T, name, reason string) {
	t.Helper()
	pcr, c := e.decided(t, name)
	if c.Type != certificatesv1beta1.PodCertificateRequestConditionTypeDenied || c.Reason != reason || pcr.Status.CertificateChain != "" {
		t.Fatalf("request %s: condition %s/%s %q, chain %d bytes; want Denied/%s and no certificate", name, c.Type, c.Reason, c.Message, len(pcr.Status.CertificateChain), reason)
	}
	t.Logf("request %s denied %s: %s", name, c.Reason, c.Message)
}

// expectIssuedPod waits for the certificate of request name and checks it.
func (e *podEnv) expectIssuedPod(t *testing.T, name string, k *kubelet, key *podKey, sa string) tls.Certificate {
	t.Helper()
	pcr, c := e.decided(t, name)
	if c.Type != certificatesv1beta1.PodCertificateRequestConditionTypeIssued {
		t.Fatalf("request %s: %s/%s %q; want Issued", name, c.Type, c.Reason, c.Message)
	}
	blk, _ := pem.Decode([]byte(pcr.Status.CertificateChain))
	cert, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("spiffe://wl.example/ns/%s/sa/%s", e.ns, sa)
	if len(cert.URIs) != 1 || cert.URIs[0].String() != want || len(cert.DNSNames)+len(cert.IPAddresses)+len(cert.EmailAddresses) != 0 {
		t.Errorf("names: URIs %v DNS %v IPs %v emails %v; want only %s", cert.URIs, cert.DNSNames, cert.IPAddresses, cert.EmailAddresses, want)
	}
	if cert.IsCA || len(cert.ExtKeyUsage) != 2 || cert.ExtKeyUsage[0] != x509.ExtKeyUsageClientAuth || cert.ExtKeyUsage[1] != x509.ExtKeyUsageServerAuth {
		t.Errorf("CA %t, usages %v; want a leaf for client and server auth", cert.IsCA, cert.ExtKeyUsage)
	}
	if !key.pub.Equal(cert.PublicKey) {
		t.Error("the certificate is not for the request's key")
	}
	if cert.NotAfter.After(k.cert.NotAfter) || cert.NotAfter.Sub(cert.NotBefore) > 24*time.Hour+10*time.Minute {
		t.Errorf("valid %s to %s; the node's certificate ends %s, maxExpirationSeconds is a day", cert.NotBefore, cert.NotAfter, k.cert.NotAfter)
	}
	life := cert.NotAfter.Sub(cert.NotBefore)
	if r := pcr.Status.BeginRefreshAt.Sub(cert.NotBefore); r < life/2-time.Minute || r > 2*life/3+time.Minute {
		t.Errorf("beginRefreshAt %s after notBefore, lifetime %s", r, life)
	}
	pool := x509.NewCertPool()
	for _, ca := range e.podBundle(t) {
		pool.AddCert(ca)
	}
	if _, err := cert.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("the certificate does not verify with the published pod CA bundle: %v", err)
	}
	// What was attested about the node, in a non-critical extension: its
	// attestor, provider ID, Machine and name, and when its client
	// certificate was issued after attestation.
	for _, x := range cert.Extensions {
		if x.Id.Equal(attestor.OIDPodAttestation) && x.Critical {
			t.Error("the attestation extension is critical")
		}
	}
	att, err := podattest.FromCertificate(cert)
	if err != nil {
		t.Fatalf("request %s: %v", name, err)
	}
	if att.Attestor != "insecure" || att.ProviderID != "test:///"+k.name || att.MachineNamespace != signerNS || att.MachineName != k.name ||
		att.NodeName != k.name || att.BootPolicySHA256 != nil {
		t.Errorf("attestation extension %+v; want attestor insecure, Machine %s/%s, node %s, no boot policy", att, signerNS, k.name, k.name)
	}
	if att.AttestedAt.Before(k.cert.NotBefore.Truncate(time.Second)) || att.AttestedAt.After(cert.NotBefore.Add(podcert.Backdate)) {
		t.Errorf("attested at %s; the node's certificate was issued at %s (backdated), the pod's at %s", att.AttestedAt, k.cert.NotBefore, cert.NotBefore)
	}
	t.Logf("request %s issued %s, %s to %s (node certificate ends %s)", name, cert.URIs[0], cert.NotBefore.Format(time.RFC3339), cert.NotAfter.Format(time.RFC3339), k.cert.NotAfter.Format(time.RFC3339))
	return tls.Certificate{Certificate: [][]byte{cert.Raw}, PrivateKey: key.priv, Leaf: cert}
}

// relyingParty is how a pod authenticates a peer: its certificate chains
// to roots (the projected pod CA bundle) for usage, names a SPIFFE ID of
// trustDomain and, when requireAttested, carries the attestation extension
// of a node the controller attested.
func relyingParty(roots *x509.CertPool, trustDomain string, usage x509.ExtKeyUsage, requireAttested bool) func([][]byte, [][]*x509.Certificate) error {
	return func(raw [][]byte, _ [][]*x509.Certificate) error {
		if len(raw) == 0 {
			return errors.New("no peer certificate")
		}
		leaf, err := x509.ParseCertificate(raw[0])
		if err != nil {
			return err
		}
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			return err
		}
		if len(leaf.URIs) != 1 || leaf.URIs[0].Scheme != "spiffe" || leaf.URIs[0].Host != trustDomain {
			return fmt.Errorf("peer is not a SPIFFE ID of %s: %v", trustDomain, leaf.URIs)
		}
		if requireAttested {
			if _, err := podattest.FromCertificate(leaf); err != nil {
				return fmt.Errorf("peer %s: %w", leaf.URIs[0], err)
			}
		}
		return nil
	}
}

// handshake runs a mutual TLS handshake between server and client, each
// verifying the other as relyingParty does with roots, and returns the
// errors both sides saw.
func handshake(t *testing.T, server, client tls.Certificate, roots *x509.CertPool, requireAttested bool) error {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	srvErr := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			srvErr <- err
			return
		}
		defer c.Close()
		s := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{server}, ClientAuth: tls.RequireAnyClientCert, MinVersion: tls.VersionTLS13,
			VerifyPeerCertificate: relyingParty(roots, "wl.example", x509.ExtKeyUsageClientAuth, requireAttested)})
		err = s.Handshake()
		if err == nil {
			_, err = s.Write([]byte("ok"))
		}
		srvErr <- err
	}()
	c, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS13,
		// Sent whatever CAs the server names.
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &client, nil },
		// SPIFFE peers are named by their URI SAN, not a host name.
		InsecureSkipVerify: true, VerifyPeerCertificate: relyingParty(roots, "wl.example", x509.ExtKeyUsageServerAuth, requireAttested)})
	if err == nil {
		_, err = io.ReadAll(c)
		c.Close()
	}
	return errors.Join(<-srvErr, err)
}

// TestPodCertificates: a pod on a node the controller attested gets a
// certificate naming only its ServiceAccount's SPIFFE ID and saying, in a
// non-critical extension, what was attested about its node; two such pods
// verify each other over mutual TLS using the published bundle, and a
// relying party that requires the extension refuses a certificate without
// it, as everyone refuses one of another CA;
// requests of a ServiceAccount the policy does not allow, of a node the
// controller never attested, with a superseded client certificate, or of a
// deleted Machine's node are not issued; names in annotations never reach
// the certificate; a node cannot ask for another node's pod.
func TestPodCertificates(t *testing.T) {
	e := startPodSigner(t)
	ctx := context.Background()
	a, nodeA := e.node(t, "worker-a")
	b, nodeB := e.node(t, "worker-b")

	// Issued, and what the creator writes in annotations does not count:
	// unverified annotations never become names, and the creator stamp is
	// the admission policy's.
	apiA := e.pod(t, "api-a", "api", "worker-a")
	keyA, created, err := e.request(t, a, apiA, nodeA, "api-a", func(p *certificatesv1beta1.PodCertificateRequest) {
		p.Spec.UnverifiedUserAnnotations = map[string]string{"example.com/dns-names": "evil.example", "example.com/spiffe": "spiffe://wl.example/ns/kube-system/sa/admin"}
		p.Annotations = map[string]string{podcert.AnnotationCreatorCredential: "X509SHA256=0000"}
	})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := created.Annotations[podcert.AnnotationCreatorCredential], podcert.CredentialIDPrefix+revoke.Fingerprint(a.cert); got != want {
		t.Fatalf("creator stamp %q, want %q (the admission policy's, not the creator's)", got, want)
	}
	certA := e.expectIssuedPod(t, "api-a", a, keyA, "api")
	apiB := e.pod(t, "api-b", "api", "worker-b")
	keyB, _, err := e.request(t, b, apiB, nodeB, "api-b", nil)
	if err != nil {
		t.Fatal(err)
	}
	certB := e.expectIssuedPod(t, "api-b", b, keyB, "api")
	// What the pod signer read: the nodes' certificates and attestations
	// are in the shards of their names, not in the record.
	if rec := e.recordAlone(t); len(rec.Issued) != 0 {
		t.Fatalf("the record holds issued certificates %+v; want them in its shards", rec.Issued)
	}

	// A record written by a release without shards (every certificate in
	// it, version v1): the pod signer honours it as it is.
	e.rewriteAsLegacy(t)
	keyL, _, err := e.request(t, b, apiB, nodeB, "api-b-legacy", nil)
	if err != nil {
		t.Fatal(err)
	}
	e.expectIssuedPod(t, "api-b-legacy", b, keyL, "api")

	// The two pods authenticate each other with the published bundle; a
	// certificate of a CA the controller does not publish is refused.
	roots := x509.NewCertPool()
	for _, ca := range e.podBundle(t) {
		roots.AddCert(ca)
	}
	if err := handshake(t, certA, certB, roots, true); err != nil {
		t.Fatalf("mutual TLS between two issued pod certificates, attestation required: %v", err)
	}
	rogue, err := harness.NewCA("rogue")
	if err != nil {
		t.Fatal(err)
	}
	roguePEM, err := rogue.Sign(harness.CertSpec{CommonName: "rogue"}, keyB.pub)
	if err != nil {
		t.Fatal(err)
	}
	rogueBlk, _ := pem.Decode(roguePEM)
	if err := handshake(t, certA, tls.Certificate{Certificate: [][]byte{rogueBlk.Bytes}, PrivateKey: keyB.priv}, roots, false); err == nil {
		t.Fatal("a client certificate of another CA was accepted")
	} else {
		t.Logf("client certificate of a CA not published: %v", err)
	}
	// A certificate of the pod CA itself that does not say its node was
	// attested (signed here with the pod CA's key, as by anything but this
	// signer's checks): a relying party that requires the extension
	// refuses it, on either side of the connection.
	unattested := e.unattestedPodCert(t, keyB)
	if err := handshake(t, certA, unattested, roots, false); err != nil {
		t.Fatalf("the pod CA's certificate without the extension, extension not required: %v", err)
	}
	for name, pair := range map[string][2]tls.Certificate{"client": {certA, unattested}, "server": {unattested, certA}} {
		if err := handshake(t, pair[0], pair[1], roots, true); err == nil || !strings.Contains(err.Error(), "no attestation extension") {
			t.Fatalf("%s without the attestation extension, extension required: %v", name, err)
		} else {
			t.Logf("%s without the attestation extension: %v", name, err)
		}
	}

	// A ServiceAccount the policy does not allow.
	batch := e.pod(t, "batch-a", "batch", "worker-a")
	if _, _, err := e.request(t, a, batch, nodeA, "batch-a", nil); err != nil {
		t.Fatal(err)
	}
	e.expectDeniedPod(t, "batch-a", podcert.ReasonNotAllowed)

	// Another node asking for worker-a's pod: the API server refuses.
	if _, _, err := e.request(t, b, apiA, nodeA, "api-a-by-b", nil); !apierrors.IsForbidden(err) {
		t.Fatalf("worker-b asking for worker-a's pod: %v; want forbidden", err)
	} else {
		t.Logf("worker-b asking for worker-a's pod: %v", err)
	}

	// A node whose client certificate the workload CA signed but the
	// controller never issued.
	certPEM, keyPEM := e.wl.IssueClientCert(t, "system:node:worker-c", "system:nodes")
	rogueNode := kubeletFromPEM(t, e.wl, "worker-c", certPEM, keyPEM)
	rogueNode.expectWorks(t)
	nodeC, err := e.wl.Client.CoreV1().Nodes().Get(ctx, "worker-c", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	apiC := e.pod(t, "api-c", "api", "worker-c")
	if _, _, err := e.request(t, rogueNode, apiC, nodeC, "api-c", nil); err != nil {
		t.Fatal(err)
	}
	e.expectDeniedPod(t, "api-c", podcert.ReasonNodeNotAttested)

	// Denials are Warning Events in the management cluster, on the Cluster
	// when they come before the Machine is looked up (the policy's, a node
	// never attested) and naming the node; every decision is counted.
	for _, want := range []struct{ kind, name, reason, request string }{
		{"Cluster", signerCluster, podcert.ReasonNotAllowed, "batch-a of node worker-a"},
		{"Cluster", signerCluster, podcert.ReasonNodeNotAttested, "api-c of node worker-c"},
	} {
		harness.WaitFor(t, 30*time.Second, func() (bool, error) {
			list, err := e.mgmt.ControlPlane.Client.CoreV1().Events(signerNS).List(ctx, metav1.ListOptions{
				FieldSelector: fields.Set{"involvedObject.kind": want.kind, "involvedObject.name": want.name, "reason": want.reason}.String(),
			})
			if err != nil {
				return false, err
			}
			for _, ev := range list.Items {
				if ev.Type == corev1.EventTypeWarning && strings.Contains(ev.Message, e.ns+"/"+want.request) {
					t.Logf("Event on %s %s: %s", want.kind, want.name, ev.Message)
					return true, nil
				}
			}
			return false, nil
		})
	}
	cluster := signerNS + "/" + signerCluster
	for _, c := range []struct {
		decision, reason string
		min              float64
	}{
		{capi.PodDecisionIssued, podcert.ReasonIssued, 2},
		{capi.PodDecisionDenied, podcert.ReasonNotAllowed, 1},
		{capi.PodDecisionDenied, podcert.ReasonNodeNotAttested, 1},
	} {
		if got := counter(t, "kubelet_authenticator_signer_pod_certificate_decisions_total", map[string]string{"cluster": cluster, "decision": c.decision, "reason": c.reason}); got < c.min {
			t.Errorf("pod certificate decisions %s/%s: %v, want at least %v", c.decision, c.reason, got, c.min)
		}
	}

	// worker-a renews: its previous certificate no longer gets pod
	// certificates.
	renewed := e.join(t, "worker-a-2", "worker-a", "test:///worker-a")
	// Its record was moved to the shards by that join's write.
	if rec := e.recordAlone(t); len(rec.Issued) != 0 {
		t.Fatalf("after a join, the legacy record still holds issued certificates %+v", rec.Issued)
	}
	if _, _, err := e.request(t, a, apiA, nodeA, "api-a-superseded", nil); err != nil {
		t.Fatal(err)
	}
	e.expectDeniedPod(t, "api-a-superseded", podcert.ReasonNodeSuperseded)
	keyR, _, err := e.request(t, renewed, apiA, nodeA, "api-a-renewed", nil)
	if err != nil {
		t.Fatal(err)
	}
	e.expectIssuedPod(t, "api-a-renewed", renewed, keyR, "api")

	// worker-a's next renewal is denied, and its denied request deleted
	// (kube-controller-manager does after an hour): the denial is in
	// revocation's record, and worker-a's current certificate gets no pod
	// certificates; a certificate issued after the denial does.
	e.deniedRenewal(t, renewed, "worker-a-denied")
	retried := counter(t, "kubelet_authenticator_signer_pod_certificate_decisions_total", map[string]string{"cluster": cluster, "decision": capi.PodDecisionRetried})
	if _, _, err := e.request(t, renewed, apiA, nodeA, "api-a-held", nil); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		return counter(t, "kubelet_authenticator_signer_pod_certificate_decisions_total",
			map[string]string{"cluster": cluster, "decision": capi.PodDecisionRetried}) >= retried+2, nil
	})
	if pcr, err := e.wl.Client.CertificatesV1beta1().PodCertificateRequests(e.ns).Get(ctx, "api-a-held", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	} else if len(pcr.Status.Conditions) > 0 {
		t.Fatalf("pod request of a node whose renewal was denied: %s %s: %s", pcr.Status.Conditions[0].Type, pcr.Status.Conditions[0].Reason,
			pcr.Status.Conditions[0].Message)
	}
	again := e.join(t, "worker-a-3", "worker-a", "test:///worker-a")
	keyAgain, _, err := e.request(t, again, apiA, nodeA, "api-a-after-denial", nil)
	if err != nil {
		t.Fatal(err)
	}
	e.expectIssuedPod(t, "api-a-after-denial", again, keyAgain, "api")

	// worker-b's Machine is deleted: its node is refused (revocation's
	// admission policy), and nothing is issued for it.
	if err := e.mgmt.Client.Delete(ctx, &clusterv1.Machine{ObjectMeta: metav1.ObjectMeta{Namespace: signerNS, Name: "worker-b"}}); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		_, _, err := e.request(t, b, apiB, nodeB, "api-b-deleted", nil)
		if err == nil {
			_, c := e.decided(t, "api-b-deleted")
			if c.Type == certificatesv1beta1.PodCertificateRequestConditionTypeIssued {
				return false, fmt.Errorf("issued for the deleted Machine's node: %s", c.Message)
			}
			t.Logf("deleted Machine's node: denied %s: %s", c.Reason, c.Message)
			return true, nil
		}
		t.Logf("deleted Machine's node: %v", err)
		return apierrors.IsForbidden(err) && strings.Contains(err.Error(), "was revoked"), nil
	})
}

// deniedRenewal files, with k's credential, a renewal the signer denies
// (it asks for another node's name), waits until the denial is in
// revocation's record, and deletes the request.
func (e *podEnv) deniedRenewal(t *testing.T, k *kubelet, name string) {
	t.Helper()
	ctx := context.Background()
	req, _ := signertest.Request{NodeName: "worker-b", ProviderID: "test:///" + k.name}.Build(t)
	csr := signertest.CSR(name, req)
	csr.Spec.Username, csr.Spec.Groups = "", nil // set by kube-apiserver
	if _, err := k.client.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got := e.waitDecided(t, name)
	d := condition(got, certificatesv1.CertificateDenied)
	if d == nil || got.Spec.Username != attestor.NodeUserPrefix+k.name {
		t.Fatalf("renewal %s by %s: %+v, want denied", name, got.Spec.Username, got.Status.Conditions)
	}
	t.Logf("renewal %s denied %s: %s", name, d.Reason, d.Message)
	s, err := revoke.Read(ctx, e.wl.Client.CoreV1(), k.name)
	if err != nil {
		t.Fatal(err)
	}
	if rec := s.FindDenial(k.name); rec == nil || rec.Request != name || rec.Reason != d.Reason {
		t.Fatalf("record's denial of %s: %+v, want request %s, reason %s (recorded before the denial was written)", k.name, rec, name, d.Reason)
	}
	if rec := e.recordAlone(t); len(rec.Denied) != 0 {
		t.Fatalf("the record holds denials %+v; want them in its shards", rec.Denied)
	}
	if err := e.wl.Client.CertificatesV1().CertificateSigningRequests().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// recordAlone returns what revocation's record holds without its shards.
func (e *podEnv) recordAlone(t *testing.T) *revoke.State {
	t.Helper()
	cm, err := e.wl.Client.CoreV1().ConfigMaps(revoke.Namespace).Get(context.Background(), revoke.ConfigMapName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	s, err := revoke.Decode(cm)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// rewriteAsLegacy rewrites revocation's record as a release without
// shards writes it (version v1, every certificate and denial in it) and
// deletes the shards.
func (e *podEnv) rewriteAsLegacy(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	cms := e.wl.Client.CoreV1().ConfigMaps(revoke.Namespace)
	s, err := revoke.Read(ctx, e.wl.Client.CoreV1())
	if err != nil {
		t.Fatal(err)
	}
	s.Version, s.Shards = "v1", 0
	raw, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	cm, err := cms.Get(ctx, revoke.ConfigMapName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cm.Data = map[string]string{revoke.StateKey: string(raw)}
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	for k := range revoke.ShardCount {
		if err := cms.Delete(ctx, revoke.ShardName(k), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
	}
}

// unattestedPodCert returns a certificate for key's pod signed with the
// Cluster's pod CA, as the signer issues them but without the attestation
// extension.
func (e *podEnv) unattestedPodCert(t *testing.T, key *podKey) tls.Certificate {
	t.Helper()
	var sec corev1.Secret
	if err := e.mgmt.Client.Get(context.Background(), client.ObjectKey{Namespace: signerNS, Name: signerCluster + capi.PodCASecretSuffix}, &sec); err != nil {
		t.Fatal(err)
	}
	ca, err := issue.LoadCA(sec.Data[corev1.TLSCertKey], sec.Data[corev1.TLSPrivateKeyKey])
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(now.UnixNano()), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true, URIs: []*url.URL{{Scheme: "spiffe", Host: "wl.example", Path: "/ns/" + e.ns + "/sa/api"}},
	}, ca.Cert, key.pub, ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key.priv}
}

// kubeletFromPEM is a node client of a certificate in PEM.
func kubeletFromPEM(t *testing.T, wl *harness.ControlPlane, node string, certPEM, keyPEM []byte) *kubelet {
	t.Helper()
	blk, _ := pem.Decode(certPEM)
	cert, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(&rest.Config{Host: wl.URL, TLSClientConfig: rest.TLSClientConfig{CAData: wl.CACertPEM, CertData: certPEM, KeyData: keyPEM}})
	if err != nil {
		t.Fatal(err)
	}
	return &kubelet{name: node, cert: cert, client: cs}
}
