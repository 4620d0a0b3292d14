package e2e

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	awsatt "sigs.k8s.io/kubelet-authenticator/attestor/aws"
	azureatt "sigs.k8s.io/kubelet-authenticator/attestor/azure"
	gcpatt "sigs.k8s.io/kubelet-authenticator/attestor/gcp"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
	"sigs.k8s.io/kubelet-authenticator/test/emulators/aws"
	"sigs.k8s.io/kubelet-authenticator/test/emulators/azure"
	"sigs.k8s.io/kubelet-authenticator/test/emulators/gcp"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// cloudFleet is what TestCloud runs against: one management cluster, the
// workload cluster "workload" (namespace fleet) and a second one, "tenant-b"
// (namespace fleet-b), both authorizing aws, azure and gcp; the real
// controller configured by an --attestor-config file; and the providers'
// emulators, one per machine.
type cloudFleet struct {
	env *scenario.Env
	// tenantB is env with the second workload cluster in place of the first.
	tenantB *scenario.Env
	ctx     context.Context

	aws   struct{ main, otherAccount, rogue, offList, late *aws.Emulator }
	azure struct{ main, otherSubscription, rogue *azure.Emulator }
	gcp   struct{ main, otherProject, rogue, impostor *gcp.Emulator }
	// lateSTS is an allowed STS host that reaches no STS (it closes every
	// connection) until a test points it at the late instance's STS. It
	// holds its port from the start: a port only picked then could be
	// taken by an outgoing connection before the test binds it.
	lateSTS     *switchableServer
	lateSTSHost string
}

// switchableServer is a TLS server that closes every connection it is
// sent a request on until serve gives it a handler.
type switchableServer struct {
	*httptest.Server
	handler atomic.Pointer[http.Handler]
}

func newSwitchableServer(t *testing.T) *switchableServer {
	s := &switchableServer{}
	s.Server = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if h := s.handler.Load(); h != nil {
			(*h).ServeHTTP(w, r)
			return
		}
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			_ = conn.Close()
		}
	}))
	t.Cleanup(s.Close)
	return s
}

// serve answers every later request with h.
func (s *switchableServer) serve(h http.Handler) { s.handler.Store(&h) }

const (
	azureSubscriptionB = "99999999-8888-7777-6666-555555555555"
	azureGroup         = "rg-fleet"
)

func azureProviderID(subscription, vm string) string {
	return "azure:///subscriptions/" + subscription + "/resourceGroups/" + azureGroup + "/providers/Microsoft.Compute/virtualMachines/" + vm
}

