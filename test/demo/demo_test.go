// Package demo is `make demo`: it starts the whole product on 127.0.0.1 and
// narrates what happens. It runs as a test binary (so it reuses the test
// harness) but prints its narration on stdout; `make demo` runs the compiled
// binary directly so the narration is what a newcomer sees. Under `make test`
// it runs as an ordinary end-to-end test of the same flow.
//
// By default the node proves itself with the TPM attestor on the in-process
// TPM simulator, whose EK certificate is issued by a manufacturer CA made
// here: no hardware needed. KA_DEMO_ATTESTOR (`ATTESTOR=aws make demo`)
// picks another: aws, azure or gcp against their emulators on 127.0.0.1
// (test/emulators), or insecure. `make test` runs the default only.
package demo

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/smallstep/pkcs7"
	certificatesv1 "k8s.io/api/certificates/v1"
	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/aws"
	"sigs.k8s.io/kubelet-authenticator/attestor/azure"
	"sigs.k8s.io/kubelet-authenticator/attestor/gcp"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
	"sigs.k8s.io/kubelet-authenticator/signer/trust"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

func say(format string, args ...any) {
	fmt.Fprintf(os.Stdout, "==> "+format+"\n", args...)
}

func detail(format string, args ...any) {
	fmt.Fprintf(os.Stdout, "    "+format+"\n", args...)
}

func condition(c *certificatesv1.CertificateSigningRequest) *certificatesv1.CertificateSigningRequestCondition {
	for i := range c.Status.Conditions {
		if t := c.Status.Conditions[i].Type; t == certificatesv1.CertificateApproved || t == certificatesv1.CertificateDenied {
			return &c.Status.Conditions[i]
		}
	}
	return nil
}

// demoAttestor returns the attestor the demo shows: KA_DEMO_ATTESTOR
// (`ATTESTOR=aws make demo`), tpm by default.
func demoAttestor(t *testing.T) string {
	a := os.Getenv("KA_DEMO_ATTESTOR")
	switch a {
	case "":
		return tpm.Name
	case tpm.Name, insecure.Name, aws.Name, azure.Name, gcp.Name:
		return a
	}
	t.Fatalf("KA_DEMO_ATTESTOR=%q: the demo shows tpm (default), aws, azure, gcp or insecure", a)
	return ""
}

