package trust

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"sigs.k8s.io/kubelet-authenticator/signer/periodic"
)

// LabelServingCA marks the ClusterTrustBundles the controller publishes
// (value "true"): the publisher removes those it no longer wants, and
// leaves every other bundle alone.
const LabelServingCA = "kubelet-authenticator.x-k8s.io/serving-ca"

// LabelOwner names, on a bundle the controller publishes, the Cluster it
// publishes it for (the Cluster's UID). Two Clusters whose kubeconfigs
// reach one workload cluster each keep their own bundles: neither removes
// a bundle the other owns.
const LabelOwner = "kubelet-authenticator.x-k8s.io/owner"

// ClusterTrustBundle API.
const (
	group    = "certificates.k8s.io"
	resource = "clustertrustbundles"
)

// versions are the ClusterTrustBundle versions the publisher writes,
// preferred first; their fields are the same.
func versions() []string { return []string{"v1", "v1beta1", "v1alpha1"} }

// ErrNoAPI reports a workload cluster that serves no ClusterTrustBundle API
// (before Kubernetes 1.37 it is off unless enabled).
var ErrNoAPI = errors.New("the workload cluster serves no ClusterTrustBundle API")

// BundleName returns the name of the ClusterTrustBundle of CA cert for
// signerName: `<signerName with / as :>:<fingerprint>`, the prefix
// kube-apiserver requires of a signer-linked bundle.
func BundleName(signerName string, cert *x509.Certificate) string {
	return strings.ReplaceAll(signerName, "/", ":") + ":" + CertFingerprint(cert)
}

// Publisher keeps a workload cluster's serving CAs published as
// signer-linked ClusterTrustBundles.
type Publisher struct {
	// Client and Discovery talk to the workload cluster as a user that may
	// manage ClusterTrustBundles and `attest` for the signer names.
	Client    dynamic.Interface
	Discovery discovery.DiscoveryInterface
	// SignerNames are the serving signer names the CAs are published for.
	SignerNames []string
	// Label marks (value "true") the bundles this publisher keeps and
	// removes; empty means LabelServingCA. Publishers of different CAs
	// (the serving CA, the pod CA) use different labels, so that neither
	// removes the other's bundles.
	Label string
	// Owner, when set, is written in each bundle's LabelOwner, and the
	// publisher removes or takes over only bundles of its own or of no
	// owner (published by a release before owners, or by standalone mode,
	// which serves one cluster): a bundle another owner published stays,
	// even one this publisher also wants (two Clusters sharing a CA), as
	// long as it holds what this publisher would write. Empty: no owner,
	// every labelled bundle is this publisher's.
	Owner string

	mu  sync.Mutex
	gvr schema.GroupVersionResource
}