// TestCloud runs the aws, azure and gcp attestors end to end, each in a
// subtest of its own: through the real node binary against the provider's
// emulator, the real API server and the real controller, a node attests and
// talks as itself, and each way of lying is denied with its own reason.
func TestCloud(t *testing.T) {
	f := &cloudFleet{}
	var cancel context.CancelFunc
	f.ctx, cancel = context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()

	f.aws.main = aws.New(t, aws.Instance{})
	f.aws.otherAccount = aws.New(t, aws.Instance{AccountID: "444455556666", Region: "eu-test-2", InstanceID: "i-0fedcba9876543210"})
	f.aws.rogue = aws.New(t, aws.Instance{InstanceID: "i-0eeeeeeeeeeeeeeee"})
	f.aws.offList = aws.New(t, aws.Instance{InstanceID: "i-0cccccccccccccccc"})
	f.aws.late = aws.New(t, aws.Instance{InstanceID: "i-0bbbbbbbbbbbbbbbb"})
	f.lateSTS = newSwitchableServer(t)
	f.lateSTSHost = f.lateSTS.Listener.Addr().String()
	f.azure.main = azure.New(t, azure.VM{})
	f.azure.otherSubscription = azure.New(t, azure.VM{SubscriptionID: azureSubscriptionB, VMID: "bbbbbbbb-bbbb-cccc-dddd-eeeeeeeeeeee"})
	f.azure.rogue = azure.New(t, azure.VM{VMID: "cccccccc-bbbb-cccc-dddd-eeeeeeeeeeee"})
	f.gcp.main = gcp.New(t, gcp.Instance{InstanceName: "gcp-1", InstanceID: "1000000000000000001"})
	// Google signs every project's tokens with the same keys: the other
	// project's and the impostor's tokens verify; the rogue's key is not
	// published by the JWKS the controller trusts.
	f.gcp.otherProject = gcp.New(t, gcp.Instance{ProjectID: "other-project", InstanceName: "gcp-other", InstanceID: "1000000000000000002"})
	f.gcp.otherProject.ShareKey(f.gcp.main)
	f.gcp.impostor = gcp.New(t, gcp.Instance{InstanceName: "gcp-impostor", InstanceID: "1000000000000000003"})
	f.gcp.impostor.ShareKey(f.gcp.main)
	f.gcp.rogue = gcp.New(t, gcp.Instance{InstanceName: "gcp-rogue", InstanceID: "1000000000000000004"})

	start := time.Now()
	f.env = scenario.Start(t, scenario.Options{Attestors: "aws,azure,gcp", NoController: true})
	// The JWKS CA comes from a ConfigMap in the controller's namespace, the
	// STS CA from a file: both ways of trustedCA.
	if _, err := f.env.Mgmt.ControlPlane.Client.CoreV1().ConfigMaps("default").Create(f.ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "google-jwks-ca"},
		Data:       map[string]string{"ca-bundle.crt": string(f.gcp.main.JWKSCAPEM)},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	f.env.StartController(t, "--attestor-config="+f.writeAttestorConfig(t))

	// tenant-b: another team's workload cluster on the same management
	// cluster, where a Machine may claim an instance that is already
	// another Machine's.
	b := *f.env
	b.Namespace, b.Cluster, b.Dir = scenario.DefaultNamespace+"-b", "tenant-b", t.TempDir()
	b.Workload = harness.StartControlPlane(t, b.Cluster)
	b.Mgmt.AddWorkloadCluster(t, b.Namespace, b.Cluster, b.Workload, map[string]string{
		scenario.AnnotationEnabled:   "true",
		scenario.AnnotationAttestors: "aws,azure,gcp",
	})
	b.Token = b.Workload.CreateBootstrapToken(t)
	b.BootstrapKubeconfig = b.Workload.BootstrapKubeconfig(t, b.Token)
	f.tenantB = &b
	t.Logf("fleet up in %s", time.Since(start).Round(time.Millisecond))

	t.Run("aws", f.testAWS)
	t.Run("azure", f.testAzure)
	t.Run("gcp", f.testGCP)
}

