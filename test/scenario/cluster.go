package scenario

import (
	"context"
	"testing"

	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// AnnotateCluster sets an annotation of the scenario's Cluster, as its
// owner would (a policy, the authorized attestors).
func (e *Env) AnnotateCluster(tb testing.TB, key, value string) {
	tb.Helper()
	ctx := context.Background()
	c := &clusterv1.Cluster{}
	if err := e.Mgmt.Client.Get(ctx, client.ObjectKey{Namespace: e.Namespace, Name: e.Cluster}, c); err != nil {
		tb.Fatal(err)
	}
	patch := client.MergeFrom(c.DeepCopy())
	if c.Annotations == nil {
		c.Annotations = map[string]string{}
	}
	c.Annotations[key] = value
	if err := e.Mgmt.Client.Patch(ctx, c, patch); err != nil {
		tb.Fatalf("unable to annotate Cluster %s/%s: %v", e.Namespace, e.Cluster, err)
	}
}
