package capi

import (
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrlcache "sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// CacheOptions returns the manager cache's transforms, so that what a
// tenant writes on its Clusters, Machines and infrastructure objects beyond
// what the signer reads costs the shared controller nothing: of every
// object, no managed fields; of a Cluster, only this project's annotations
// (kubelet-authenticator.x-k8s.io/*: the switch, and the deprecated
// policy annotations) and Cluster API's watch-filter label (--watch-filter);
// of a ClusterAttestation, its spec; of a Machine, only its cluster-name label (the Machines of a
// Cluster are listed by it) and its endorsement key pin; of an
// infrastructure object (cached as metadata only), only its endorsement key
// pin. No labels, finalizers or owner references otherwise: the matcher,
// revocation, the trust-on-first-use cleaner and the status reporter read
// none, and nothing writes these objects from the cache.
func CacheOptions() ctrlcache.Options {
	return ctrlcache.Options{
		DefaultTransform: StripObject,
		ByObject: map[client.Object]ctrlcache.ByObject{
			&clusterv1.Cluster{}:           {Transform: StripCluster},
			&clusterv1.Machine{}:           {Transform: StripMachine},
			&v1alpha1.ClusterAttestation{}: {Transform: StripClusterAttestation},
		},
	}
}

// keptMeta is the metadata every cached object keeps: who it is and its
// version.
func keptMeta(in *metav1.ObjectMeta) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name:              in.Name,
		Namespace:         in.Namespace,
		UID:               in.UID,
		ResourceVersion:   in.ResourceVersion,
		Generation:        in.Generation,
		CreationTimestamp: in.CreationTimestamp,
		DeletionTimestamp: in.DeletionTimestamp,
	}
}

// StripObject is the default transform: managed fields go from every
// object; an object cached as metadata only (an infrastructure object,
// withInfrastructure) keeps only its endorsement key pin.
func StripObject(obj any) (any, error) {
	if p, ok := obj.(*metav1.PartialObjectMetadata); ok {
		meta := keptMeta(&p.ObjectMeta)
		meta.Annotations = only(p.Annotations, func(k string) bool { return k == attestor.AnnotationEndorsementKey })
		p.ObjectMeta = meta
		return p, nil
	}
	return ctrlcache.TransformStripManagedFields()(obj)
}

// StripMachine keeps of a Machine's metadata its cluster-name label and its
// endorsement key pin; its spec and status are kept.
func StripMachine(obj any) (any, error) {
	m, ok := obj.(*clusterv1.Machine)
	if !ok {
		return obj, nil
	}
	meta := keptMeta(&m.ObjectMeta)
	meta.Labels = only(m.Labels, func(k string) bool { return k == clusterv1.ClusterNameLabel })
	meta.Annotations = only(m.Annotations, func(k string) bool { return k == attestor.AnnotationEndorsementKey })
	m.ObjectMeta = meta
	return m, nil
}

// StripCluster keeps of a Cluster's metadata this project's annotations and
// the cluster.x-k8s.io/watch-filter label.
func StripCluster(obj any) (any, error) {
	c, ok := obj.(*clusterv1.Cluster)
	if !ok {
		return obj, nil
	}
	meta := keptMeta(&c.ObjectMeta)
	meta.Annotations = only(c.Annotations, func(k string) bool { return strings.HasPrefix(k, AnnotationPolicyPrefix) })
	meta.Labels = only(c.Labels, func(k string) bool { return k == LabelWatchFilter })
	c.ObjectMeta = meta
	return c, nil
}

// StripClusterAttestation keeps of a ClusterAttestation who it is and its
// spec (the policy, bounded by its schema); the status, which the
// controller writes and reads live, is dropped.
func StripClusterAttestation(obj any) (any, error) {
	a, ok := obj.(*v1alpha1.ClusterAttestation)
	if !ok {
		return obj, nil
	}
	return &v1alpha1.ClusterAttestation{TypeMeta: a.TypeMeta, ObjectMeta: keptMeta(&a.ObjectMeta), Spec: a.Spec}, nil
}

// only returns the entries of in whose keys keep says to; nil when none.
func only(in map[string]string, keep func(string) bool) map[string]string {
	var out map[string]string
	for k, v := range in {
		if !keep(k) {
			continue
		}
		if out == nil {
			out = make(map[string]string, 1)
		}
		out[k] = v
	}
	return out
}
