package capi

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	certinformers "k8s.io/client-go/informers/certificates/v1beta1"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	certlisters "k8s.io/client-go/listers/certificates/v1beta1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
	"sigs.k8s.io/kubelet-authenticator/signer/trust"
)

// Pod certificates (docs/pod-certificates.md). A Cluster whose
// ClusterAttestation has spec.podCertificates has its own pod CA, kept
// like its serving CA (package trust) in `<cluster>-pod-ca` and published
// in the workload cluster as ClusterTrustBundles of the pod signer name,
// labelled LabelPodCA; the controller stamps each PodCertificateRequest's
// creator (podcert.AdmissionPolicy) and decides the requests of the pod
// signer name through the engine (engine.DecidePod).
const (
	PodCASecretSuffix = "-pod-ca"
	// PodCACommonName begins the pod CAs' subject common name.
	PodCACommonName = "pod-identity-ca"
	// LabelPodCA marks the pod CA's ClusterTrustBundles.
	LabelPodCA = "kubelet-authenticator.x-k8s.io/pod-ca"
	// podWorkers decide pod certificate requests in parallel.
	podWorkers = 2
)

// Pod certificate decisions, as PodMetrics counts them.
const (
	PodDecisionIssued  = "issued"
	PodDecisionDenied  = "denied"
	PodDecisionRetried = "retried"
)

// PodMetrics counts pod certificate decisions by workload cluster,
// decision (PodDecision*) and reason (the condition's; empty for a retry).
// The reconciler's Metrics implements it when it counts them (package app).
type PodMetrics interface {
	PodDecision(cluster, decision, reason string)
}

// podSigner decides one workload cluster's pod certificate requests.
type podSigner struct {
	// cluster is the Cluster served, namespace/name.
	cluster *clusterv1.Cluster
	events  record.EventRecorder // nil: no Events
	metrics PodMetrics           // nil: not counted
	cs      kubernetes.Interface
	engine  *engine.Engine
	policy  *podcert.Policy
	timing  podcert.Timing
	ca      atomic.Pointer[issue.CA]
	since   atomic.Pointer[time.Time]
	lister  certlisters.PodCertificateRequestLister
	queue   workqueue.TypedRateLimitingInterface[types.NamespacedName]
	logger  klog.Logger

	// record watches revocation's record (its entries), shards its
	// shards of the issued client certificates (revoke.ShardName), one
	// informer each; decoded[k] is the state of the record and shard k
	// last decoded.
	record  cache.SharedIndexInformer
	shards  []cache.SharedIndexInformer
	decoded [revoke.ShardCount]atomic.Pointer[decodedRecord]
}

// decodedRecord is the state of revocation's record and of one of its
// shards at their resourceVersions.
type decodedRecord struct {
	recordVersion, shardVersion string
	state                       *revoke.State
}

