// Package demo is `make demo`: it starts the whole product on 127.0.0.1 and
// narrates what happens. It runs as a test binary (so it reuses the test
// harness) but prints its narration on stdout; `make demo` runs the compiled
// binary directly so the narration is what a newcomer sees. Under `make test`
// it runs as an ordinary end-to-end test of the same flow.
//
// The node proves itself with the TPM attestor on the in-process TPM
// simulator, whose EK certificate is issued by a manufacturer CA made here:
// no hardware needed.
package demo

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
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

func TestDemo(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start := time.Now()

	say("Making a TPM manufacturer CA (root + EK-issuing intermediate) for the simulated TPMs")
	caDir := t.TempDir()
	ca, err := tpmtest.NewManufacturerCA("Demo TPM Manufacturer", time.Now().Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if err := ca.Save(caDir); err != nil {
		t.Fatal(err)
	}
	bundle := filepath.Join(caDir, tpmtest.BundleFile)
	detail("the controller trusts %s (--tpm-manufacturer-ca)", bundle)

	say("Building kubelet-authenticator and node-attestation-controller, starting two control planes on 127.0.0.1")
	detail("management cluster: etcd + kube-apiserver with the Cluster API CRDs (Cluster, Machine)")
	detail("workload cluster:   etcd + kube-apiserver, Node,RBAC authorization, NodeRestriction, bootstrap tokens")
	env := scenario.Start(t, scenario.Options{Attestors: "tpm,insecure", ControllerArgs: []string{"--tpm-manufacturer-ca=" + bundle}})
	detail("Cluster %s/%s opted in: kubelet-authenticator.x-k8s.io/enabled=true, authorized-attestors=tpm,insecure", env.Namespace, env.Cluster)
	detail("its kubeconfig and CA Secrets (%s-kubeconfig, %s-ca) laid out as Cluster API does", env.Cluster, env.Cluster)
	detail("node-attestation-controller is running against the management cluster")

	n := env.NewNode(t, "node-1", "demo:///fleet/node-1", "tpm",
		fmt.Sprintf("tpm:\n  device: simulator\n  simulator:\n    seed: 1\n    manufacturerCADir: %s\n", caDir),
		"agent:\n  metricsBindAddress: \"0\"\n",
		fmt.Sprintf("trustBundles:\n- signerName: %s\n  path: %s\n", attestor.ServingSignerName(tpm.Name), filepath.Join(t.TempDir(), "trust-bundles", "kubelet-serving", "ca.crt")))
	env.Machine(t, n)
	say("Cluster API created Machine machine-%s: spec.providerID=%s, bootstrap ready", n.Name, n.ProviderID)
	detail("the node holds only a bootstrap token (%s.****) and its TPM (simulated, EK certificate from the demo manufacturer)", strings.SplitN(env.Token, ".", 2)[0])

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

	say("The challenge round, as the controller recorded it on the CSRs")
	csrs, err := env.Workload.Client.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var first, second *certificatesv1.CertificateSigningRequest
	for i := range csrs.Items {
		c := &csrs.Items[i]
		req, err := attestor.ParseRequest(c.Spec.Request)
		if err != nil || req.CSR.Subject.CommonName != "system:node:"+n.Name {
			continue
		}
		if ev, err := tpm.DecodeEvidence(req.Evidence); err == nil && ev.Attestation != nil {
			first = c
		} else {
			second = c
		}
	}
	if first == nil || second == nil {
		t.Fatalf("the node did not file two CSRs: %+v", csrs.Items)
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
	cms, err := env.Mgmt.ControlPlane.Client.CoreV1().ConfigMaps(env.Namespace).List(ctx, metav1.ListOptions{LabelSelector: tofu.LabelIdentity})
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
	if user != "system:node:"+n.Name {
		t.Fatalf("API server sees %q", user)
	}
	fmt.Fprintf(os.Stdout, "authenticated as %s\n", user)

	projectTrustBundle(ctx, t, env, n)

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

// projectTrustBundle shows the controller's serving CA, published as a
// signer-linked ClusterTrustBundle in the workload cluster, land on disk
// through the node agent, then an update of the signer's bundles.
func projectTrustBundle(ctx context.Context, t *testing.T, env *scenario.Env, n *scenario.Node) {
	t.Helper()
	cfg, err := config.Load(n.ConfigPath)
	if err != nil || len(cfg.TrustBundles) != 1 {
		t.Fatalf("node config: %v", err)
	}
	path, signer := cfg.TrustBundles[0].Path, cfg.TrustBundles[0].SignerName
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
