//go:build tpmsimulator

package e2e

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// releasedCommit is the released node binary of the version-skew test: the
// last commit of main's first-parent history before binding v2 merged
// ("Merge branch 's5-binding'", efba0fb, is the merge; this is its first
// parent). Its node produces TPM evidence v2 and cloud evidence v1, which
// name the CSR key but not the workload cluster, and it knows no newer
// version: what every node not yet upgraded runs.
const releasedCommit = "4162d815465dd52eff54727ad3ce21d8c05bda69"

// TestReleasedNodeAgainstNewController runs the released node binary
// (releasedCommit, built from history) against the current controller
// through the real API server, with swtpm and the AWS emulator: under the
// default policy it joins with its key-bound evidence; once the Cluster's
// ClusterAttestation sets spec.requireClusterBinding it is denied
// UnsupportedEvidenceVersion, is told the cluster-bound versions, knows
// none of them and fails with one line, and nothing is issued; the current
// binary then joins the same Machines with cluster-bound evidence. The
// current binary starts low only when it cannot name its cluster (its
// bootstrap kubeconfig has no CA data and the API server verifies against
// the system roots): it then learns the signer's versions from
// supported-versions and moves up within the same call, and fails because
// it cannot produce cluster-bound evidence without the CA.
func TestReleasedNodeAgainstNewController(t *testing.T) {
	start := time.Now()
	released := scenario.NodeBinaryAt(t, releasedCommit)
	t.Logf("released node binary (%s) ready in %s", releasedCommit[:7], time.Since(start).Round(time.Millisecond))

	sock, bundle := harness.StartSwtpm(t, nil)
	clouds := scenario.StartClouds(t, "unused-gcp")
	env := scenario.Start(t, scenario.Options{Attestors: "tpm,aws", ControllerArgs: []string{
		"--tpm-manufacturer-ca=" + bundle, "--attestor-config=" + clouds.AttestorConfig,
	}})
	t.Logf("scenario up in %s", time.Since(start).Round(time.Millisecond))
	// The clock of the node's calls starts once everything is up (the
	// first build of the released binary takes minutes on a busy machine).
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	tpmNode := env.NewNode(t, "skew-tpm", "test:///fleet/skew-tpm", "tpm", "tpm:\n  device: unix://"+sock+"\n")
	env.Machine(t, tpmNode)
	awsNode := env.CloudNode(t, clouds, "skew-aws", "aws")
	env.Machine(t, awsNode)
	nodes := []struct {
		n        *scenario.Node
		provider string
		// released is the released node's version; clusterBound the
		// current node's, and supported the cluster-bound versions the
		// signer accepts.
		released, clusterBound, supported string
	}{
		{tpmNode, "tpm", "v2", "v4", "v4,v3"},
		{awsNode, "aws", "v1", "v2", "v2"},
	}

	// seen tracks each node's CSRs already looked at, so that each step
	// reads only the requests it filed.
	seen := map[string]bool{}
	filed := func(t *testing.T, n *scenario.Node) []certificatesv1.CertificateSigningRequest {
		t.Helper()
		var out []certificatesv1.CertificateSigningRequest
		for _, c := range nodeCSRs(t, env, n.Name) {
			if !seen[c.Name] {
				seen[c.Name] = true
				out = append(out, c)
			}
		}
		return out
	}
	version := func(t *testing.T, c *certificatesv1.CertificateSigningRequest) string {
		t.Helper()
		r, err := attestor.ParseRequest(c.Spec.Request)
		if err != nil {
			t.Fatal(err)
		}
		return r.Version
	}
	// joined asserts a successful call whose requests are all in version
	// and one of which was issued.
	joined := func(t *testing.T, n *scenario.Node, r scenario.Result, want string) {
		t.Helper()
		if r.Err != nil {
			t.Fatalf("%s: credential failed: %v\n%s\ncontroller log:\n%s", n.Name, r.Err, r.Stderr, harness.LastLines(env.ControllerLog(), 40))
		}
		issued := 0
		for _, c := range filed(t, n) {
			if v := version(t, &c); v != want {
				t.Errorf("%s filed %s in evidence %s, want %s", n.Name, c.Name, v, want)
			}
			if len(c.Status.Certificate) > 0 {
				issued++
			}
		}
		if issued != 1 {
			t.Errorf("%s: %d certificates issued, want 1", n.Name, issued)
		}
	}
	fresh := func(t *testing.T, n *scenario.Node) {
		t.Helper()
		// A node that has no certificate yet (a new or reinstalled
		// machine of the same Machine): the next call bootstraps.
		if err := os.RemoveAll(n.CacheDir); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("default policy: the released node joins with key-bound evidence", func(t *testing.T) {
		for _, x := range nodes {
			joined(t, x.n, x.n.CredentialWith(ctx, released, nil), x.released)
			t.Logf("%s (released binary) joined: %s evidence %s issued", x.n.Name, x.provider, x.released)
		}
	})

	// The Cluster's owner requires cluster-bound evidence through its
	// ClusterAttestation's spec (the policy moves from the Cluster's
	// annotations to the spec, which the status reports once in force).
	att := &unstructured.Unstructured{}
	att.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
	att.SetNamespace(env.Namespace)
	att.SetName(env.Cluster)
	att.Object["spec"] = map[string]any{"authorizedAttestors": []any{"tpm", "aws"}, "requireClusterBinding": true}
	if err := env.Mgmt.Client.Apply(ctx, client.ApplyConfigurationFromUnstructured(att), client.FieldOwner("cluster-owner"), client.ForceOwnership); err != nil {
		t.Fatalf("unable to set spec.requireClusterBinding: %v", err)
	}
	harness.WaitFor(t, time.Minute, func() (bool, error) {
		got := &unstructured.Unstructured{}
		got.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
		if err := env.Mgmt.Client.Get(ctx, client.ObjectKeyFromObject(att), got); err != nil {
			return false, err
		}
		src, _, _ := unstructured.NestedString(got.Object, "status", "policySource")
		return src == string(v1alpha1.PolicySourceSpec), nil
	})

	t.Run("requireClusterBinding: the released node is denied and told to upgrade", func(t *testing.T) {
		for _, x := range nodes {
			fresh(t, x.n)
			r := x.n.CredentialWith(ctx, released, nil)
			if r.Err == nil {
				t.Fatalf("%s (released binary) got a certificate under requireClusterBinding", x.n.Name)
			}
			last := lastLine(r.Stderr)
			for _, want := range []string{"no evidence version in common", attestor.ReasonUnsupportedEvidenceVersion, x.supported} {
				if !strings.Contains(last, want) {
					t.Errorf("%s: the last stderr line does not say %q: %q", x.n.Name, want, last)
				}
			}
			csrs := filed(t, x.n)
			if len(csrs) != 1 {
				t.Fatalf("%s filed %d requests, want 1", x.n.Name, len(csrs))
			}
			c := csrs[0]
			if got := cloudDenial(&c); got != attestor.ReasonUnsupportedEvidenceVersion || len(c.Status.Certificate) > 0 {
				t.Fatalf("%s %s: %q, want denied %s and nothing issued", x.n.Name, c.Name, cloudConditions(&c), attestor.ReasonUnsupportedEvidenceVersion)
			}
			msg := cloudConditions(&c)[0]
			for _, want := range []string{`"` + x.released + `"`, "does not name the workload cluster", x.supported, "upgrade the node's kubelet-authenticator"} {
				if !strings.Contains(msg, want) {
					t.Errorf("%s: the denial does not say %q: %s", x.n.Name, want, msg)
				}
			}
			if got := c.Annotations[attestor.AnnotationSupportedVersions]; got != x.supported {
				t.Errorf("%s %s: %s = %q, want %q", x.n.Name, c.Name, attestor.AnnotationSupportedVersions, got, x.supported)
			}
			t.Logf("%s (released binary): %s\nnode: %s", x.n.Name, msg, last)
		}
	})

	t.Run("requireClusterBinding: the current node joins with cluster-bound evidence", func(t *testing.T) {
		for _, x := range nodes {
			r := x.n.Credential(ctx, "--verbose")
			joined(t, x.n, r, x.clusterBound)
			if strings.Contains(r.Stderr, "Re-filing") {
				t.Errorf("%s re-filed: it names its cluster from the first request\n%s", x.n.Name, r.Stderr)
			}
			t.Logf("%s (current binary) joined: %s evidence %s issued", x.n.Name, x.provider, x.clusterBound)
		}
	})

	t.Run("requireClusterBinding: a current node that cannot name its cluster moves up and says why it cannot", func(t *testing.T) {
		// Its bootstrap kubeconfig has no CA data: it verifies the API
		// server against the system roots (here SSL_CERT_FILE).
		raw, err := clientcmd.LoadFromFile(env.BootstrapKubeconfig)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range raw.Clusters {
			c.CertificateAuthorityData, c.CertificateAuthority = nil, ""
		}
		noCA := filepath.Join(t.TempDir(), "bootstrap-no-ca.kubeconfig")
		if err := clientcmd.WriteToFile(*raw, noCA); err != nil {
			t.Fatal(err)
		}
		roots := filepath.Join(t.TempDir(), "roots.pem")
		if err := os.WriteFile(roots, env.Workload.CACertPEM, 0o600); err != nil {
			t.Fatal(err)
		}
		n := awsNode
		fresh(t, n)
		rewrite(t, n.ConfigPath, env.BootstrapKubeconfig, noCA)
		r := n.CredentialWith(ctx, "", []string{"SSL_CERT_FILE=" + roots}, "--verbose")
		if r.Err == nil {
			t.Fatalf("%s got a certificate with evidence that cannot name its cluster", n.Name)
		}
		for _, want := range []string{`"Re-filing with another evidence version"`, `rejected="v1"`, `next="v2"`, "cluster-bound evidence needs", "cluster CA"} {
			if !strings.Contains(r.Stderr, want) {
				t.Errorf("%s does not say %q:\n%s", n.Name, want, r.Stderr)
			}
		}
		csrs := filed(t, n)
		if len(csrs) != 1 || version(t, &csrs[0]) != "v1" || cloudDenial(&csrs[0]) != attestor.ReasonUnsupportedEvidenceVersion ||
			!slices.Equal(strings.Split(csrs[0].Annotations[attestor.AnnotationSupportedVersions], ","), []string{"v2"}) {
			t.Fatalf("%s filed %d requests, want one in v1 denied %s with supported-versions v2", n.Name, len(csrs), attestor.ReasonUnsupportedEvidenceVersion)
		}
		t.Logf("%s (current binary, no CA data): %s", n.Name, lastLine(r.Stderr))
	})
}
