package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// nullAttestor is the test-only rubber-stamp attestor (attestor/null), which
// the scenario's binaries contain (build tag testattestors).
const nullAttestor = "null"

// nullNode writes a node that attests with the null attestor, producing the
// given evidence versions (newest first), and creates its Machine.
func nullNode(t *testing.T, env *scenario.Env, name string, versions ...string) *scenario.Node {
	t.Helper()
	n := env.NewNode(t, name, "test:///fleet/"+name, nullAttestor,
		"nullAttestor:\n  versions: ["+strings.Join(versions, ", ")+"]\n")
	env.Machine(t, n)
	return n
}

// csrsByVersion returns the node's CSRs keyed by their evidence version.
func csrsByVersion(t *testing.T, env *scenario.Env, node string) map[string]certificatesv1.CertificateSigningRequest {
	t.Helper()
	out := map[string]certificatesv1.CertificateSigningRequest{}
	for _, c := range nodeCSRs(t, env, node) {
		req, err := attestor.ParseRequest(c.Spec.Request)
		if err != nil {
			t.Fatal(err)
		}
		if req.Provider != nullAttestor || c.Spec.SignerName != attestor.ClientSignerName(nullAttestor) {
			t.Fatalf("CSR %s: provider %q, signer %q", c.Name, req.Provider, c.Spec.SignerName)
		}
		if _, dup := out[req.Version]; dup {
			t.Fatalf("two CSRs of %s in evidence version %s", node, req.Version)
		}
		out[req.Version] = c
	}
	return out
}

