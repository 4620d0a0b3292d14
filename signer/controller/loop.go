// Package controller runs the signer for one workload cluster: it watches
// the CertificateSigningRequests of the signer names this controller serves
// (and no others: the watch is filtered by spec.signerName on the API
// server), hands each pending one to the decision engine (package engine),
// and applies the engine's decision with one writer (write.go).
//
// Bad requests are denied; transient problems (an API server that does not
// answer, a Machine not yet listed) are retried with backoff, and a request
// that stays undecidable for MaxTries tries is denied with its own reason.
// CSRs already approved by someone else, denied, failed or issued are never
// touched.
package controller

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
	certificatesv1 "k8s.io/api/certificates/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	certificatesv1client "k8s.io/client-go/kubernetes/typed/certificates/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
)

// Decisions, as reported to Metrics.
const (
	DecisionApproved   = "approved"
	DecisionDenied     = "denied"
	DecisionFailed     = "failed"
	DecisionChallenged = "challenged"
	DecisionRetried    = "retried"
)

// DefaultSweepPeriod is Config.SweepPeriod's default: a request to an
// attestor the Cluster does not authorize is denied within about that
// long (and a quarter more: each controller lists at its own phase). Each
// list is one request per signer name not watched, to each workload API
// server: at 5,000 Clusters and seven such signer names, about 120 a
// second for the controller, fewer than its probes of the same servers.
const DefaultSweepPeriod = 5 * time.Minute

// DefaultMaxTries is how many times a request is retried on transient
// errors before it is denied Undecidable (with the default backoff of
// 500ms doubling to 1m, about 15 minutes).
const DefaultMaxTries = 20

// Client is what the controller uses of a workload cluster's API: the
// CSRs. A kubernetes.Interface is one; a caller serving many clusters
// builds only this group's client per cluster (kubernetes.NewForConfig
// holds a REST client for each of about fifty groups).
type Client interface {
	CertificatesV1() certificatesv1client.CertificatesV1Interface
}

// Config configures a Controller.
type Config struct {
	// Cluster names the workload cluster in logs and metrics
	// ("<namespace>/<name>" of the Cluster object).
	Cluster string
	// Client talks to the workload cluster.
	Client Client
	// Engine configures the decision engine; its CSRs are the controller's
	// own listers.
	Engine engine.Config
	// Metrics, when set, records decisions.
	Metrics Metrics
	// Events, when set, is told of every approval, denial and failure
	// (Recorder).
	Events Recorder
	// Workers is the number of concurrent workers; 0 means 1.
	Workers int
	// ResyncPeriod queues every pending CSR again that often; 0 means 10
	// minutes.
	ResyncPeriod time.Duration
	// SweepPeriod is how often the CSRs of signer names no request can be
	// signed through (attestors the Cluster does not authorize, refused
	// ones) are listed, to be denied: they are not watched (sweep.go). 0
	// means DefaultSweepPeriod.
	SweepPeriod time.Duration
	// MinRetry and MaxRetry bound the backoff of retried CSRs; 0 means
	// 500ms and 1m.
	MinRetry, MaxRetry time.Duration
	// MaxTries bounds the tries of a request that keeps failing
	// transiently; 0 means DefaultMaxTries.
	MaxTries int
	// Issuing, when set, is told of every client certificate before it is
	// written to its request (revocation accepts the certificates of a new
	// Machine of a revoked node name), and of every denial of a node's
	// renewal before it is written (the pod signer holds the node's pod
	// certificates back); an error leaves the request to be retried, and
	// it is signed or denied anew.
	Issuing IssueHook
	// ListPageSize is the limit of each page when the CSRs are listed; 0
	// means client-go's reflector default for watched signer names, and
	// one unpaged list for the others.
	ListPageSize int64
	// MaxCachedCSRs and MaxCachedCSRBytes are the budget of CSRs cached
	// (bytes as cached); 0 means no bound. OverBudget is told, once, when
	// the cache reaches either (budget.go).
	MaxCachedCSRs     int
	MaxCachedCSRBytes int64
	OverBudget        func(objects int, bytes int64)
}

// IssueHook is told of a client certificate before it is handed out, and
// of what was verified before it was issued; and of a renewal before it is
// denied.
type IssueHook interface {
	Issuing(ctx context.Context, node string, m *engine.Machine, cert *x509.Certificate, att revoke.Attestation) error
	// Denying is told of request, a client certificate request filed with
	// node's own credential (requester system:node:<node>), before it is
	// denied for reason.
	Denying(ctx context.Context, node, request, reason string) error
}

// key names a CSR in the queue: its signer name tells which store holds
// it.
type key struct{ signer, name string }