// keepPodCertificates serves pod certificates for cluster until ctx is
// done, when its policy turns them on: the admission policy that stamps
// the requests' creator, the pod CA (made, rotated, published), and the
// decisions of the pod signer's requests.
func (r *ClusterReconciler) keepPodCertificates(ctx context.Context, logger klog.Logger, cluster *clusterv1.Cluster, policy *podcert.Policy, cfg *rest.Config,
	eng *engine.Engine) {
	if policy == nil {
		return
	}
	// The informers below need a whole clientset; only Clusters serving pod
	// certificates hold one.
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		logger.Error(err, "Unable to serve pod certificates")
		return
	}
	pub, err := newPublisher(cfg, []string{podcert.DefaultSignerName}, cluster.UID)
	if err != nil {
		logger.Error(err, "Unable to serve pod certificates")
		return
	}
	pub.Label = LabelPodCA
	s := &podSigner{cluster: cluster, events: r.Events, cs: cs, engine: eng, policy: policy, timing: r.PodCertificateTiming, logger: logger,
		queue: workqueue.NewTypedRateLimitingQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[types.NamespacedName](
			cmp.Or(r.MinRetry, time.Second), cmp.Or(r.MaxRetry, 5*time.Minute)))}
	s.metrics, _ = r.Metrics.(PodMetrics)
	defer s.queue.ShutDown()
	ready := make(chan struct{})
	go r.keepPodCA(ctx, logger, cluster, cs, pub, s, ready)
	select {
	case <-ready: // the first CA signs once it is published
	case <-ctx.Done():
		return
	}
	inf := certinformers.NewFilteredPodCertificateRequestInformer(cs, metav1.NamespaceAll, 0, cache.Indexers{}, func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.signerName", podcert.DefaultSignerName).String()
	})
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    s.enqueue,
		UpdateFunc: func(_, obj any) { s.enqueue(obj) },
	}); err != nil {
		logger.Error(err, "Unable to watch pod certificate requests")
		return
	}
	s.lister = certlisters.NewPodCertificateRequestLister(inf.GetIndexer())
	// The record and its shards are read from watches (by name: the
	// workload role grants them by name), not once per decision; a
	// decision they cannot serve reads the ConfigMaps itself (issued).
	s.record = namedConfigMapInformer(cs, revoke.ConfigMapName)
	go s.record.Run(ctx.Done())
	for k := range revoke.ShardCount {
		inf := namedConfigMapInformer(cs, revoke.ShardName(k))
		s.shards = append(s.shards, inf)
		go inf.Run(ctx.Done())
	}
	go inf.Run(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return
	}
	logger.Info("Serving pod certificates", "signerName", podcert.DefaultSignerName, "trustDomain", policy.TrustDomain)
	for range podWorkers {
		go func() {
			for s.next(ctx) {
			}
		}()
	}
	<-ctx.Done()
}

// keepPodCA keeps the pod CA made, rotated and published (and the
// admission policy in place) until ctx is done; ready is closed once a CA
// is published for the first time.
func (r *ClusterReconciler) keepPodCA(ctx context.Context, logger klog.Logger, cluster *clusterv1.Cluster, cs kubernetes.Interface, pub *trust.Publisher,
	s *podSigner, ready chan struct{}) {
	store := &trust.Store{Client: r.Client, Reader: r.APIReader, Clock: r.Clock, Policy: r.ServingCA, Metrics: r.TrustMetrics}
	ref := trust.SecretRef{
		NamespacedName: types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name + PodCASecretSuffix},
		Cluster:        cluster.Namespace + "/" + cluster.Name,
		CommonName:     PodCACommonName,
		Labels:         map[string]string{clusterv1.ClusterNameLabel: cluster.Name},
		OwnerReferences: []metav1.OwnerReference{{
			APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: cluster.Name, UID: cluster.UID,
		}},
	}
	period := cmp.Or(r.RecheckPeriod, DefaultRecheckPeriod)
	retry := time.Second
	for {
		next, err := func() (time.Duration, error) {
			pctx, cancel := context.WithTimeout(ctx, trust.PublishTimeout)
			defer cancel()
			since, err := podcert.EnsureAdmissionPolicy(pctx, cs)
			if err == nil {
				s.since.Store(&since)
			}
			a, aerr := store.Ensure(pctx, ref)
			if aerr != nil {
				return 0, errors.Join(err, aerr)
			}
			if perr := pub.Publish(pctx, a.Trusted); perr != nil {
				return 0, errors.Join(err, perr)
			}
			s.ca.Store(a.Signing)
			if ready != nil && s.since.Load() != nil {
				close(ready)
				ready = nil
			}
			wait := period
			if !a.NextChange.IsZero() {
				wait = min(wait, max(time.Until(a.NextChange), time.Second))
			}
			return wait, err
		}()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			logger.Info("Pod CA or admission policy not written yet, will retry", "err", err.Error(), "in", retry)
			next, retry = min(retry, period), min(2*retry, period)
		} else {
			retry = time.Second
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(next):
		}
	}
}