// writeAttestorConfig writes the controller's --attestor-config: each
// provider trusts the main emulators' roots (and the other account's /
// subscription's, so that those reach the allowlist check), never the
// rogue ones'.
func (f *cloudFleet) writeAttestorConfig(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	write := func(name string, data ...[]byte) string {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, bytes.Join(data, nil), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a := f.aws
	write("aws-certs/eu-test-1.pem", a.main.RegionCertPEM, a.offList.RegionCertPEM, a.late.RegionCertPEM)
	write("aws-certs/eu-test-2.pem", a.otherAccount.RegionCertPEM)
	stsCA := write("sts-ca.pem", a.main.STSCAPEM, a.otherAccount.STSCAPEM, a.rogue.STSCAPEM, a.offList.STSCAPEM)
	z := f.azure
	cfg := fmt.Sprintf(`apiVersion: %s
kind: %s
aws:
  accounts: [%q]
  allowedRoles: [%q]
  certificatesDir: %s
  sts:
    hosts: [%q, %q, %q, %q, %q]
    tls:
      trustedCA:
        file: %s
azure:
  roots: [%s, %s]
  intermediates: [%s, %s]
  subscriptions: [%q]
gcp:
  projects: [%q]
  jwks:
    url: %s
    tls:
      trustedCA:
        configMap:
          name: google-jwks-ca
      securityProfile:
        type: Modern
`, "kubelet-authenticator.x-k8s.io/v1alpha1", "AttestorConfig",
		a.main.Instance.AccountID, a.main.Instance.Role, filepath.Join(dir, "aws-certs"),
		a.main.STSHost, a.otherAccount.STSHost, a.rogue.STSHost, a.offList.STSHost, f.lateSTSHost, stsCA,
		write("azure-root.pem", z.main.Root.PEM), write("azure-root-b.pem", z.otherSubscription.Root.PEM),
		write("azure-issuing.pem", z.main.Issuing.PEM), write("azure-issuing-b.pem", z.otherSubscription.Issuing.PEM),
		z.main.VM.SubscriptionID,
		f.gcp.main.Instance.ProjectID, f.gcp.main.JWKSURL)
	return write("attestors.yaml", []byte(cfg))
}

// node writes a node of env (its own directory, so that two nodes may share
// a name across clusters or cases) and, unless machinePID is empty, its
// Machine with that provider ID claiming the node's name.
func (f *cloudFleet) node(t *testing.T, env *scenario.Env, name, providerID, machinePID, provider, config string) *scenario.Node {
	t.Helper()
	e := *env
	e.Dir = t.TempDir()
	n := e.NewNode(t, name, providerID, provider, config)
	if machinePID != "" {
		e.Mgmt.CreateMachine(t, e.Namespace, e.Cluster, "machine-"+name, machinePID, true, name)
	}
	return n
}

func awsNodeConfig(e *aws.Emulator, stsURL string) string {
	if stsURL == "" {
		stsURL = e.STSURL
	}
	return fmt.Sprintf("aws:\n  imdsEndpoint: %s\n  stsEndpoint: %s\n", e.IMDSURL, stsURL)
}

func awsProviderID(e *aws.Emulator) string {
	return "aws:///" + e.Instance.AvailabilityZone + "/" + e.Instance.InstanceID
}

func azureNodeConfig(e *azure.Emulator) string {
	return fmt.Sprintf("azure:\n  imdsEndpoint: %s\n", e.URL)
}

func gcpNodeConfig(e *gcp.Emulator) string {
	return fmt.Sprintf("gcp:\n  metadataEndpoint: %s\n", e.MetadataURL)
}

func gcpProviderID(e *gcp.Emulator) string {
	return "gce://" + e.Instance.ProjectID + "/" + e.Instance.Zone + "/" + e.Instance.InstanceName
}

// attests asserts that the node gets a certificate through kubectl, that the
// API server sees it as itself, and that trust on first use recorded
// identity for its Machine.
func (f *cloudFleet) attests(t *testing.T, n *scenario.Node, provider, providerID, identity string) {
	t.Helper()
	start := time.Now()
	r := n.Kubectl(f.ctx, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
	if r.Err != nil {
		t.Fatalf("kubectl auth whoami: %v\n%s\ncontroller log:\n%s", r.Err, r.Stderr, cloudTail(f.env.ControllerLog(), 40))
	}
	if got := strings.TrimSpace(r.Stdout); got != "system:node:"+n.Name {
		t.Fatalf("API server sees %q, want system:node:%s", got, n.Name)
	}
	t.Logf("%s: cold issuance through kubectl auth whoami: %s", provider, time.Since(start).Round(time.Millisecond))

	csrs := nodeCSRs(t, f.env, n.Name)
	if len(csrs) != 1 {
		t.Fatalf("%d CSRs for %s, want 1", len(csrs), n.Name)
	}
	c := csrs[0]
	if c.Spec.SignerName != attestor.ClientSignerName(provider) || len(c.Status.Certificate) == 0 {
		t.Fatalf("CSR %s: signer %s, conditions %q", c.Name, c.Spec.SignerName, cloudConditions(&c))
	}
	req, err := attestor.ParseRequest(c.Spec.Request)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := attestor.ProviderIDFromExtensions(req.CSR.Extensions); err != nil || got != providerID {
		t.Fatalf("the CSR claims provider ID %q (%v), want %q", got, err, providerID)
	}
	cms, err := f.env.Mgmt.ControlPlane.Client.CoreV1().ConfigMaps(scenario.ControllerNamespace).List(f.ctx, metav1.ListOptions{LabelSelector: tofu.LabelIdentity})
	if err != nil {
		t.Fatal(err)
	}
	var recs []string
	for _, cm := range cms.Items {
		if cm.Data[tofu.KeyMachine] == "machine-"+n.Name {
			recs = append(recs, cm.Data[tofu.KeyIdentity])
		}
	}
	if len(recs) != 1 || recs[0] != identity {
		t.Errorf("trust-on-first-use records of machine-%s: %q, want [%q]", n.Name, recs, identity)
	}
}

// copiedIntoTenantB is the copy attack: tenant-b reads the victim node's
// fresh request in the fleet's workload cluster (its bootstrap token is
// enough to list CSRs) and files it, evidence and all, in its own cluster,
// where a Machine of its own claims the victim's provider ID and node
// name. The evidence names the victim's cluster CA (binding v2), so it is
// denied with the provider's binding reason before trust on first use,
// and no identity is bound to the copier's Machine.
func (f *cloudFleet) copiedIntoTenantB(t *testing.T, victim, pid, provider, version, reason string) {
	t.Helper()
	csrs := nodeCSRs(t, f.env, victim)
	if len(csrs) != 1 {
		t.Fatalf("%d CSRs for %s, want 1", len(csrs), victim)
	}
	req, err := attestor.ParseRequest(csrs[0].Spec.Request)
	if err != nil {
		t.Fatal(err)
	}
	if req.Version != version {
		t.Fatalf("the victim filed evidence %s, want the cluster-bound %s", req.Version, version)
	}
	b := f.tenantB
	m := b.Mgmt.CreateMachine(t, b.Namespace, b.Cluster, "machine-copy-"+victim, pid, true, victim)
	t.Cleanup(func() { _ = b.Mgmt.Client.Delete(context.Background(), m) })
	copied := &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{Name: "copy-" + victim},
		Spec: certificatesv1.CertificateSigningRequestSpec{
			Request: csrs[0].Spec.Request, SignerName: csrs[0].Spec.SignerName, Usages: csrs[0].Spec.Usages,
		},
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", b.BootstrapKubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cs.CertificatesV1().CertificateSigningRequests().Create(f.ctx, copied, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // later cases count the node's CSRs in tenant-b
		_ = b.Workload.Client.CertificatesV1().CertificateSigningRequests().Delete(context.Background(), copied.Name, metav1.DeleteOptions{})
	})
	var got *certificatesv1.CertificateSigningRequest
	harness.WaitFor(t, time.Minute, func() (bool, error) {
		c, err := b.Workload.Client.CertificatesV1().CertificateSigningRequests().Get(f.ctx, copied.Name, metav1.GetOptions{})
		got = c
		return err == nil && (len(c.Status.Certificate) > 0 || cloudDenial(c) != ""), err
	})
	if d := cloudDenial(got); d != reason {
		t.Fatalf("the copied request in tenant-b: %q, want denied %s\ncontroller log:\n%s", cloudConditions(got), reason, cloudTail(f.env.ControllerLog(), 30))
	}
	cms, err := f.env.Mgmt.ControlPlane.Client.CoreV1().ConfigMaps(scenario.ControllerNamespace).List(f.ctx, metav1.ListOptions{LabelSelector: tofu.LabelIdentity})
	if err != nil {
		t.Fatal(err)
	}
	for _, cm := range cms.Items {
		if cm.Data[tofu.KeyMachine] == m.Name {
			t.Errorf("trust on first use bound %q to the copier's Machine", cm.Data[tofu.KeyIdentity])
		}
	}
	t.Logf("copied into tenant-b: %s", cloudConditions(got))
}