// Controller signs one workload cluster's requests.
type Controller struct {
	cfg    Config
	engine *engine.Engine
	// stores hold the CSRs of each signer name; watched are filled by a
	// watch each, the others by a list every SweepPeriod (sweep.go).
	stores  map[string]*csrStore
	watched []string
	swept   []string
	queue   *retryQueue
	budget  *budget
	// patchUntil: until then (Unix nanoseconds; 0 for never) annotate
	// patches rather than updates, the workload cluster having refused
	// an update.
	patchUntil atomic.Int64
}

// now tells the engine's time.
func (c *Controller) now() time.Time {
	if c.cfg.Engine.Clock != nil {
		return c.cfg.Engine.Clock.Now()
	}
	return time.Now()
}

// New returns a Controller; call Run to start it.
func New(cfg Config) (*Controller, error) {
	if cfg.Client == nil {
		return nil, errors.New("controller needs a workload cluster client")
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 1
	}
	if cfg.ResyncPeriod <= 0 {
		cfg.ResyncPeriod = 10 * time.Minute
	}
	if cfg.SweepPeriod <= 0 {
		cfg.SweepPeriod = DefaultSweepPeriod
	}
	if cfg.MinRetry <= 0 {
		cfg.MinRetry = 500 * time.Millisecond
	}
	if cfg.MaxRetry <= 0 {
		cfg.MaxRetry = time.Minute
	}
	if cfg.MaxTries <= 0 {
		cfg.MaxTries = DefaultMaxTries
	}
	c := &Controller{
		cfg:    cfg,
		stores: map[string]*csrStore{},
		budget: &budget{maxObjects: cfg.MaxCachedCSRs, maxBytes: cfg.MaxCachedCSRBytes, over: cfg.OverBudget},
	}
	ecfg := cfg.Engine
	ecfg.Cluster = cfg.Cluster
	ecfg.CSRs = c
	e, err := engine.New(ecfg)
	if err != nil {
		return nil, err
	}
	c.engine = e
	c.queue = newRetryQueue(workqueue.NewTypedMaxOfRateLimiter(
		workqueue.NewTypedItemExponentialFailureRateLimiter[key](cfg.MinRetry, cfg.MaxRetry),
		&workqueue.TypedBucketRateLimiter[key]{Limiter: rate.NewLimiter(rate.Limit(20), 200)},
	))
	// A store per signer name, each filled with only the CSRs of its
	// signer name: other signers' CSRs are never sent to (or held by) this
	// controller.
	for _, p := range e.Profiles() {
		c.stores[p.SignerName] = newCSRStore(c.changed)
		if e.Served(p) {
			c.watched = append(c.watched, p.SignerName)
		} else {
			c.swept = append(c.swept, p.SignerName)
		}
	}
	return c, nil
}

// changed is told of every change to a store: the cache budget counts
// what is cached, and pending requests are queued.
func (c *Controller) changed(old, obj *certificatesv1.CertificateSigningRequest) {
	c.budget.changed(old, obj)
	if obj == nil {
		return
	}
	if old == nil && c.engine.Pending(obj) {
		c.seen(obj.Spec.SignerName)
	}
	c.enqueue(obj)
}

// forgetUnread drops what the controller never reads before a request is
// cached, so that whatever a requester writes on its request (as much as
// the API server lets it: 256 KiB of annotations, thousands of labels and
// finalizers, a 3 MiB spec.request) costs the controller no more than what
// the signer reads of it:
//
//   - of the metadata, only the name, UID, resourceVersion, creation and
//     deletion times and the annotations the signer reads
//     (attestor.RequestAnnotations), each value kept to at most
//     attestor.MaxAnnotationSize+1 bytes, enough for the checks to deny it
//     as too large; no labels, finalizers, owner references or managed
//     fields;
//   - a decided request's spec.request, and the part of a pending one's
//     beyond the largest the signer accepts (again enough to deny it as too
//     large).
//
// What stays (name, signer, requester, conditions, the certificate this
// controller issued, its own annotations) is what Pending, the pending
// bound and a later answer to a challenge are checked against. A cut is
// copied, so that no cached value keeps the decoded original alive.
func forgetUnread(obj any) (any, error) {
	csr, ok := obj.(*certificatesv1.CertificateSigningRequest)
	if !ok {
		return obj, nil
	}
	read := readAnnotations(csr.Annotations)
	if !metadataRead(csr, read) {
		// The cached copy is not the request's metadata: the signer's
		// writes patch (write.go).
		if read == nil {
			read = make(map[string]string, 1)
		}
		read[annotationMetadataCut] = "true"
	}
	csr.ObjectMeta = metav1.ObjectMeta{
		Name:              csr.Name,
		UID:               csr.UID,
		ResourceVersion:   csr.ResourceVersion,
		Generation:        csr.Generation,
		CreationTimestamp: csr.CreationTimestamp,
		DeletionTimestamp: csr.DeletionTimestamp,
		Annotations:       read,
	}
	switch {
	case engine.Decided(csr):
		csr.Spec.Request = nil
	case len(csr.Spec.Request) > attestor.MaxRequestSize:
		// More than the signer reads: kept only as far as needed to deny it
		// as too large, however many such requests wait in the queue.
		csr.Spec.Request = bytes.Clone(csr.Spec.Request[:attestor.MaxRequestSize+1])
	}
	return csr, nil
}