func (s *podSigner) enqueue(obj any) {
	if pcr, ok := obj.(*certificatesv1beta1.PodCertificateRequest); ok && !engine.PodDecided(pcr) {
		s.queue.Add(types.NamespacedName{Namespace: pcr.Namespace, Name: pcr.Name})
	}
}

// namedConfigMapInformer watches the ConfigMap name next to revocation's
// record.
func namedConfigMapInformer(cs kubernetes.Interface, name string) cache.SharedIndexInformer {
	return coreinformers.NewFilteredConfigMapInformer(cs, revoke.Namespace, 0, cache.Indexers{}, func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
	})
}

// issued returns revocation's record of the client certificates issued
// for node: its entries and the certificates and denials of node's shard.
// It is the watched copy when that holds the certificate the request was
// made with, else the ConfigMaps read now (a node that just joined may be
// ahead of the watch; the watch may not be allowed or synced yet). It
// reads two ConfigMaps, each bounded by the API server's object size.
func (s *podSigner) issued(ctx context.Context, node, fingerprint string) (*revoke.State, error) {
	k := revoke.ShardOf(node)
	if st := s.watchedRecord(k); st != nil && slices.ContainsFunc(st.Issued, func(c revoke.Credential) bool {
		return c.SHA256 == fingerprint && c.Node == node
	}) {
		return st, nil
	}
	st, err := revoke.Read(ctx, s.cs.CoreV1(), node)
	if err != nil {
		return nil, fmt.Errorf("unable to read the issued client certificates: %w", err)
	}
	return st, nil
}

// watchedRecord returns the watched state of the record and shard k,
// decoded once per version, or nil when there is none.
func (s *podSigner) watchedRecord(k int) *revoke.State {
	if s.record == nil || len(s.shards) != revoke.ShardCount {
		return nil
	}
	cm := watchedConfigMap(s.record, revoke.ConfigMapName)
	if cm == nil {
		return nil
	}
	shard := watchedConfigMap(s.shards[k], revoke.ShardName(k))
	shardVersion := ""
	if shard != nil {
		shardVersion = shard.ResourceVersion
	}
	if d := s.decoded[k].Load(); d != nil && d.recordVersion == cm.ResourceVersion && d.shardVersion == shardVersion {
		return d.state
	}
	var (
		st  *revoke.State
		err error
	)
	if shard != nil {
		st, err = revoke.Decode(cm, shard)
	} else {
		st, err = revoke.Decode(cm)
	}
	if err != nil {
		return nil // read again, and reported, by issued
	}
	s.decoded[k].Store(&decodedRecord{recordVersion: cm.ResourceVersion, shardVersion: shardVersion, state: st})
	return st
}

// watchedConfigMap returns the ConfigMap name inf holds, or nil.
func watchedConfigMap(inf cache.SharedIndexInformer, name string) *corev1.ConfigMap {
	obj, ok, err := inf.GetStore().GetByKey(revoke.Namespace + "/" + name)
	cm, isCM := obj.(*corev1.ConfigMap)
	if err != nil || !ok || !isCM {
		return nil
	}
	return cm
}