// Publish makes the labelled bundles exactly one per signer name and
// certificate of cas: it creates the missing ones, corrects changed ones
// and deletes the others. It reports every failure.
func (p *Publisher) Publish(ctx context.Context, cas []*x509.Certificate) error {
	gvr, err := p.resource()
	if err != nil {
		return err
	}
	res := p.Client.Resource(gvr)
	label := p.Label
	if label == "" {
		label = LabelServingCA
	}
	labels := map[string]any{label: "true"}
	if p.Owner != "" {
		labels[LabelOwner] = p.Owner
	}
	want := map[string]*unstructured.Unstructured{}
	for _, signer := range p.SignerNames {
		for _, c := range cas {
			name := BundleName(signer, c)
			want[name] = &unstructured.Unstructured{Object: map[string]any{
				"apiVersion": gvr.GroupVersion().String(),
				"kind":       "ClusterTrustBundle",
				"metadata":   map[string]any{"name": name, "labels": maps.Clone(labels)},
				"spec":       map[string]any{"signerName": signer, "trustBundle": string(encodeCerts([]*x509.Certificate{c}))},
			}}
		}
	}
	list, err := res.List(ctx, metav1.ListOptions{LabelSelector: label + "=true"})
	if err != nil {
		return fmt.Errorf("unable to list ClusterTrustBundles: %w", err)
	}
	// New and changed bundles first, removals last: a consumer never
	// sees fewer CAs than it needs.
	var errs []error
	have := map[string]*unstructured.Unstructured{}
	for i := range list.Items {
		have[list.Items[i].GetName()] = &list.Items[i]
	}
	for _, name := range slices.Sorted(maps.Keys(want)) {
		w, o := want[name], have[name]
		var err error
		switch {
		case o == nil:
			_, err = res.Create(ctx, w, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				// There but not labelled as ours: the name is this CA's, take it over.
				if o, err = res.Get(ctx, name, metav1.GetOptions{}); err == nil {
					err = update(ctx, res, o, w)
				}
			}
		case !p.owns(o):
			// Another Cluster's, for the same CA: it stays its owner's;
			// only what it holds is made right.
			if !sameSpec(o, w) {
				w = w.DeepCopy()
				w.SetLabels(o.GetLabels())
				err = update(ctx, res, o, w)
			}
		case !sameSpec(o, w) || o.GetLabels()[LabelOwner] != p.Owner:
			err = update(ctx, res, o, w)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("unable to publish ClusterTrustBundle %s: %w", name, err))
		}
	}
	for _, name := range slices.Sorted(maps.Keys(have)) {
		if want[name] != nil || !p.owns(have[name]) {
			continue
		}
		uid := have[name].GetUID()
		if err := res.Delete(ctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}}); err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("unable to delete ClusterTrustBundle %s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

// owns reports whether the labelled bundle o is this publisher's to change
// and remove: its own, or of no owner.
func (p *Publisher) owns(o *unstructured.Unstructured) bool {
	owner := o.GetLabels()[LabelOwner]
	return owner == "" || owner == p.Owner
}

func update(ctx context.Context, res dynamic.ResourceInterface, have, want *unstructured.Unstructured) error {
	u := have.DeepCopy()
	u.Object["spec"] = want.Object["spec"]
	u.SetLabels(mergeLabels(u.GetLabels(), want.GetLabels()))
	_, err := res.Update(ctx, u, metav1.UpdateOptions{})
	return err
}

func sameSpec(have, want *unstructured.Unstructured) bool {
	for _, f := range []string{"signerName", "trustBundle"} {
		a, _, _ := unstructured.NestedString(have.Object, "spec", f)
		b, _, _ := unstructured.NestedString(want.Object, "spec", f)
		if a != b {
			return false
		}
	}
	return true
}

func mergeLabels(have, want map[string]string) map[string]string {
	out := maps.Clone(have)
	if out == nil {
		out = map[string]string{}
	}
	maps.Copy(out, want)
	return out
}

// resource discovers, once it succeeds, which ClusterTrustBundle version the
// workload cluster serves.
func (p *Publisher) resource() (schema.GroupVersionResource, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.gvr.Empty() {
		return p.gvr, nil
	}
	var errs []error
	notServed := 0
	for _, v := range versions() {
		gv := schema.GroupVersion{Group: group, Version: v}
		list, err := p.Discovery.ServerResourcesForGroupVersion(gv.String())
		if err != nil {
			if apierrors.IsNotFound(err) {
				notServed++
			} else {
				errs = append(errs, fmt.Errorf("%s: %w", gv, err))
			}
			continue
		}
		if slices.ContainsFunc(list.APIResources, func(r metav1.APIResource) bool { return r.Name == resource }) {
			p.gvr = gv.WithResource(resource)
			return p.gvr, nil
		}
		notServed++
	}
	if len(errs) == 0 {
		return schema.GroupVersionResource{}, fmt.Errorf("%w (tried %s in %s; enable the ClusterTrustBundle feature gate and API)", ErrNoAPI, strings.Join(versions(),
			", "), group)
	}
	return schema.GroupVersionResource{}, fmt.Errorf("unable to discover the ClusterTrustBundle API: %w", errors.Join(errs...))
}

// PublishTimeout bounds one publication, so that an unreachable cluster
// does not hold up its CSR controller long.
const PublishTimeout = 10 * time.Second

// Keep publishes cas, then again every period (repairing what someone
// else changed), sooner after a failure, until ctx is done; report (which
// may be nil) is told each outcome. first, when not nil, is closed after
// the first attempt, failed or not: a CSR controller starts then, so that
// a new CA signs only once it is published, while a cluster without the
// ClusterTrustBundle API still gets its certificates. It returns at once
// (the work runs on a timer, package periodic); the channel returned is
// closed when it has stopped.
func (p *Publisher) Keep(ctx context.Context, cas []*x509.Certificate, period time.Duration, first chan<- struct{}, report func(error)) <-chan struct{} {
	retry := time.Second
	return periodic.Start(ctx, func(ctx context.Context) (time.Duration, bool) {
		pctx, cancel := context.WithTimeout(ctx, PublishTimeout)
		err := p.Publish(pctx, cas)
		cancel()
		if ctx.Err() != nil {
			return 0, false
		}
		if report != nil {
			report(err)
		}
		if first != nil {
			close(first)
			first = nil
		}
		next := period
		if err != nil {
			next, retry = min(retry, period), min(2*retry, period)
		} else {
			retry = time.Second
		}
		return next, true
	}).Done()
}

// NewPublisher returns the publisher of a cluster's serving CAs for
// signerNames, talking to the cluster as cfg's user.
func NewPublisher(cfg *rest.Config, signerNames []string) (*Publisher, error) {
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &Publisher{Client: dyn, Discovery: dc, SignerNames: signerNames}, nil
}
