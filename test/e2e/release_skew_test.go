package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// releasedNodeCommit is the released node binary: main's first-parent
// commit just before binding v2 merged (the first parent of "Merge branch
// 's5-binding'", efba0fb). Its node produces only key-bound evidence (aws
// v1, insecure v1, TPM v2): it names no cluster, which is what nodes in the
// field run until they are upgraded.
const releasedNodeCommit = "4162d815465dd52eff54727ad3ce21d8c05bda69"

// releasedNode builds cmd/kubelet-authenticator as of releasedNodeCommit,
// from git history, with the scenario's build tags, once per machine: the
// build is kept under the user cache directory.
func releasedNode(t *testing.T) string {
	t.Helper()
	cache, err := os.UserCacheDir()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(cache, "kubelet-authenticator", "released-node-"+releasedNodeCommit)
	bin := filepath.Join(dir, "kubelet-authenticator")
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("git", "-C", root, "cat-file", "-e", releasedNodeCommit+"^{commit}").CombinedOutput(); err != nil {
		t.Fatalf("git history of %s lacks the released node's commit %s (a shallow clone?): %v %s", root, releasedNodeCommit, err, strings.TrimSpace(string(out)))
	}
	src := t.TempDir()
	archive := exec.Command("sh", "-c", `git -C "$1" archive "$2" | tar -x -C "$3"`, "sh", root, releasedNodeCommit, src)
	if out, err := archive.CombinedOutput(); err != nil {
		t.Fatalf("unable to extract %s: %v\n%s", releasedNodeCommit, err, out)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	tmp := bin + fmt.Sprintf(".%d", os.Getpid())
	start := time.Now()
	build := exec.Command("go", "build", "-tags", scenario.BinaryTags, "-o", tmp, "./cmd/kubelet-authenticator")
	build.Dir = src
	build.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("unable to build the released node binary (%s): %v\n%s", releasedNodeCommit, err, out)
	}
	if err := os.Rename(tmp, bin); err != nil {
		t.Fatal(err)
	}
	t.Logf("built the released node binary (%s) in %s", releasedNodeCommit[:7], time.Since(start).Round(time.Millisecond))
	return bin
}