// deniedWith asserts that the node's credential call fails with the
// controller's denial, and that its one CSR is denied with reason.
func (f *cloudFleet) deniedWith(t *testing.T, env *scenario.Env, n *scenario.Node, reason string) {
	t.Helper()
	r := n.Credential(f.ctx)
	if r.Err == nil {
		t.Fatalf("node %s got a certificate", n.Name)
	}
	if last := lastLine(r.Stderr); !strings.Contains(last, "denied") || !strings.Contains(last, reason) {
		t.Errorf("last stderr line does not give the denial and reason %s: %q", reason, last)
	}
	mine := nodeCSRs(t, env, n.Name)
	if len(mine) != 1 {
		t.Fatalf("%d CSRs for %s, want 1", len(mine), n.Name)
	}
	if got := cloudDenial(&mine[0]); got != reason {
		t.Fatalf("CSR %s: %q, want denied %s\ncontroller log:\n%s", mine[0].Name, cloudConditions(&mine[0]), reason, cloudTail(f.env.ControllerLog(), 30))
	}
	t.Logf("denied %s: %s", reason, cloudConditions(&mine[0]))
}

func (f *cloudFleet) testAWS(t *testing.T) {
	a := f.aws
	pid := awsProviderID(a.main)
	t.Run("node derives its provider ID, attests and talks as itself", func(t *testing.T) {
		n := f.node(t, f.env, "aws-1", "", pid, awsatt.Name, awsNodeConfig(a.main, ""))
		f.attests(t, n, awsatt.Name, pid, "aws:"+a.main.Instance.AccountID+":"+a.main.Instance.InstanceID)
		if a.main.STSCalls() == 0 {
			t.Error("the controller never replayed the presigned request to STS")
		}
	})
	t.Run("request and evidence copied into another cluster", func(t *testing.T) {
		f.copiedIntoTenantB(t, "aws-1", pid, awsatt.Name, awsatt.VersionV2, awsatt.ReasonBindingMismatch)
	})
	t.Run("account not allowed", func(t *testing.T) {
		n := f.node(t, f.env, "aws-other", "", awsProviderID(a.otherAccount), awsatt.Name, awsNodeConfig(a.otherAccount, ""))
		f.deniedWith(t, f.env, n, awsatt.ReasonAccountNotAllowed)
	})
	t.Run("provider ID of another Machine", func(t *testing.T) {
		victim := "aws:///eu-test-1a/i-0dddddddddddddddd"
		n := f.node(t, f.env, "aws-impostor", victim, victim, awsatt.Name, awsNodeConfig(a.main, ""))
		f.deniedWith(t, f.env, n, awsatt.ReasonProviderIDMismatch)
	})
	t.Run("document signed by a certificate the controller does not trust", func(t *testing.T) {
		n := f.node(t, f.env, "aws-rogue", "", awsProviderID(a.rogue), awsatt.Name, awsNodeConfig(a.rogue, ""))
		f.deniedWith(t, f.env, n, awsatt.ReasonUntrustedSigner)
	})
	t.Run("presigned request to a host not on the allowlist", func(t *testing.T) {
		// The same STS, named localhost: the allowlist has 127.0.0.1.
		off := strings.Replace(a.offList.STSURL, "127.0.0.1", "localhost", 1)
		n := f.node(t, f.env, "aws-offlist", "", awsProviderID(a.offList), awsatt.Name, awsNodeConfig(a.offList, off))
		f.deniedWith(t, f.env, n, awsatt.ReasonSTSHostNotAllowed)
	})
	t.Run("STS unreachable: the request waits, then is signed", func(t *testing.T) {
		n := f.node(t, f.env, "aws-late", "", awsProviderID(a.late), awsatt.Name, awsNodeConfig(a.late, "https://"+f.lateSTSHost))
		r := n.Credential(f.ctx, "--timeout=5s")
		if r.Err == nil || !strings.Contains(lastLine(r.Stderr), "timed out") {
			t.Fatalf("with STS down: err %v, last stderr line %q; want a timeout", r.Err, lastLine(r.Stderr))
		}
		csrs := nodeCSRs(t, f.env, n.Name)
		if len(csrs) != 1 || cloudDenial(&csrs[0]) != "" || len(csrs[0].Status.Certificate) > 0 {
			t.Fatalf("with STS down the CSR must stay pending: %d CSRs, %q", len(csrs), cloudConditions(&csrs[0]))
		}
		// STS is back (a proxy to the emulator at the allowed address):
		// the controller's retry signs the same request, before its
		// presigned URL expires.
		target, _ := url.Parse(a.late.STSURL)
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(a.late.STSCAPEM)
		proxy := httputil.NewSingleHostReverseProxy(target)
		proxy.Transport = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
		f.lateSTS.serve(proxy)
		parseExecCredential(t, n.Credential(f.ctx))
		if after := nodeCSRs(t, f.env, n.Name); len(after) != 1 || after[0].Name != csrs[0].Name {
			t.Fatalf("the retry filed a new CSR instead of waiting for %s", csrs[0].Name)
		}
		if a.late.STSCalls() == 0 {
			t.Fatal("STS never answered the controller")
		}
	})
	t.Run("the same instance claimed by a Machine of another cluster", func(t *testing.T) {
		n := f.node(t, f.tenantB, "aws-clone", "", pid, awsatt.Name, awsNodeConfig(a.main, ""))
		f.deniedWith(t, f.tenantB, n, attestor.ReasonIdentityClaimedByOtherMachine)
	})
}