// annotationMetadataCut marks a cached request whose metadata held more
// than the cache keeps (labels, finalizers, owner references, a generated
// name, annotations the signer does not read or longer than it reads).
// The key is not a valid annotation name (it holds a space), so no stored
// object carries it and the signer never writes it: it lives only in the
// cache.
const annotationMetadataCut = "kubelet-authenticator.x-k8s.io/metadata cut"

// metadataRead reports whether read, the annotations the cache keeps of
// csr, and the cache's other fields are all of csr's metadata that an
// update can set: then an update built from the cached copy writes the
// request's metadata back as it is.
func metadataRead(csr *certificatesv1.CertificateSigningRequest, read map[string]string) bool {
	if len(csr.Labels) > 0 || len(csr.Finalizers) > 0 || len(csr.OwnerReferences) > 0 || csr.GenerateName != "" || len(read) != len(csr.Annotations) {
		return false
	}
	for k, v := range read {
		if csr.Annotations[k] != v {
			return false
		}
	}
	return true
}

// readAnnotations returns the annotations of in the signer reads, each cut
// to attestor.MaxAnnotationSize+1 bytes; nil when there are none.
func readAnnotations(in map[string]string) map[string]string {
	var out map[string]string
	for _, k := range attestor.RequestAnnotations() {
		v, ok := in[k]
		if !ok {
			continue
		}
		if len(v) > attestor.MaxAnnotationSize {
			v = strings.Clone(v[:attestor.MaxAnnotationSize+1])
		}
		if out == nil {
			out = make(map[string]string, 1)
		}
		out[k] = v
	}
	return out
}

// Get implements engine.CSRs from the stores.
func (c *Controller) Get(signerName, name string) (*certificatesv1.CertificateSigningRequest, error) {
	var csr *certificatesv1.CertificateSigningRequest
	if s, ok := c.stores[signerName]; ok {
		csr = s.cached(name)
	}
	if csr == nil || csr.Spec.SignerName != signerName {
		return nil, apierrors.NewNotFound(certificatesv1.Resource("certificatesigningrequests"), name)
	}
	return csr, nil
}

// Live implements engine.CSRs: the CSR as the API server holds it.
func (c *Controller) Live(ctx context.Context, signerName, name string) (*certificatesv1.CertificateSigningRequest, error) {
	csr, err := c.cfg.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	if csr.Spec.SignerName != signerName {
		return nil, apierrors.NewNotFound(certificatesv1.Resource("certificatesigningrequests"), name)
	}
	return csr, nil
}

// ByRequester implements engine.CSRs from the stores' indexes
// (csrStore.requesterKeys).
func (c *Controller) ByRequester(username string) ([]*certificatesv1.CertificateSigningRequest, error) {
	return c.byIndex(byRequester, username)
}

// Waiting implements engine.CSRs from the stores' indexes
// (csrStore.waitingKeys).
func (c *Controller) Waiting(username, nodeName string) ([]*certificatesv1.CertificateSigningRequest, error) {
	return c.byIndex(waiting, waitingKey(username, nodeName))
}

// byIndex returns the CSRs of every store under key of index.
func (c *Controller) byIndex(index, key string) ([]*certificatesv1.CertificateSigningRequest, error) {
	var out []*certificatesv1.CertificateSigningRequest
	for signer, s := range c.stores {
		objs, err := s.ByIndex(index, key)
		if err != nil {
			return nil, err
		}
		for _, o := range objs {
			if csr, ok := o.(*certificatesv1.CertificateSigningRequest); ok && csr.Spec.SignerName == signer {
				out = append(out, csr)
			}
		}
	}
	return out, nil
}

func (c *Controller) enqueue(obj any) {
	csr, ok := obj.(*certificatesv1.CertificateSigningRequest)
	if !ok || !c.engine.Pending(csr) {
		return
	}
	c.queue.Add(key{signer: csr.Spec.SignerName, name: csr.Name})
}

// Resync queues every pending CSR again, for when something the decision
// depends on changed (a Machine became ready).
func (c *Controller) Resync() {
	for _, s := range c.stores {
		for _, obj := range s.List() {
			c.enqueue(obj)
		}
	}
}