// TestReleasedNode runs today's controller against the node binary
// released before binding v2 (releasedNodeCommit), built from git history:
// under the default policy the released node joins; once the Cluster's
// ClusterAttestation sets spec.requireClusterBinding, its evidence (which
// names no cluster) is denied UnsupportedEvidenceVersion, the CSR says the
// versions the signer takes, the node fails with one line naming both
// sides' versions and holds no certificate, while today's node, on the same
// machine, joins under the same policy.
func TestReleasedNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	released := releasedNode(t)
	start := time.Now()
	clouds := scenario.StartClouds(t, "released-gcp")
	env := scenario.Start(t, scenario.Options{Attestors: "aws,insecure", ControllerArgs: []string{"--attestor-config=" + clouds.AttestorConfig}})
	t.Logf("scenario up in %s", time.Since(start).Round(time.Millisecond))

	// One AWS instance and its Machine: the released node and today's node
	// are the same machine before and after an upgrade.
	old := env.CloudNode(t, clouds, "released-aws", "aws")
	old.Binary = released
	env.Machine(t, old)
	insecureOld := env.NewNode(t, "released-insecure", "test:///fleet/released-insecure", "insecure")
	insecureOld.Binary = released
	env.Machine(t, insecureOld)

	t.Run("joins under the default policy", func(t *testing.T) {
		for _, n := range []*scenario.Node{old, insecureOld} {
			_, cert := parseExecCredential(t, n.Credential(ctx))
			if cert.Subject.CommonName != "system:node:"+n.Name {
				t.Fatalf("certificate for %q", cert.Subject.CommonName)
			}
			csrs := nodeCSRs(t, env, n.Name)
			if len(csrs) != 1 {
				t.Fatalf("%d CSRs for %s, want 1", len(csrs), n.Name)
			}
			req, err := attestor.ParseRequest(csrs[0].Spec.Request)
			if err != nil {
				t.Fatal(err)
			}
			// The released node's evidence is key-bound only: v1.
			if req.Version != "v1" || !approved(&csrs[0]) || len(csrs[0].Status.Certificate) == 0 {
				t.Fatalf("CSR %s of %s: version %q, %q; want v1, approved and issued", csrs[0].Name, n.Name, req.Version, cloudConditions(&csrs[0]))
			}
		}
	})

	t.Run("denied with an actionable reason under requireClusterBinding", func(t *testing.T) {
		requireClusterBinding(ctx, t, env, "aws", "insecure")
		if err := os.RemoveAll(old.CacheDir); err != nil {
			t.Fatal(err)
		}
		before := names(nodeCSRs(t, env, old.Name))
		r := old.Credential(ctx)
		if r.Err == nil {
			t.Fatalf("the released node got a certificate under requireClusterBinding:\n%s", r.Stderr)
		}
		if strings.TrimSpace(r.Stdout) != "" {
			t.Errorf("stdout is not empty on failure: %q", r.Stdout)
		}
		last := lastLine(r.Stderr)
		for _, want := range []string{"UnsupportedEvidenceVersion", "produces v1", "accepts v2"} {
			if !strings.Contains(last, want) {
				t.Errorf("the released node's last line does not say %q: %q", want, last)
			}
		}
		t.Logf("released node: %s", last)
		fresh := filed(nodeCSRs(t, env, old.Name), before)
		if len(fresh) != 1 {
			t.Fatalf("%d new CSRs for %s, want 1", len(fresh), old.Name)
		}
		c := fresh[0]
		if got := cloudDenial(&c); got != attestor.ReasonUnsupportedEvidenceVersion || len(c.Status.Certificate) != 0 {
			t.Fatalf("CSR %s: %q, want denied %s without a certificate", c.Name, cloudConditions(&c), attestor.ReasonUnsupportedEvidenceVersion)
		}
		if got := c.Annotations[attestor.AnnotationSupportedVersions]; got != "v2" {
			t.Errorf("CSR %s says the signer takes %q, want \"v2\"", c.Name, got)
		}

		// Today's node, on the same instance and Machine, joins in v2.
		today := env.CloudNode(t, clouds, "released-aws", "aws")
		if err := os.RemoveAll(today.CacheDir); err != nil {
			t.Fatal(err)
		}
		before = names(nodeCSRs(t, env, today.Name))
		_, cert := parseExecCredential(t, today.Credential(ctx))
		if cert.Subject.CommonName != "system:node:"+today.Name {
			t.Fatalf("certificate for %q", cert.Subject.CommonName)
		}
		fresh = filed(nodeCSRs(t, env, today.Name), before)
		if len(fresh) != 1 {
			t.Fatalf("%d new CSRs for today's %s, want 1", len(fresh), today.Name)
		}
		c = fresh[0]
		req, err := attestor.ParseRequest(c.Spec.Request)
		if err != nil {
			t.Fatal(err)
		}
		if req.Version != "v2" || !approved(&c) || len(c.Status.Certificate) == 0 {
			t.Fatalf("today's CSR %s: version %q, %q; want v2, approved and issued", c.Name, req.Version, cloudConditions(&c))
		}

		// Insecure evidence has no cluster-bound version: the policy does
		// not change it, and the released node still joins.
		if err := os.RemoveAll(insecureOld.CacheDir); err != nil {
			t.Fatal(err)
		}
		parseExecCredential(t, insecureOld.Credential(ctx))
	})
}

// requireClusterBinding makes the scenario Cluster's ClusterAttestation
// spec its policy, authorizing attestors and requiring cluster-bound
// evidence, and waits until the controller serves it.
func requireClusterBinding(ctx context.Context, t *testing.T, env *scenario.Env, attestors ...string) {
	t.Helper()
	obj := &unstructured.Unstructured{}
	obj.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
	obj.SetNamespace(env.Namespace)
	obj.SetName(env.Cluster)
	spec := fmt.Sprintf(`{"spec":{"authorizedAttestors":["%s"],"requireClusterBinding":true}}`, strings.Join(attestors, `","`))
	deadline := time.Now().Add(time.Minute)
	for {
		err := env.Mgmt.Client.Patch(ctx, obj, client.RawPatch(types.MergePatchType, []byte(spec)))
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("unable to set the ClusterAttestation's spec: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	for {
		got := &unstructured.Unstructured{}
		got.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
		if err := env.Mgmt.Client.Get(ctx, client.ObjectKeyFromObject(obj), got); err == nil {
			if src, _, _ := unstructured.NestedString(got.Object, "status", "policySource"); src == string(v1alpha1.PolicySourceSpec) {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the controller does not serve the ClusterAttestation's spec within a minute\ncontroller log:\n%s", cloudTail(env.ControllerLog(), 30))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// names returns the names of csrs.
func names(csrs []certificatesv1.CertificateSigningRequest) map[string]bool {
	out := map[string]bool{}
	for _, c := range csrs {
		out[c.Name] = true
	}
	return out
}

// filed returns those of csrs not named in before.
func filed(csrs []certificatesv1.CertificateSigningRequest, before map[string]bool) []certificatesv1.CertificateSigningRequest {
	var out []certificatesv1.CertificateSigningRequest
	for _, c := range csrs {
		if !before[c.Name] {
			out = append(out, c)
		}
	}
	return out
}