func (f *cloudFleet) testAzure(t *testing.T) {
	z := f.azure
	sub := z.main.VM.SubscriptionID
	t.Run("node attests and talks as itself", func(t *testing.T) {
		pid := azureProviderID(sub, "azure-1")
		n := f.node(t, f.env, "azure-1", pid, pid, azureatt.Name, azureNodeConfig(z.main))
		f.attests(t, n, azureatt.Name, pid, "azure:"+z.main.VM.VMID)
	})
	t.Run("request and evidence copied into another cluster", func(t *testing.T) {
		f.copiedIntoTenantB(t, "azure-1", azureProviderID(sub, "azure-1"), azureatt.Name, azureatt.VersionV2, azureatt.ReasonNonceMismatch)
	})
	t.Run("subscription not allowed", func(t *testing.T) {
		pid := azureProviderID(azureSubscriptionB, "azure-other")
		n := f.node(t, f.env, "azure-other", pid, pid, azureatt.Name, azureNodeConfig(z.otherSubscription))
		f.deniedWith(t, f.env, n, azureatt.ReasonSubscriptionNotAllowed)
	})
	t.Run("provider ID of another subscription's Machine", func(t *testing.T) {
		pid := azureProviderID(azureSubscriptionB, "azure-impostor")
		n := f.node(t, f.env, "azure-impostor", pid, pid, azureatt.Name, azureNodeConfig(z.main))
		f.deniedWith(t, f.env, n, azureatt.ReasonProviderIDMismatch)
	})
	t.Run("document signed under a root the controller does not trust", func(t *testing.T) {
		pid := azureProviderID(sub, "azure-rogue")
		n := f.node(t, f.env, "azure-rogue", pid, pid, azureatt.Name, azureNodeConfig(z.rogue))
		f.deniedWith(t, f.env, n, azureatt.ReasonUntrustedSigner)
	})
	// The attested document does not name the VM, so one VM can claim any
	// Machine of its subscription: trust on first use of the vmId is what
	// stops it, in the same cluster.
	t.Run("the same VM claimed by a second Machine", func(t *testing.T) {
		pid := azureProviderID(sub, "azure-clone")
		n := f.node(t, f.env, "azure-clone", pid, pid, azureatt.Name, azureNodeConfig(z.main))
		f.deniedWith(t, f.env, n, attestor.ReasonIdentityClaimedByOtherMachine)
	})
}