// TestVersionSkew runs the proposal's version-skew rule end to end: the real
// node binary and the real controller, configured with different evidence
// versions of the null attestor, through the real API server. A node whose
// newest version the signer does not accept is denied
// UnsupportedEvidenceVersion, reads the versions the signer wrote on its
// CSR, and re-files in the newest common one within the same credential
// call; with no common version it fails with one line naming both sides'
// versions.
func TestVersionSkew(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	env := scenario.Start(t, scenario.Options{Attestors: nullAttestor, ControllerArgs: []string{"--null-versions=v1"}})
	t.Logf("scenario up in %s", time.Since(start).Round(time.Millisecond))

	t.Run("newer node re-files in the signer's version", func(t *testing.T) {
		n := nullNode(t, env, "skew-newer-node", "v2", "v1")
		r := n.Credential(ctx, "--verbose")
		_, cert := parseExecCredential(t, r)
		if cert.Subject.CommonName != attestor.NodeUserPrefix+n.Name {
			t.Fatalf("certificate for %q", cert.Subject.CommonName)
		}
		for _, want := range []string{`"Re-filing with another evidence version"`, `rejected="v2"`, `next="v1"`} {
			if !strings.Contains(r.Stderr, want) {
				t.Errorf("the node does not say it re-filed in v1 (%s):\n%s", want, r.Stderr)
			}
		}
		csrs := csrsByVersion(t, env, n.Name)
		if len(csrs) != 2 {
			t.Fatalf("%d CSRs for %s, want 2 (v2 denied, v1 issued)", len(csrs), n.Name)
		}
		first, second := csrs["v2"], csrs["v1"]
		if got := cloudDenial(&first); got != "UnsupportedEvidenceVersion" {
			t.Fatalf("CSR #1 (v2) %s: %q, want denied UnsupportedEvidenceVersion\ncontroller log:\n%s", first.Name, cloudConditions(&first), cloudTail(env.ControllerLog(), 30))
		}
		if got := first.Annotations[attestor.AnnotationSupportedVersions]; got != "v1" {
			t.Errorf("CSR #1 %s annotation %s = %q, want \"v1\"", first.Name, attestor.AnnotationSupportedVersions, got)
		}
		if !approved(&second) || len(second.Status.Certificate) == 0 || cloudDenial(&second) != "" {
			t.Fatalf("CSR #2 (v1) %s: %q, want approved and issued", second.Name, cloudConditions(&second))
		}
		if !second.CreationTimestamp.After(first.CreationTimestamp.Time) && !second.CreationTimestamp.Equal(&first.CreationTimestamp) {
			t.Errorf("the v1 CSR (%s) was filed before the v2 one (%s)", second.CreationTimestamp, first.CreationTimestamp)
		}
		t.Logf("v2 denied, v1 issued, in one credential call of %s", r.Took.Round(time.Millisecond))
		// kubectl, through the same plugin, finds the certificate cached.
		w := n.Kubectl(ctx, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
		if w.Err != nil || strings.TrimSpace(w.Stdout) != attestor.NodeUserPrefix+n.Name {
			t.Fatalf("kubectl auth whoami: %q, %v\n%s", w.Stdout, w.Err, w.Stderr)
		}
		if got := len(nodeCSRs(t, env, n.Name)); got != 2 {
			t.Errorf("%d CSRs for %s after kubectl, want still 2", got, n.Name)
		}
	})

	t.Run("no common version fails with one line naming the versions", func(t *testing.T) {
		n := nullNode(t, env, "skew-no-common", "v3", "v2")
		r := n.Credential(ctx)
		if r.Err == nil {
			t.Fatalf("node %s got a certificate", n.Name)
		}
		if strings.TrimSpace(r.Stdout) != "" {
			t.Errorf("stdout is not empty on failure: %q", r.Stdout)
		}
		last := lastLine(r.Stderr)
		for _, want := range []string{"UnsupportedEvidenceVersion", "v3,v2", "v1"} {
			if !strings.Contains(last, want) {
				t.Errorf("last stderr line does not name %q: %q", want, last)
			}
		}
		t.Logf("error: %s", last)
		csrs := csrsByVersion(t, env, n.Name)
		if c, ok := csrs["v3"]; len(csrs) != 1 || !ok || cloudDenial(&c) != "UnsupportedEvidenceVersion" {
			t.Fatalf("CSRs for %s: %d, want one in v3 denied UnsupportedEvidenceVersion", n.Name, len(csrs))
		}
	})

	t.Run("newer signer accepts the older node the first time", func(t *testing.T) {
		env.StopController()
		env.StartController(t, "--null-versions=v2,v1")
		n := nullNode(t, env, "skew-older-node", "v1")
		r := n.Credential(ctx, "--verbose")
		parseExecCredential(t, r)
		if strings.Contains(r.Stderr, "Re-filing") {
			t.Errorf("the node re-filed:\n%s", r.Stderr)
		}
		csrs := csrsByVersion(t, env, n.Name)
		c, ok := csrs["v1"]
		if len(csrs) != 1 || !ok {
			t.Fatalf("CSRs for %s: %d, want one, in v1", n.Name, len(csrs))
		}
		if !approved(&c) || len(c.Status.Certificate) == 0 {
			t.Fatalf("CSR %s: %q, want approved and issued", c.Name, cloudConditions(&c))
		}
		if _, ok := c.Annotations[attestor.AnnotationSupportedVersions]; ok {
			t.Errorf("CSR %s carries %s though its version was accepted", c.Name, attestor.AnnotationSupportedVersions)
		}

		// Both at v2: the newest is used, once.
		both := nullNode(t, env, "skew-both-new", "v2", "v1")
		parseExecCredential(t, both.Credential(ctx))
		if csrs := csrsByVersion(t, env, both.Name); len(csrs) != 1 || len(csrs["v2"].Status.Certificate) == 0 {
			t.Fatalf("CSRs for %s: %d, want one, in v2, issued", both.Name, len(csrs))
		}
	})
}

func approved(c *certificatesv1.CertificateSigningRequest) bool {
	for _, cond := range c.Status.Conditions {
		if cond.Type == certificatesv1.CertificateApproved && cond.Status == "True" {
			return true
		}
	}
	return false
}
