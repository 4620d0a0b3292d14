package bench

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// servingCA is one kubelet serving CA that every Cluster of a benchmark
// shares (shareServingCA).
type servingCA struct{ cert, key []byte }

func newServingCA(b *testing.B) servingCA {
	b.Helper()
	cert, key, err := issue.NewCA("benchmark kubelet serving CA", time.Now(), 2*365*24*time.Hour)
	if err != nil {
		b.Fatal(err)
	}
	return servingCA{cert: cert, key: key}
}

// shareServingCA gives the Cluster ns/name the benchmark's serving CA
// before the controller makes one of its own. The benchmarks point many
// Clusters at one workload API server, which no fleet does: each Cluster
// publishes its serving CA there as ClusterTrustBundles and removes the
// labelled bundles of other CAs, so Clusters with CAs of their own would
// keep replacing each other's bundles, and every publication would list
// them all. With one CA they publish the same bundles, as each Cluster of
// a fleet finds only its own on its own server.
func shareServingCA(b *testing.B, mgmt *harness.Management, ns, name string, ca servingCA) {
	b.Helper()
	sec := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name + capi.ServingCASecretSuffix},
		Type:       corev1.SecretTypeTLS,
		Data:       map[string][]byte{corev1.TLSCertKey: ca.cert, corev1.TLSPrivateKeyKey: ca.key},
	}
	if _, err := mgmt.ControlPlane.Client.CoreV1().Secrets(ns).Create(context.Background(), sec, metav1.CreateOptions{}); err != nil {
		b.Fatalf("unable to give Cluster %s/%s the shared serving CA: %v", ns, name, err)
	}
}
