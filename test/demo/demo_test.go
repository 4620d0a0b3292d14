// Package demo is `make demo`: it starts the whole product on 127.0.0.1 and
// narrates what happens. It runs as a test binary (so it reuses the test
// harness) but prints its narration on stdout; `make demo` runs the compiled
// binary directly so the narration is what a newcomer sees. Under `make test`
// it runs as an ordinary end-to-end test of the same flow.
package demo

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

func say(format string, args ...any) {
	fmt.Fprintf(os.Stdout, "==> "+format+"\n", args...)
}

func detail(format string, args ...any) {
	fmt.Fprintf(os.Stdout, "    "+format+"\n", args...)
}

func TestDemo(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start := time.Now()

	say("Building kubelet-authenticator and node-attestation-controller, starting two control planes on 127.0.0.1")
	detail("management cluster: etcd + kube-apiserver with the Cluster API CRDs (Cluster, Machine)")
	detail("workload cluster:   etcd + kube-apiserver, Node,RBAC authorization, NodeRestriction, bootstrap tokens")
	env := scenario.Start(t, scenario.Options{})
	detail("Cluster %s/%s opted in: kubelet-authenticator.x-k8s.io/enabled=true, authorized-attestors=insecure", env.Namespace, env.Cluster)
	detail("its kubeconfig and CA Secrets (%s-kubeconfig, %s-ca) laid out as Cluster API does", env.Cluster, env.Cluster)
	detail("node-attestation-controller is running against the management cluster")

	n := env.NewNode(t, "node-1", "demo:///fleet/node-1", "insecure")
	env.Machine(t, n)
	say("Cluster API created Machine machine-%s: spec.providerID=%s, bootstrap ready", n.Name, n.ProviderID)
	detail("the node holds only a bootstrap token (%s.****)", strings.SplitN(env.Token, ".", 2)[0])

	say("Node %s runs `kubelet-authenticator credential`, as kubelet's exec plugin would", n.Name)
	r := n.Credential(ctx, "--verbose")
	if r.Err != nil {
		t.Fatalf("credential failed: %v\n%s\ncontroller log:\n%s", r.Err, r.Stderr, env.ControllerLog())
	}
	for _, line := range strings.Split(strings.TrimSpace(r.Stderr), "\n") {
		detail("%s", line)
	}
	csrs, err := env.Workload.Client.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range csrs.Items {
		for _, cond := range c.Status.Conditions {
			if cond.Type == certificatesv1.CertificateApproved {
				say("The signer approved CSR %s (%s): %s", c.Name, cond.Reason, cond.Message)
				detail("requested by %s for signer %s", c.Spec.Username, c.Spec.SignerName)
			}
		}
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