func TestDemo(t *testing.T) {
	start := time.Now()
	att := demoAttestor(t)
	const nodeName = "node-1"

	// What the node proves itself with: a simulated TPM, an emulated
	// cloud's metadata service, or nothing (insecure).
	var (
		caDir  string
		clouds *scenario.Clouds
		ctrl   []string
		holds  string
	)
	switch att {
	case tpm.Name:
		say("Making a TPM manufacturer CA (root + EK-issuing intermediate) for the simulated TPMs")
		caDir = t.TempDir()
		ca, err := tpmtest.NewManufacturerCA("Demo TPM Manufacturer", time.Now().Add(-time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		if err := ca.Save(caDir); err != nil {
			t.Fatal(err)
		}
		bundle := filepath.Join(caDir, tpmtest.BundleFile)
		detail("the controller trusts %s (--tpm-manufacturer-ca)", bundle)
		ctrl = []string{"--tpm-manufacturer-ca=" + bundle}
		holds = "its TPM (simulated, EK certificate from the demo manufacturer)"
	case insecure.Name:
		say("Attestor insecure: the node's word for its provider ID, no evidence (development only)")
		holds = "nothing else: the insecure attestor sends no evidence"
	default:
		clouds = scenario.StartClouds(t, nodeName)
		narrateCloud(att, clouds)
		ctrl = []string{"--attestor-config=" + clouds.AttestorConfig}
		holds = "its instance's metadata service (emulated)"
	}
	authorized := att + ",insecure"
	if att == insecure.Name {
		authorized = att
	}

	say("Building kubelet-authenticator and node-attestation-controller, starting two control planes on 127.0.0.1")
	detail("management cluster: etcd + kube-apiserver with the Cluster API CRDs (Cluster, Machine)")
	detail("workload cluster:   etcd + kube-apiserver, Node,RBAC authorization, NodeRestriction, bootstrap tokens")
	env := scenario.Start(t, scenario.Options{Attestors: authorized, ControllerArgs: ctrl})
	// The clock for the demo itself starts once the binaries are built: on
	// a fresh machine (an empty Go build cache) building them alone can
	// take minutes.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	detail("Cluster %s/%s opted in: kubelet-authenticator.x-k8s.io/enabled=true, authorized-attestors=%s", env.Namespace, env.Cluster, authorized)
	detail("its kubeconfig and CA Secrets (%s-kubeconfig, %s-ca) laid out as Cluster API does", env.Cluster, env.Cluster)
	detail("node-attestation-controller is running against the management cluster")

	bundle := trustBundle{signer: attestor.ServingSignerName(att), path: filepath.Join(t.TempDir(), "trust-bundles", "kubelet-serving", "ca.crt")}
	extra := []string{
		"agent:\n  metricsBindAddress: \"0\"\n",
		fmt.Sprintf("trustBundles:\n- signerName: %s\n  path: %s\n", bundle.signer, bundle.path),
	}
	var n *scenario.Node
	switch att {
	case tpm.Name:
		n = env.NewNode(t, nodeName, "demo:///fleet/"+nodeName, att,
			append([]string{fmt.Sprintf("tpm:\n  device: simulator\n  simulator:\n    seed: 1\n    manufacturerCADir: %s\n", caDir)}, extra...)...)
	case insecure.Name:
		n = env.NewNode(t, nodeName, "demo:///fleet/"+nodeName, att, extra...)
	default:
		n = env.CloudNode(t, clouds, nodeName, att, extra...)
	}
	env.Machine(t, n)
	say("Cluster API created Machine machine-%s: spec.providerID=%s, bootstrap ready", n.Name, n.ProviderID)
	detail("the node holds only a bootstrap token (%s.****) and %s", strings.SplitN(env.Token, ".", 2)[0], holds)

	say("Node %s runs `kubelet-authenticator credential`, as kubelet's exec plugin would", n.Name)
	r := n.Credential(ctx)
	if r.Err != nil {
		t.Fatalf("credential failed: %v\n%s\ncontroller log:\n%s", r.Err, r.Stderr, env.ControllerLog())
	}
	for _, line := range strings.Split(strings.TrimSpace(r.Stderr), "\n") {
		if line != "" {
			detail("%s", line)
		}
	}

	if att == tpm.Name {
		challengeRound(ctx, t, env, n)
	} else {
		evidence(ctx, t, env, n, att, clouds)
	}
	cms, err := env.Mgmt.ControlPlane.Client.CoreV1().ConfigMaps(scenario.ControllerNamespace).List(ctx, metav1.ListOptions{LabelSelector: tofu.LabelIdentity})
	if err != nil {
		t.Fatal(err)
	}
	for _, cm := range cms.Items {
		detail("trust on first use: ConfigMap %s/%s binds %s to Machine %s", cm.Namespace, cm.Name, cm.Data[tofu.KeyIdentity], cm.Data[tofu.KeyMachine])
	}

	cred, err := (cache.Dir{Path: n.CacheDir}).Load()
	if err != nil {
		t.Fatal(err)
	}
	pid, _ := attestor.ProviderIDFromExtensions(cred.Leaf.Extensions)
	say("Certificate stored in %s (0600)", n.CacheDir)
	detail("subject %s, issuer %s, provider ID %s, valid until %s", cred.Leaf.Subject, cred.Leaf.Issuer, pid, cred.Leaf.NotAfter.UTC().Format(time.RFC3339))

	say("kubectl with a kubeconfig whose user is the exec plugin: kubectl auth whoami")
	who := n.Kubectl(ctx, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
	if who.Err != nil {
		t.Fatalf("kubectl auth whoami: %v\n%s", who.Err, who.Stderr)
	}
	user := strings.TrimSpace(who.Stdout)
	if user != attestor.NodeUserPrefix+n.Name {
		t.Fatalf("API server sees %q", user)
	}
	fmt.Fprintf(os.Stdout, "authenticated as %s\n", user)
	// The API server names the certificate a request came with (its
	// SHA-256): the controller's "Issued" line for it says which request,
	// Machine and node it was issued for.
	id := n.Kubectl(ctx, "auth", "whoami", "-o", `jsonpath={.status.userInfo.extra.authentication\.kubernetes\.io/credential-id[0]}`)
	credentialID := strings.TrimSpace(id.Stdout)
	if want := podcert.CredentialIDPrefix + revoke.Fingerprint(cred.Leaf); id.Err != nil || credentialID != want {
		t.Fatalf("kubectl auth whoami: credential ID %q for the cached certificate %s, %v\n%s", credentialID, want, id.Err, id.Stderr)
	}
	issued := ""
	for line := range strings.SplitSeq(env.ControllerLog(), "\n") {
		if strings.Contains(line, `"Issued"`) && strings.Contains(line, `credentialID="`+credentialID+`"`) {
			issued = line
		}
	}
	if issued == "" {
		t.Fatalf("the controller logged no \"Issued\" line for %s:\n%s", credentialID, harness.LastLines(env.ControllerLog(), 20))
	}
	say("The API server's credential ID for that certificate, %s, in the controller's log", credentialID)
	detail("%s", issued)

	projectTrustBundle(ctx, t, env, n, bundle)

	say("The same bootstrap token, used to claim a control-plane node that has no Machine")
	thief := env.NewNode(t, "control-plane-1", "demo:///fleet/control-plane-1", "insecure")
	tr := thief.Credential(ctx)
	if tr.Err == nil {
		t.Fatalf("a node without a Machine got a certificate")
	}
	lines := strings.Split(strings.TrimSpace(tr.Stderr), "\n")
	detail("%s", lines[len(lines)-1])

	say("Done in %s. Everything started here stops now.", time.Since(start).Round(time.Second))
}

// nodeCSRs returns the node's CSRs and their parsed requests, oldest first.
func nodeCSRs(ctx context.Context, t *testing.T, env *scenario.Env, node string) ([]*certificatesv1.CertificateSigningRequest, []*attestor.AttestedRequest) {
	t.Helper()
	list, err := env.Workload.Client.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	slices.SortFunc(list.Items, func(a, b certificatesv1.CertificateSigningRequest) int {
		return a.CreationTimestamp.Compare(b.CreationTimestamp.Time)
	})
	var csrs []*certificatesv1.CertificateSigningRequest
	var reqs []*attestor.AttestedRequest
	for i := range list.Items {
		c := &list.Items[i]
		req, err := attestor.ParseRequest(c.Spec.Request)
		if err != nil || req.CSR.Subject.CommonName != attestor.NodeUserPrefix+node {
			continue
		}
		csrs, reqs = append(csrs, c), append(reqs, req)
	}
	return csrs, reqs
}

// challengeRound narrates the TPM attestor's two CSRs.
func challengeRound(ctx context.Context, t *testing.T, env *scenario.Env, n *scenario.Node) {
	t.Helper()
	say("The challenge round, as the controller recorded it on the CSRs")
	csrs, reqs := nodeCSRs(ctx, t, env, n.Name)
	var first, second *certificatesv1.CertificateSigningRequest
	for i, c := range csrs {
		if ev, err := tpm.DecodeEvidence(reqs[i].Evidence); err == nil && ev.Attestation != nil {
			first = c
		} else {
			second = c
		}
	}
	if first == nil || second == nil {
		t.Fatalf("the node did not file two CSRs: %d", len(csrs))
	}
	ch, err := tpm.DecodeChallenge([]byte(first.Annotations[attestor.AnnotationChallenge]))
	if err != nil {
		t.Fatalf("CSR #1 %s carries no challenge: %v", first.Name, err)
	}
	detail("CSR #1 %s: EK certificate, AK, TPM2_Certify of the CSR key (by %s)", first.Name, first.Spec.Username)
	detail("  challenged: MakeCredential to the EK for the AK, secret derived not stored, expires %s", ch.Expires.Format(time.RFC3339))
	detail("CSR #2 %s: the same key, proof of the activated credential", second.Name)
	c2 := condition(second)
	if c2 == nil || c2.Type != certificatesv1.CertificateApproved || len(second.Status.Certificate) == 0 {
		t.Fatalf("CSR #2 %s not approved and issued: %+v", second.Name, second.Status.Conditions)
	}
	detail("  approved (%s): %s", c2.Reason, c2.Message)
	c1 := condition(first)
	if c1 == nil || c1.Type != certificatesv1.CertificateDenied || c1.Reason != "ChallengeAnswered" {
		t.Fatalf("CSR #1 %s not closed ChallengeAnswered: %+v", first.Name, first.Status.Conditions)
	}
	detail("CSR #1 %s denied (%s): %s", first.Name, c1.Reason, c1.Message)
}

// narrateCloud says which emulated metadata service the node will ask and
// what the controller trusts.
func narrateCloud(att string, c *scenario.Clouds) {
	switch att {
	case aws.Name:
		i := c.AWS.Instance
		say("Starting an emulated EC2 instance's services on 127.0.0.1: IMDSv2 and STS")
		detail("IMDSv2 %s: session token required; serves the instance identity document and its rsa2048 PKCS#7", c.AWS.IMDSURL)
		detail("STS %s: checks SigV4 against the instance role's test credentials, answers GetCallerIdentity", c.AWS.STSURL)
		detail("instance %s in account %s, %s; its role: %s", i.InstanceID, i.AccountID, i.AvailabilityZone, i.Role)
		detail("the controller trusts the region's (self-made) rsa2048 certificate, account %s and that STS host (--attestor-config)", i.AccountID)
	case azure.Name:
		v := c.Azure.VM
		say("Starting an emulated Azure VM's instance metadata service on 127.0.0.1")
		detail("IMDS %s: Metadata: true required; signs attested documents (PKCS#7) as metadata.azure.com", c.Azure.URL)
		detail("VM %s in subscription %s", v.VMID, v.SubscriptionID)
		detail("the controller trusts the (self-made) root %q with its issuing CA, subscription %s (--attestor-config)", c.Azure.Root.Cert.Subject.CommonName, v.SubscriptionID)
	case gcp.Name:
		i := c.GCP.Instance
		say("Starting an emulated GCE instance's metadata server and Google's JWKS on 127.0.0.1")
		detail("metadata %s: Metadata-Flavor: Google required; issues RS256 instance identity tokens", c.GCP.MetadataURL)
		detail("JWKS %s: publishes the (self-made) signing key", c.GCP.JWKSURL)
		detail("instance %s (id %s) in project %s, zone %s", i.InstanceName, i.InstanceID, i.ProjectID, i.Zone)
		detail("the controller fetches its keys from that JWKS and allows project %s (--attestor-config)", i.ProjectID)
	}
}

// evidence narrates the one CSR of a single-round attestor: what its
// evidence carries and how the controller decided.
func evidence(ctx context.Context, t *testing.T, env *scenario.Env, n *scenario.Node, att string, c *scenario.Clouds) {
	t.Helper()
	csrs, reqs := nodeCSRs(ctx, t, env, n.Name)
	if len(csrs) != 1 {
		t.Fatalf("the node filed %d CSRs, want 1", len(csrs))
	}
	csr, req := csrs[0], reqs[0]
	binding := attestor.Binding(req.CSR.RawSubjectPublicKeyInfo)
	say("What CSR %s (by %s) carried, with its key's binding %s...", csr.Name, csr.Spec.Username, hex.EncodeToString(binding)[:16])
	switch att {
	case insecure.Name:
		var ev insecure.Evidence
		if err := json.Unmarshal(req.Evidence, &ev); err != nil {
			t.Fatal(err)
		}
		detail("only the provider ID it claims, %s: the controller checks it against the Machine, nothing proves it", ev.ProviderID)
	case aws.Name:
		var ev aws.Evidence
		if err := json.Unmarshal(req.Evidence, &ev); err != nil {
			t.Fatal(err)
		}
		var doc aws.InstanceIdentityDocument
		if err := json.Unmarshal(ev.Document, &doc); err != nil {
			t.Fatal(err)
		}
		u, err := url.Parse(ev.STS.URL)
		if err != nil {
			t.Fatal(err)
		}
		detail("the instance identity document (instance %s, account %s, %s) and its %d-byte rsa2048 PKCS#7 signature",
			doc.InstanceID, doc.AccountID, doc.AvailabilityZone, len(ev.RSA2048))
		detail("a presigned STS GetCallerIdentity for %s (X-Amz-Expires=%s s) signing header %s=%s...",
			u.Host, u.Query().Get("X-Amz-Expires"), aws.BindingHeader, ev.STS.Headers[aws.BindingHeader][:16])
		if c.AWS.STSCalls() == 0 {
			t.Fatal("the controller never replayed the presigned request to STS")
		}
		detail("the controller checked the signature and replayed the request to STS: the caller is the instance's role, in the document's account")
	case azure.Name:
		var ev azure.Evidence
		if err := json.Unmarshal(req.Evidence, &ev); err != nil {
			t.Fatal(err)
		}
		der, err := base64.StdEncoding.DecodeString(ev.Signature)
		if err != nil {
			t.Fatal(err)
		}
		p7, err := pkcs7.Parse(der)
		if err != nil {
			t.Fatal(err)
		}
		var data azure.AttestedData
		if err := json.Unmarshal(p7.Content, &data); err != nil {
			t.Fatal(err)
		}
		signer := ""
		if len(p7.Certificates) > 0 {
			signer = p7.Certificates[0].Subject.CommonName
		}
		detail("the IMDS attested document, PKCS#7 signed by %s: vmId %s, subscription %s", signer, data.VMID, data.SubscriptionID)
		detail("nonce %s (derived from the binding), valid %s to %s", data.Nonce, data.TimeStamp.CreatedOn, data.TimeStamp.ExpiresOn)
	case gcp.Name:
		var ev gcp.Evidence
		if err := json.Unmarshal(req.Evidence, &ev); err != nil {
			t.Fatal(err)
		}
		parts := strings.Split(ev.Token, ".")
		if len(parts) != 3 {
			t.Fatalf("the token is not a compact JWS")
		}
		payload, err := base64.RawURLEncoding.DecodeString(parts[1])
		if err != nil {
			t.Fatal(err)
		}
		var claims gcp.Claims
		if err := json.Unmarshal(payload, &claims); err != nil || claims.Google.ComputeEngine == nil {
			t.Fatalf("token claims %s: %v", payload, err)
		}
		ce := claims.Google.ComputeEngine
		detail("the instance identity token (RS256, format=full) issued by %s: instance %s (id %s), project %s, zone %s",
			claims.Issuer, ce.InstanceName, ce.InstanceID, ce.ProjectID, ce.Zone)
		detail("audience %s (carries the binding)", claims.Audience[0])
		detail("the controller checked the signature with the JWKS's keys and recomputed the audience from the CSR")
	}
	cond := condition(csr)
	if cond == nil || cond.Type != certificatesv1.CertificateApproved || len(csr.Status.Certificate) == 0 {
		t.Fatalf("CSR %s not approved and issued: %+v", csr.Name, csr.Status.Conditions)
	}
	detail("approved (%s): %s", cond.Reason, cond.Message)
}

// trustBundle is the one projection the demo's node is configured with.
type trustBundle struct{ signer, path string }

// projectTrustBundle shows the controller's serving CA, published as a
// signer-linked ClusterTrustBundle in the workload cluster, land on disk
// through the node agent, then an update of the signer's bundles.
func projectTrustBundle(ctx context.Context, t *testing.T, env *scenario.Env, n *scenario.Node, bundle trustBundle) {
	t.Helper()
	path, signer := bundle.path, bundle.signer
	ctbs := env.Workload.Client.CertificatesV1beta1().ClusterTrustBundles()
	var published []certificatesv1beta1.ClusterTrustBundle
	harness.WaitFor(t, time.Minute, func() (bool, error) {
		list, err := ctbs.List(ctx, metav1.ListOptions{FieldSelector: "spec.signerName=" + signer, LabelSelector: trust.LabelServingCA + "=true"})
		if err != nil {
			return false, err
		}
		published = list.Items
		return len(published) == 1, nil
	})
	say("node-attestation-controller published its serving CA (signer %s) in the workload cluster; the node agent projects it", signer)
	detail("ClusterTrustBundle %s (kept in Secret %s/%s%s on the management cluster, rotated 60 days before it expires)",
		published[0].Name, env.Namespace, env.Cluster, capi.ServingCASecretSuffix)
	harness.StartProcess(t, "kubelet-authenticator agent", filepath.Join(n.Dir, "agent.log"),
		filepath.Join(env.BinDir, "kubelet-authenticator"), "agent", "--config="+n.ConfigPath)
	certs := func() int {
		b, err := os.ReadFile(path)
		if err != nil {
			return 0
		}
		return strings.Count(string(b), "BEGIN CERTIFICATE")
	}
	waitFor := func(want int) time.Duration {
		start := time.Now()
		for certs() != want {
			if time.Since(start) > time.Minute {
				log, _ := os.ReadFile(filepath.Join(n.Dir, "agent.log"))
				t.Fatalf("bundle with %d certificates did not reach %s; agent log:\n%s", want, path, log)
			}
			time.Sleep(5 * time.Millisecond)
		}
		return time.Since(start)
	}
	waitFor(1)
	target, _ := os.Readlink(path)
	b, _ := os.ReadFile(path)
	if string(b) != published[0].Spec.TrustBundle {
		t.Fatalf("%s holds\n%s\nnot the published serving CA\n%s", path, b, published[0].Spec.TrustBundle)
	}
	detail("%s -> %s (written like kubelet's AtomicWriter): the serving CA", path, target)
	ca, err := harness.NewCA("Demo Platform CA")
	if err != nil {
		t.Fatal(err)
	}
	name := strings.ReplaceAll(signer, "/", ":") + ":demo-platform-ca"
	if _, err := ctbs.Create(ctx, &certificatesv1beta1.ClusterTrustBundle{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       certificatesv1beta1.ClusterTrustBundleSpec{SignerName: signer, TrustBundle: string(ca.CertPEM)},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	took := waitFor(2)
	detail("an administrator linked a second CA to the signer (ClusterTrustBundle %s): the update reached disk %s after the API write", name, took.Round(time.Millisecond))
}