func (f *cloudFleet) testGCP(t *testing.T) {
	g := f.gcp
	pid := gcpProviderID(g.main)
	t.Run("node derives its provider ID, attests and talks as itself", func(t *testing.T) {
		n := f.node(t, f.env, "gcp-1", "", pid, gcpatt.Name, gcpNodeConfig(g.main))
		f.attests(t, n, gcpatt.Name, pid, "gcp:"+g.main.Instance.InstanceID)
		if g.main.JWKSFetches() == 0 {
			t.Error("the controller never fetched the JWKS")
		}
	})
	t.Run("request and evidence copied into another cluster", func(t *testing.T) {
		f.copiedIntoTenantB(t, "gcp-1", pid, gcpatt.Name, gcpatt.VersionV2, gcpatt.ReasonAudienceMismatch)
	})
	t.Run("project not allowed", func(t *testing.T) {
		n := f.node(t, f.env, "gcp-other", "", gcpProviderID(g.otherProject), gcpatt.Name, gcpNodeConfig(g.otherProject))
		f.deniedWith(t, f.env, n, gcpatt.ReasonProjectNotAllowed)
	})
	t.Run("provider ID of another Machine", func(t *testing.T) {
		victim := "gce://" + g.main.Instance.ProjectID + "/" + g.main.Instance.Zone + "/gcp-victim"
		n := f.node(t, f.env, "gcp-impostor", victim, victim, gcpatt.Name, gcpNodeConfig(g.impostor))
		f.deniedWith(t, f.env, n, gcpatt.ReasonProviderIDMismatch)
	})
	t.Run("token signed with a key the controller's JWKS does not publish", func(t *testing.T) {
		n := f.node(t, f.env, "gcp-rogue", "", gcpProviderID(g.rogue), gcpatt.Name, gcpNodeConfig(g.rogue))
		f.deniedWith(t, f.env, n, gcpatt.ReasonUnknownKey)
	})
	t.Run("the same instance claimed by a Machine of another cluster", func(t *testing.T) {
		// The instance name is the node name, so the clone is gcp-1 too.
		n := f.node(t, f.tenantB, "gcp-1", "", pid, gcpatt.Name, gcpNodeConfig(g.main))
		f.deniedWith(t, f.tenantB, n, attestor.ReasonIdentityClaimedByOtherMachine)
	})
	t.Run("a derived provider ID no Machine has", func(t *testing.T) {
		// The Machine of gcp-other2 was created with a provider ID the
		// infrastructure provider got wrong: the node's derived one finds
		// no Machine.
		o := gcp.New(t, gcp.Instance{InstanceName: "gcp-other2", InstanceID: "1000000000000000005"})
		o.ShareKey(g.main)
		n := f.node(t, f.env, "gcp-other2", "", "gce://"+o.Instance.ProjectID+"/europe-test1-c/gcp-other2", gcpatt.Name, gcpNodeConfig(o))
		f.deniedWith(t, f.env, n, capi.ReasonMachineProviderIDMismatch)
	})
}

func cloudDenial(c *certificatesv1.CertificateSigningRequest) string {
	for _, cond := range c.Status.Conditions {
		if cond.Type == certificatesv1.CertificateDenied || cond.Type == certificatesv1.CertificateFailed {
			return cond.Reason
		}
	}
	return ""
}

func cloudConditions(c *certificatesv1.CertificateSigningRequest) []string {
	var out []string
	for _, cond := range c.Status.Conditions {
		out = append(out, string(cond.Type)+"/"+cond.Reason+": "+cond.Message)
	}
	return out
}

func cloudTail(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