// QueueLen returns the number of CSRs waiting to be decided.
func (c *Controller) QueueLen() int { return c.queue.Len() }

// HasSynced reports whether the controller has listed the workload
// cluster's CSRs of the signer names it watches.
func (c *Controller) HasSynced() bool {
	for _, signer := range c.watched {
		if !c.stores[signer].HasSynced() {
			return false
		}
	}
	return true
}

// Run watches CSRs and decides them until ctx is done. Workers run only
// while there are requests to decide, and up to workerLinger after: an
// idle workload cluster costs the goroutine running Run and its watches'.
func (c *Controller) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("cluster", c.cfg.Cluster)
	ctx = klog.NewContext(ctx, logger)
	defer utilruntime.HandleCrash()
	defer c.queue.ShutDown()

	defer c.startCaches(ctx)()
	logger.Info("Waiting for the workload cluster's certificate signing requests")
	if !cache.WaitForCacheSync(ctx.Done(), c.HasSynced) {
		return ctx.Err()
	}
	logger.Info("Deciding certificate signing requests", "watched", c.watched, "listedEvery", c.cfg.SweepPeriod.String(), "listed", c.swept,
		"authorizedAttestors", c.cfg.Engine.Authorized)
	stop := context.AfterFunc(ctx, c.queue.ShutDown)
	defer stop()
	c.dispatch(ctx)
	return nil
}

// workerLinger is how long a worker waits for another request once it has
// decided one before it ends: during a burst each worker decides request
// after request on the stack it has grown (a fresh goroutine grows its
// stack anew through the TLS, HTTP/2 and crypto calls of each decision),
// and an idle workload cluster is left with none within this long.
const workerLinger = time.Second

// dispatch hands each queued request to a worker, at most Workers at a
// time, until the queue is shut down.
func (c *Controller) dispatch(ctx context.Context) {
	dispatch(c.queue, c.cfg.Workers, workerLinger, func(k key) {
		defer utilruntime.HandleCrash()
		c.process(ctx, k)
	})
}

// dispatch hands each key of q to an idle worker, or to a new one while
// fewer than workers run, until q is shut down. A worker decides keys
// until none comes within linger.
func dispatch(q interface{ Get() (key, bool) }, workers int, linger time.Duration, process func(key)) {
	slots := make(chan struct{}, workers)
	idle := make(chan key)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer close(idle)
	work := func(k key) {
		defer func() { <-slots }()
		t := time.NewTimer(linger)
		defer t.Stop()
		for {
			process(k)
			t.Reset(linger)
			var ok bool
			select {
			case k, ok = <-idle:
				if !ok {
					return
				}
			case <-t.C:
				return
			}
		}
	}
	for {
		k, quit := q.Get()
		if quit {
			return
		}
		select {
		case idle <- k:
			continue
		default:
		}
		select {
		case idle <- k:
		case slots <- struct{}{}:
			wg.Go(func() { work(k) })
		}
	}
}

// process decides the request k and queues it again as the decision asks.
func (c *Controller) process(ctx context.Context, k key) {
	defer c.queue.Done(k)
	logger := klog.FromContext(ctx).WithValues("csr", k.name)
	after, err := c.sync(klog.NewContext(ctx, logger), k)
	switch {
	case err != nil && apierrors.IsConflict(err):
		// The cache is behind our own last write: look again.
		logger.V(4).Info("Conflict, will look again", "err", err.Error())
		c.queue.AddRateLimited(k)
	case err != nil:
		c.metric(DecisionRetried, "")
		logger.Info("Not decided yet, will retry", "err", err.Error(), "tries", c.queue.NumRequeues(k)+1)
		c.queue.AddRateLimited(k)
	default:
		c.queue.Forget(k)
		if after > 0 {
			c.queue.AddAfter(k, after)
		}
	}
}

// sync decides one CSR and applies the decision. A returned error means
// "retry"; after > 0 means "look again then".
func (c *Controller) sync(ctx context.Context, k key) (after time.Duration, err error) {
	s, ok := c.stores[k.signer]
	if !ok {
		return 0, nil
	}
	csr := s.cached(k.name)
	if csr == nil || !c.engine.Pending(csr) {
		return 0, nil
	}
	d := c.engine.Decide(ctx, csr)
	if d.Outcome == engine.Retry && c.queue.NumRequeues(k)+1 >= c.cfg.MaxTries {
		d = engine.Undecidable(d, c.queue.NumRequeues(k)+1)
	}
	return c.apply(ctx, csr, d)
}

// Engine returns the engine that decides this workload cluster's
// requests: the pod certificate requests are decided by it too.
func (c *Controller) Engine() *engine.Engine { return c.engine }
