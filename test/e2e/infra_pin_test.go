//go:build tpmsimulator

package e2e

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// TestTPMInfrastructurePin: the endorsement key an infrastructure provider
// pins on its machine object decides, read by the real controller through
// the management cluster's own discovery. A TPM whose manufacturer nobody
// trusts joins once its DockerMachine pins its EK; a trusted TPM is denied
// when its DockerMachine pins another. A Machine whose infrastructure kind
// the management cluster does not serve (its reference is the tenant's to
// write) joins on its EK certificate, and asking for that kind first
// changes nothing for the kind that is served.
func TestTPMInfrastructurePin(t *testing.T) {
	caDir, _ := manufacturerCA(t, "Trusted TPM Maker")
	rogueDir, _ := manufacturerCA(t, "Rogue TPM Maker")
	env := scenario.Start(t, scenario.Options{Attestors: "tpm", ControllerArgs: tpmSignerArgs(filepath.Join(caDir, tpmtest.BundleFile), time.Minute)})
	// Served before the first decision: every Machine below has its
	// DockerMachine, as a provider keeps them.
	env.Mgmt.ServeInfrastructure(t, env.Namespace)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dyn, err := dynamic.NewForConfig(env.Mgmt.AdminConfig)
	if err != nil {
		t.Fatal(err)
	}
	node := func(name string, seed int64, dir string) *scenario.Node {
		n := env.NewNode(t, name, "test:///fleet/"+name, "tpm", simulatorConfig(seed, dir))
		env.Machine(t, n)
		return n
	}
	// ekOf is the EK a node's first CSR carries (base64 DER, the pin's form).
	ekOf := func(name string) string {
		t.Helper()
		for _, c := range nodeCSRs(t, env, name) {
			if ek := c.Annotations[attestor.AnnotationEndorsementKey]; ek != "" {
				return ek
			}
		}
		t.Fatalf("no CSR of %s carries %s", name, attestor.AnnotationEndorsementKey)
		return ""
	}
	pin := func(machine, ek string) {
		t.Helper()
		dm := dyn.Resource(harness.DockerMachines).Namespace(env.Namespace)
		u, err := dm.Get(ctx, machine, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		a := u.GetAnnotations()
		if a == nil {
			a = map[string]string{}
		}
		a[attestor.AnnotationEndorsementKey] = ek
		u.SetAnnotations(a)
		if _, err := dm.Update(ctx, u, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// A Machine whose infrastructureRef names a kind nobody serves.
	unserved := node("tpm-unserved", 31, caDir)
	var m clusterv1.Machine
	key := types.NamespacedName{Namespace: env.Namespace, Name: "machine-" + unserved.Name}
	if err := env.Mgmt.Client.Get(ctx, key, &m); err != nil {
		t.Fatal(err)
	}
	m.Spec.InfrastructureRef.Kind = "NoSuchMachine"
	if err := env.Mgmt.Client.Update(ctx, &m); err != nil {
		t.Fatal(err)
	}
	whoami(ctx, t, env, unserved)

	// Trusted TPM, no pin: joins on its EK certificate.
	trusted := node("tpm-trusted", 32, caDir)
	whoami(ctx, t, env, trusted)

	// A rogue manufacturer's TPM: denied, then pinned by its
	// infrastructure, which alone decides.
	rogue := node("tpm-rogue", 33, rogueDir)
	if r := rogue.Credential(ctx); r.Err == nil || !strings.Contains(r.Stderr, tpm.ReasonUntrustedEKCertificate) {
		t.Fatalf("untrusted TPM without a pin: %v\n%s", r.Err, r.Stderr)
	}
	pin("machine-"+rogue.Name, ekOf(rogue.Name))
	whoami(ctx, t, env, rogue)

	// A trusted TPM whose infrastructure pins another EK (the trusted
	// node's): denied, though its EK certificate chains.
	pinned := node("tpm-pinned", 34, caDir)
	pin("machine-"+pinned.Name, ekOf(trusted.Name))
	r := pinned.Credential(ctx)
	if r.Err == nil || !strings.Contains(r.Stderr, tpm.ReasonEKMismatch) {
		t.Fatalf("a TPM whose infrastructure pins another EK: %v\n%s", r.Err, r.Stderr)
	}
	csrs := nodeCSRs(t, env, pinned.Name)
	if len(csrs) != 1 {
		t.Fatalf("%d CSRs of %s, want 1", len(csrs), pinned.Name)
	}
	wantDenied(t, env, csrs[0].Name, tpm.ReasonEKMismatch)
}
