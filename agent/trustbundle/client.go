package trustbundle

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"sigs.k8s.io/kubelet-authenticator/agent/kube"
)

// clusterTrustBundle is the part of a ClusterTrustBundle a projection
// reads. metadata and spec.signerName, spec.trustBundle are the same in
// certificates.k8s.io v1, v1beta1 and v1alpha1, so one small local type
// decodes all three: the node needs neither k8s.io/api's typed versions nor
// a dynamic client.
type clusterTrustBundle struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              clusterTrustBundleSpec `json:"spec"`
}

type clusterTrustBundleSpec struct {
	SignerName  string `json:"signerName,omitempty"`
	TrustBundle string `json:"trustBundle"`
}

// DeepCopyObject implements runtime.Object.
func (o *clusterTrustBundle) DeepCopyObject() runtime.Object {
	c := *o
	o.ObjectMeta.DeepCopyInto(&c.ObjectMeta)
	return &c
}

type clusterTrustBundleList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []clusterTrustBundle `json:"items"`
}

// DeepCopyObject implements runtime.Object.
func (l *clusterTrustBundleList) DeepCopyObject() runtime.Object {
	c := *l
	l.ListMeta.DeepCopyInto(&c.ListMeta)
	c.Items = make([]clusterTrustBundle, len(l.Items))
	for i := range l.Items {
		c.Items[i] = *l.Items[i].DeepCopyObject().(*clusterTrustBundle)
	}
	return &c
}

// newClient returns a REST client for the ClusterTrustBundles of gv.
func newClient(cfg *rest.Config, gv schema.GroupVersion) (rest.Interface, error) {
	scheme := runtime.NewScheme()
	scheme.AddKnownTypeWithName(gv.WithKind("ClusterTrustBundle"), &clusterTrustBundle{})
	scheme.AddKnownTypeWithName(gv.WithKind("ClusterTrustBundleList"), &clusterTrustBundleList{})
	metav1.AddToGroupVersion(scheme, gv)
	metav1.AddToGroupVersion(scheme, schema.GroupVersion{Version: "v1"})
	return kube.RESTClientFor(cfg, scheme, gv)
}

// listWatch lists and watches the ClusterTrustBundles opts selects.
func listWatch(c rest.Interface, opts metav1.ListOptions) *cache.ListWatch {
	with := func(o metav1.ListOptions) *metav1.ListOptions {
		o.FieldSelector, o.LabelSelector = opts.FieldSelector, opts.LabelSelector
		return &o
	}
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			out := &clusterTrustBundleList{}
			err := c.Get().Resource(Resource).VersionedParams(with(o), metav1.ParameterCodec).Do(ctx).Into(out)
			return out, err
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.Watch = true
			return c.Get().Resource(Resource).VersionedParams(with(o), metav1.ParameterCodec).Watch(ctx)
		},
	}
}

// groupVersionEntry is one entry of an APIGroup's versions.
type groupVersionEntry struct {
	Version string `json:"version"`
}

// Discover returns the ClusterTrustBundle API version the server serves,
// preferring certificates.k8s.io/v1, then v1beta1, then v1alpha1. It reads
// the group (GET /apis/certificates.k8s.io) for the versions served and
// then the resource list of each candidate until one has
// clustertrustbundles: plain GETs decoded into small structs, no discovery
// client (which would link every API group's types into the node binary).
func Discover(ctx context.Context, cfg *rest.Config) (schema.GroupVersionResource, error) {
	c, err := kube.RESTClientFor(cfg, runtime.NewScheme(), schema.GroupVersion{Group: Group, Version: "v1"})
	if err != nil {
		return schema.GroupVersionResource{}, err
	}
	fail := func(err error) (schema.GroupVersionResource, error) {
		return schema.GroupVersionResource{}, fmt.Errorf("the API server serves no ClusterTrustBundle API (tried %s in %s): %w", strings.Join(versions(), ", "),
			Group, err)
	}
	var group struct {
		Versions []groupVersionEntry `json:"versions"`
	}
	raw, err := c.Get().AbsPath("/apis", Group).DoRaw(ctx)
	if err != nil {
		return fail(err)
	}
	if err := json.Unmarshal(raw, &group); err != nil {
		return fail(fmt.Errorf("unable to decode %s: %w", Group, err))
	}
	var errs []error
	for _, v := range versions() {
		if !slices.ContainsFunc(group.Versions, func(g groupVersionEntry) bool { return g.Version == v }) {
			continue
		}
		var list struct {
			Resources []struct {
				Name string `json:"name"`
			} `json:"resources"`
		}
		gv := schema.GroupVersion{Group: Group, Version: v}
		raw, err := c.Get().AbsPath("/apis", Group, v).DoRaw(ctx)
		if err == nil {
			err = json.Unmarshal(raw, &list)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", gv, err))
			continue
		}
		for _, r := range list.Resources {
			if r.Name == Resource {
				return gv.WithResource(Resource), nil
			}
		}
	}
	if len(errs) == 0 {
		errs = append(errs, errors.New("no served version lists "+Resource))
	}
	return fail(errors.Join(errs...))
}