// next decides and writes one request; false once the queue is shut down.
func (s *podSigner) next(ctx context.Context) bool {
	k, quit := s.queue.Get()
	if quit {
		return false
	}
	defer s.queue.Done(k)
	pcr, err := s.lister.PodCertificateRequests(k.Namespace).Get(k.Name)
	if apierrors.IsNotFound(err) {
		s.queue.Forget(k)
		return true
	}
	if err != nil {
		s.queue.AddRateLimited(k)
		return true
	}
	dctx, cancel := context.WithTimeout(ctx, trust.PublishTimeout)
	defer cancel()
	d := s.engine.DecidePod(dctx, pcr, &engine.PodSigner{SignerName: podcert.DefaultSignerName, Policy: s.policy, CA: s.ca.Load(),
		StampedSince: *s.since.Load(), Issued: s.issued, Timing: s.timing})
	logger := s.logger.WithValues("podCertificateRequest", klog.KObj(pcr), "node", pcr.Spec.NodeName)
	switch d.Outcome {
	case engine.Skip:
		s.queue.Forget(k)
		return true
	case engine.Retry:
		logger.Info("Pod certificate request not decided yet, will retry", "err", d.Err.Error())
		s.count(PodDecisionRetried, "")
		s.queue.AddRateLimited(k)
		return true
	}
	err = s.write(dctx, pcr, d)
	switch {
	case err == nil:
		s.queue.Forget(k)
		logger.Info("Decided a pod certificate request", "outcome", d.Outcome, "reason", d.Reason, "message", d.Message)
		s.decided(pcr, d)
	case apierrors.IsNotFound(err):
		s.queue.Forget(k)
	default:
		logger.Info("Unable to write a pod certificate request's status, will retry", "err", err.Error())
		s.queue.AddRateLimited(k)
	}
	return true
}

func (s *podSigner) count(decision, reason string) {
	if s.metrics != nil {
		s.metrics.PodDecision(s.cluster.Namespace+"/"+s.cluster.Name, decision, reason)
	}
}

// decided counts decision d, written on pcr, and records a denial as a
// Warning Event in the management cluster, on the Machine of the node that
// asked, or on the Cluster when the request matched none. Issued
// certificates are not Events: kubelet asks again for every pod at half
// of each certificate's lifetime.
func (s *podSigner) decided(pcr *certificatesv1beta1.PodCertificateRequest, d *engine.Decision) {
	if d.Outcome == engine.Approve {
		s.count(PodDecisionIssued, d.Reason)
		return
	}
	s.count(PodDecisionDenied, d.Reason)
	if s.events == nil {
		return
	}
	ref := &corev1.ObjectReference{APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster",
		Namespace: s.cluster.Namespace, Name: s.cluster.Name, UID: s.cluster.UID}
	if m := d.Machine; m != nil && m.Name != "" {
		ref = &corev1.ObjectReference{APIVersion: clusterv1.GroupVersion.String(), Kind: "Machine",
			Namespace: m.Namespace, Name: m.Name, UID: m.UID}
	}
	s.events.Eventf(ref, corev1.EventTypeWarning, d.Reason, "PodCertificateRequest %s/%s of node %s in workload cluster %s/%s denied: %s",
		pcr.Namespace, pcr.Name, pcr.Spec.NodeName, s.cluster.Namespace, s.cluster.Name, d.Message)
}

// write writes decision d (Approve or Deny) on pcr's status subresource.
func (s *podSigner) write(ctx context.Context, pcr *certificatesv1beta1.PodCertificateRequest, d *engine.Decision) error {
	pcr = pcr.DeepCopy()
	cond := metav1.Condition{Status: metav1.ConditionTrue, Reason: d.Reason, Message: d.Message,
		LastTransitionTime: metav1.Now(), ObservedGeneration: pcr.Generation}
	switch d.Outcome {
	case engine.Approve:
		c := d.PodCertificate
		cond.Type = certificatesv1beta1.PodCertificateRequestConditionTypeIssued
		pcr.Status.CertificateChain = c.CertificateChain
		pcr.Status.NotBefore = &metav1.Time{Time: c.NotBefore}
		pcr.Status.BeginRefreshAt = &metav1.Time{Time: c.BeginRefreshAt}
		pcr.Status.NotAfter = &metav1.Time{Time: c.NotAfter}
	case engine.Deny:
		cond.Type = certificatesv1beta1.PodCertificateRequestConditionTypeDenied
	default:
		return fmt.Errorf("outcome %s is not written", d.Outcome)
	}
	pcr.Status.Conditions = append(pcr.Status.Conditions, cond)
	_, err := s.cs.CertificatesV1beta1().PodCertificateRequests(pcr.Namespace).UpdateStatus(ctx, pcr, metav1.UpdateOptions{FieldManager: revoke.FieldManager})
	return err
}
