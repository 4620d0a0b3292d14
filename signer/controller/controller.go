// Package controller is the signer's loop for one workload cluster: it
// watches the cluster's CertificateSigningRequests, and for each one filed to
// one of this project's kubelet client signer names runs the structural
// checks, matches the node to its Machine, verifies the evidence with the
// provider's verifier, and then approves and signs it or denies it with a
// reason a person can act on.
//
// Bad requests are denied; transient problems (an API server that does not
// answer, a Machine not yet listed or not yet bootstrapped) are retried with
// backoff and never turned into a denial. CSRs of other signers, and CSRs
// already approved by someone else, denied, failed or issued, are never
// touched.
package controller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"golang.org/x/time/rate"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	certlisters "k8s.io/client-go/listers/certificates/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// Reasons of the controller's own decisions (the structural ones are in
// package checks, the Machine ones come from the MachineMatcher, the
// evidence ones from the verifier).
const (
	// ReasonAttestationVerified is the reason of every approval.
	ReasonAttestationVerified = "AttestationVerified"
	// ReasonAttestorNotAuthorized: the Cluster does not list the request's
	// provider among its authorized attestors.
	ReasonAttestorNotAuthorized = "AttestorNotAuthorized"
	// ReasonUnsupportedEvidenceVersion: the verifier does not accept the
	// evidence version; the supported-versions annotation says which it does.
	ReasonUnsupportedEvidenceVersion = "UnsupportedEvidenceVersion"
	// ReasonAttestedProviderIDMismatch: the evidence proves another provider
	// ID than the CSR extension and the Machine carry.
	ReasonAttestedProviderIDMismatch = "AttestedProviderIDMismatch"
	// ReasonIdentityMismatch: the evidence proves another stable identity
	// than the one the Machine (or allowlist entry) is pinned to.
	ReasonIdentityMismatch = "IdentityMismatch"
	// ReasonSigningFailed: an approved request could not be signed and will
	// not be (its Machine went away between approval and signing).
	ReasonSigningFailed = "SigningFailed"
)

// Decisions, as reported to Metrics.
const (
	DecisionApproved   = "approved"
	DecisionDenied     = "denied"
	DecisionFailed     = "failed"
	DecisionChallenged = "challenged"
	DecisionRetried    = "retried"
)

// Machine is the Cluster API Machine a CSR was matched to.
type Machine struct {
	Namespace, Name string
	// UID is the Machine's UID: trust-on-first-use records are owned by it.
	UID types.UID
	// ProviderID is the Machine's spec.providerID.
	ProviderID string
	// Annotations are the Machine's (and, where read, its infrastructure
	// object's) annotations, handed to the verifier.
	Annotations map[string]string
	// Identity, when set, pins the attested stable identity: evidence that
	// proves another one is denied (standalone allowlist entries).
	Identity string
}

// Handler decides the CSRs of a signer name the controller does not decide
// itself (serving certificates). Sync is called for every pending CSR of
// that signer name; a returned error means "retry".
type Handler interface {
	Sync(ctx context.Context, csr *certificatesv1.CertificateSigningRequest) error
}

// MachineMatcher finds the Machine a node name and provider ID belong to.
// A request that no Machine accounts for is reported as a *checks.Failure
// (the CSR is denied with its reason); any other error is transient (the
// CSR is retried).
type MachineMatcher interface {
	MatchMachine(ctx context.Context, nodeName, providerID string) (*Machine, error)
}

// CertificateSigner signs an approved request; *issue.Signer is one.
type CertificateSigner interface {
	Sign(req *issue.Request) ([]byte, error)
}

// Metrics records decisions. Implementations must be safe for concurrent
// use. An implementation may also implement SeenMetrics, SignedMetrics and
// VerificationMetrics (observe.go).
type Metrics interface {
	Decision(cluster, decision, reason string)
}

// Config configures a Controller.
type Config struct {
	// Cluster names the workload cluster in logs and metrics
	// ("<namespace>/<name>" of the Cluster object).
	Cluster string
	// Client talks to the workload cluster.
	Client kubernetes.Interface
	// Verifiers maps provider names to their verifier halves. The controller
	// serves the client signer name of each, and skips every other.
	Verifiers map[string]attestor.Verifier
	// Authorized lists the providers the Cluster authorizes; a request for
	// another provider is denied.
	Authorized []string
	// Machines matches requests to Machines.
	Machines MachineMatcher
	// Signer signs approved requests.
	Signer CertificateSigner
	// Metrics, when set, records decisions.
	Metrics Metrics
	// Events, when set, records every approval, denial and failure (an
	// Event on the Machine).
	Events Recorder
	// Identities, when set, applies trust on first use to the stable
	// identities verifiers prove.
	Identities IdentityBinder
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Handlers decide the CSRs of further signer names, by signer name.
	Handlers map[string]Handler
	// Workers is the number of concurrent workers; 0 means 1.
	Workers int
	// ResyncPeriod re-lists pending CSRs that often; 0 means 10 minutes.
	ResyncPeriod time.Duration
	// MinRetry and MaxRetry bound the backoff of retried CSRs; 0 means
	// 500ms and 1m.
	MinRetry, MaxRetry time.Duration
}

// Controller signs one workload cluster's kubelet client CSRs.
type Controller struct {
	cfg      Config
	signers  map[string]string // signer name → provider
	factory  informers.SharedInformerFactory
	informer cache.SharedIndexInformer
	lister   certlisters.CertificateSigningRequestLister
	queue    workqueue.TypedRateLimitingInterface[string]
}

// New returns a Controller; call Run to start it.
func New(cfg Config) (*Controller, error) {
	var errs []error
	if cfg.Client == nil {
		errs = append(errs, errors.New("controller needs a workload cluster client"))
	}
	if len(cfg.Verifiers) == 0 {
		errs = append(errs, errors.New("controller needs at least one verifier"))
	}
	if cfg.Machines == nil {
		errs = append(errs, errors.New("controller needs a Machine matcher"))
	}
	if cfg.Signer == nil {
		errs = append(errs, errors.New("controller needs a certificate signer"))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 1
	}
	if cfg.ResyncPeriod <= 0 {
		cfg.ResyncPeriod = 10 * time.Minute
	}
	if cfg.MinRetry <= 0 {
		cfg.MinRetry = 500 * time.Millisecond
	}
	if cfg.MaxRetry <= 0 {
		cfg.MaxRetry = time.Minute
	}
	c := &Controller{cfg: cfg, signers: map[string]string{}}
	for p := range cfg.Verifiers {
		c.signers[attestor.ClientSignerName(p)] = p
	}
	c.factory = informers.NewSharedInformerFactory(cfg.Client, cfg.ResyncPeriod)
	csrs := c.factory.Certificates().V1().CertificateSigningRequests()
	c.informer = csrs.Informer()
	c.lister = csrs.Lister()
	c.queue = workqueue.NewTypedRateLimitingQueue(workqueue.NewTypedMaxOfRateLimiter(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](cfg.MinRetry, cfg.MaxRetry),
		&workqueue.TypedBucketRateLimiter[string]{Limiter: rate.NewLimiter(rate.Limit(20), 200)},
	))
	if _, err := c.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if csr, ok := obj.(*certificatesv1.CertificateSigningRequest); ok && c.pending(csr) {
				c.seen(csr.Spec.SignerName)
			}
			c.enqueue(obj)
		},
		UpdateFunc: func(_, obj any) { c.enqueue(obj) },
	}); err != nil {
		return nil, fmt.Errorf("unable to watch certificate signing requests: %w", err)
	}
	return c, nil
}

func (c *Controller) enqueue(obj any) {
	csr, ok := obj.(*certificatesv1.CertificateSigningRequest)
	if !ok || !c.pending(csr) {
		return
	}
	c.queue.Add(csr.Name)
}

// pending reports whether csr is one of ours that still needs work.
func (c *Controller) pending(csr *certificatesv1.CertificateSigningRequest) bool {
	_, ours := c.signers[csr.Spec.SignerName]
	_, handled := c.cfg.Handlers[csr.Spec.SignerName]
	if !ours && !handled {
		return false
	}
	return len(csr.Status.Certificate) == 0 && !hasCondition(csr, certificatesv1.CertificateDenied) && !hasCondition(csr, certificatesv1.CertificateFailed)
}

// Resync queues every pending CSR again, for when something the decision
// depends on changed (a Machine became ready).
func (c *Controller) Resync() {
	for _, obj := range c.informer.GetStore().List() {
		c.enqueue(obj)
	}
}

// QueueLen returns the number of CSRs waiting to be decided.
func (c *Controller) QueueLen() int { return c.queue.Len() }

// HasSynced reports whether the controller has listed the workload
// cluster's CSRs.
func (c *Controller) HasSynced() bool { return c.informer.HasSynced() }

// Run watches CSRs and decides them until ctx is done.
func (c *Controller) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("cluster", c.cfg.Cluster)
	ctx = klog.NewContext(ctx, logger)
	defer utilruntime.HandleCrash()
	defer c.queue.ShutDown()

	c.factory.Start(ctx.Done())
	defer c.factory.Shutdown()
	logger.Info("Waiting for the workload cluster's certificate signing requests")
	if !cache.WaitForCacheSync(ctx.Done(), c.informer.HasSynced) {
		return ctx.Err()
	}
	logger.Info("Signing kubelet client certificates", "signers", slices.Sorted(maps.Keys(c.signers)), "authorizedAttestors", c.cfg.Authorized)
	for range c.cfg.Workers {
		go wait.UntilWithContext(ctx, c.worker, time.Second)
	}
	<-ctx.Done()
	return nil
}

func (c *Controller) worker(ctx context.Context) {
	for c.processNext(ctx) {
	}
}

func (c *Controller) processNext(ctx context.Context) bool {
	name, quit := c.queue.Get()
	if quit {
		return false
	}
	defer c.queue.Done(name)
	logger := klog.FromContext(ctx).WithValues("csr", name)
	if err := c.sync(klog.NewContext(ctx, logger), name); err != nil {
		if apierrors.IsConflict(err) {
			// The cache is behind our own last write: look again.
			logger.V(4).Info("Conflict, will look again", "err", err.Error())
			c.queue.AddRateLimited(name)
			return true
		}
		c.metric(DecisionRetried, "")
		logger.Info("Not decided yet, will retry", "err", err.Error(), "retries", c.queue.NumRequeues(name))
		c.queue.AddRateLimited(name)
		return true
	}
	c.queue.Forget(name)
	return true
}

func (c *Controller) metric(decision, reason string) {
	if c.cfg.Metrics != nil {
		c.cfg.Metrics.Decision(c.cfg.Cluster, decision, reason)
	}
}

// decision is the outcome of deciding a CSR that is not retried.
type decision struct {
	// deny, when set, is the reason to deny; message says why.
	deny, message string
	// challenge is set when the verifier asked for a second round.
	challenge []byte
	// answers names the CSR whose challenge this one answered: it is
	// denied (ChallengeAnswered) before this one is approved.
	answers string
	// approve holds what to sign.
	checked *checks.Checked
	machine *Machine
	// updated, when set, is the CSR as the controller last wrote it.
	updated *certificatesv1.CertificateSigningRequest
}

// sync decides one CSR. A returned error means "retry".
func (c *Controller) sync(ctx context.Context, name string) error {
	logger := klog.FromContext(ctx)
	csr, err := c.lister.Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if !c.pending(csr) {
		return nil
	}
	if h, ok := c.cfg.Handlers[csr.Spec.SignerName]; ok {
		return h.Sync(ctx, csr)
	}
	approved := findCondition(csr, certificatesv1.CertificateApproved)
	if approved != nil && approved.Reason == ReasonAttestationVerified {
		// Approved by us but not yet issued, as the cache sees it. Usually
		// the cache lags behind our own signing a moment ago: read the live
		// object before signing again.
		live, err := c.cfg.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		if !c.pending(live) {
			return nil
		}
		csr = live
	}
	if approved != nil && approved.Reason != ReasonAttestationVerified {
		// Approved by someone else: not attested, so not signed by us.
		logger.V(2).Info("Skipping a request approved by someone else", "reason", approved.Reason)
		return nil
	}

	if ch, ok := csr.Annotations[attestor.AnnotationChallenge]; ok && approved == nil {
		if handled, err := c.challenged(ctx, csr, ch); handled {
			return err
		}
	}

	d, err := c.decide(ctx, csr)
	if err != nil {
		return err
	}
	if d.updated != nil {
		csr = d.updated
	}
	ctx = withMachine(ctx, d.machine)
	switch {
	case d.deny != "" && approved != nil:
		// Approved, then the Machine went away (or similar) before it was
		// signed: an approved request cannot be denied, so it fails.
		return c.fail(ctx, csr, d.machine, d.deny+": "+d.message)
	case d.deny != "":
		return c.denyCSR(ctx, csr, d.machine, d.deny, d.message)
	case d.challenge != nil:
		return c.writeChallenge(ctx, csr, d.challenge)
	}
	if approved == nil {
		if d.answers != "" {
			if err := c.consumeChallenge(ctx, d.answers, csr.Name); err != nil {
				return err
			}
		}
		if csr, err = c.approve(ctx, csr, d); err != nil {
			return err
		}
	}
	return c.sign(ctx, csr, d)
}

// decide runs every check. It returns an error only for transient problems.
func (c *Controller) decide(ctx context.Context, csr *certificatesv1.CertificateSigningRequest) (*decision, error) {
	provider := c.signers[csr.Spec.SignerName]
	checked, err := checks.Check(csr)
	fails := []error{err}
	if !slices.Contains(c.cfg.Authorized, provider) {
		fails = append(fails, &checks.Failure{
			Reason:  ReasonAttestorNotAuthorized,
			Message: fmt.Sprintf("the Cluster does not authorize attestor %q (authorized: %q); add it to its %s annotation or attest with an authorized one", provider, c.cfg.Authorized, "kubelet-authenticator.x-k8s.io/authorized-attestors"),
		})
	}
	if reason, msg, ok := checks.Denial(errors.Join(fails...)); ok {
		return &decision{deny: reason, message: msg}, nil
	}
	if err != nil {
		return nil, err // not a failure: cannot happen, but never deny on it
	}

	verifier := c.cfg.Verifiers[provider]
	if !slices.Contains(verifier.Versions(), checked.Request.Version) {
		supported := strings.Join(verifier.Versions(), ",")
		updated, err := c.annotate(ctx, csr, attestor.AnnotationSupportedVersions, supported)
		if err != nil {
			return nil, err
		}
		return &decision{deny: ReasonUnsupportedEvidenceVersion, updated: updated, message: fmt.Sprintf("evidence version %q is not accepted by attestor %q; file a new request with one of %s", checked.Request.Version, provider, supported)}, nil
	}

	machine, err := c.cfg.Machines.MatchMachine(ctx, checked.NodeName, checked.ProviderID)
	if err != nil {
		if reason, msg, ok := checks.Denial(err); ok {
			return &decision{deny: reason, message: msg}, nil
		}
		return nil, fmt.Errorf("unable to match node %q (provider ID %q) to a Machine: %w", checked.NodeName, checked.ProviderID, err)
	}

	verifyStart := time.Now()
	res, err := verifier.Verify(ctx, &attestor.VerifyRequest{
		Evidence:           checked.Request.Evidence,
		Version:            checked.Request.Version,
		Binding:            checked.Binding,
		CSR:                checked.Request.CSR,
		NodeName:           checked.NodeName,
		ProviderID:         checked.ProviderID,
		CSRName:            csr.Name,
		CSRUID:             string(csr.UID),
		Username:           csr.Spec.Username,
		Annotations:        csr.Annotations,
		MachineAnnotations: machine.Annotations,
		Approved:           hasCondition(csr, certificatesv1.CertificateApproved),
		LookupCSR:          c.lookupCSR,
	})
	if err != nil {
		if d, ok := attestor.AsDenial(err); ok {
			c.verified(provider, VerifyResultDenied, verifyStart)
			return &decision{deny: d.Reason, message: d.Message, machine: machine}, nil
		}
		c.verified(provider, VerifyResultError, verifyStart)
		return nil, fmt.Errorf("attestor %q could not verify the evidence: %w", provider, err)
	}
	switch {
	case res == nil || (res.Identity == nil && res.Challenge == nil):
		c.verified(provider, VerifyResultError, verifyStart)
		return nil, fmt.Errorf("attestor %q returned neither an identity nor a challenge", provider)
	case res.Identity == nil:
		c.verified(provider, VerifyResultChallenged, verifyStart)
		return &decision{challenge: res.Challenge, machine: machine}, nil
	}
	c.verified(provider, VerifyResultVerified, verifyStart)
	if got := res.Identity.ProviderID; got != checked.ProviderID || got != machine.ProviderID {
		return &decision{machine: machine, deny: ReasonAttestedProviderIDMismatch, message: fmt.Sprintf(
			"attestor %q proves provider ID %q, but the request claims %q and Machine %s/%s has %q",
			provider, got, checked.ProviderID, machine.Namespace, machine.Name, machine.ProviderID)}, nil
	}
	if machine.Identity != "" && res.Identity.Stable != machine.Identity {
		return &decision{machine: machine, deny: ReasonIdentityMismatch, message: fmt.Sprintf(
			"attestor %q proves identity %q, but %s/%s is pinned to %q; update the pin if the node was replaced",
			provider, res.Identity.Stable, machine.Namespace, machine.Name, machine.Identity)}, nil
	}
	if res.Identity.Stable != "" && c.cfg.Identities != nil && machine.Identity == "" {
		if err := c.cfg.Identities.Bind(ctx, machine, res.Identity.Stable); err != nil {
			if reason, msg, ok := checks.Denial(err); ok {
				return &decision{machine: machine, deny: reason, message: msg}, nil
			}
			return nil, fmt.Errorf("unable to apply trust on first use to identity %s: %w", res.Identity.Stable, err)
		}
	}
	return &decision{checked: checked, machine: machine, answers: res.Answers}, nil
}

func (c *Controller) lookupCSR(_ context.Context, name string) (*attestor.CSRRecord, error) {
	csr, err := c.lister.Get(name)
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("%w: %s", attestor.ErrCSRNotFound, name)
	}
	if err != nil {
		return nil, err
	}
	return &attestor.CSRRecord{
		Name:        csr.Name,
		UID:         string(csr.UID),
		Username:    csr.Spec.Username,
		SignerName:  csr.Spec.SignerName,
		Request:     append([]byte(nil), csr.Spec.Request...),
		Annotations: maps.Clone(csr.Annotations),
		Approved:    hasCondition(csr, certificatesv1.CertificateApproved),
		Denied:      hasCondition(csr, certificatesv1.CertificateDenied),
		Issued:      len(csr.Status.Certificate) > 0,
	}, nil
}

// denyCSR denies csr; machine is the Machine it matched, if any.
func (c *Controller) denyCSR(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, machine *Machine, reason, message string) error {
	csr = csr.DeepCopy()
	csr.Status.Conditions = append(csr.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
		Type:           certificatesv1.CertificateDenied,
		Status:         corev1.ConditionTrue,
		Reason:         reason,
		Message:        message,
		LastUpdateTime: metav1.Now(),
	})
	if _, err := c.cfg.Client.CertificatesV1().CertificateSigningRequests().UpdateApproval(ctx, csr.Name, csr, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("unable to deny: %w", err)
	}
	c.metric(DecisionDenied, reason)
	if reason != ReasonChallengeAnswered { // bookkeeping: the answer's approval is the decision
		c.record(csr.Name, machine, DecisionDenied, reason, message)
	}
	klog.FromContext(ctx).Info("Denied", "reason", reason, "message", message, "requester", csr.Spec.Username)
	return nil
}

func (c *Controller) fail(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, machine *Machine, message string) error {
	csr = csr.DeepCopy()
	csr.Status.Conditions = append(csr.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
		Type:           certificatesv1.CertificateFailed,
		Status:         corev1.ConditionTrue,
		Reason:         ReasonSigningFailed,
		Message:        message,
		LastUpdateTime: metav1.Now(),
	})
	if _, err := c.cfg.Client.CertificatesV1().CertificateSigningRequests().UpdateStatus(ctx, csr, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("unable to mark as failed: %w", err)
	}
	c.metric(DecisionFailed, ReasonSigningFailed)
	c.record(csr.Name, machine, DecisionFailed, ReasonSigningFailed, message)
	klog.FromContext(ctx).Info("Failed an approved request", "message", message)
	return nil
}

func (c *Controller) approve(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, d *decision) (*certificatesv1.CertificateSigningRequest, error) {
	message := fmt.Sprintf("attestor %q verified node %q with provider ID %q of Machine %s/%s",
		d.checked.Provider, d.checked.NodeName, d.checked.ProviderID, d.machine.Namespace, d.machine.Name)
	csr = csr.DeepCopy()
	csr.Status.Conditions = append(csr.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
		Type:           certificatesv1.CertificateApproved,
		Status:         corev1.ConditionTrue,
		Reason:         ReasonAttestationVerified,
		Message:        message,
		LastUpdateTime: metav1.Now(),
	})
	out, err := c.cfg.Client.CertificatesV1().CertificateSigningRequests().UpdateApproval(ctx, csr.Name, csr, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("unable to approve: %w", err)
	}
	c.metric(DecisionApproved, ReasonAttestationVerified)
	c.record(csr.Name, d.machine, DecisionApproved, ReasonAttestationVerified, message)
	klog.FromContext(ctx).Info("Approved", "node", d.checked.NodeName, "providerID", d.checked.ProviderID,
		"attestor", d.checked.Provider, "requester", csr.Spec.Username)
	return out, nil
}

func (c *Controller) sign(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, d *decision) error {
	certPEM, err := c.cfg.Signer.Sign(&issue.Request{
		CSR:        d.checked.Request.CSR,
		ProviderID: d.checked.ProviderID,
		Usages:     d.checked.Usages,
		Duration:   d.checked.RequestedDuration,
	})
	if err != nil {
		return fmt.Errorf("unable to sign: %w", err)
	}
	csr = csr.DeepCopy()
	csr.Status.Certificate = certPEM
	if _, err := c.cfg.Client.CertificatesV1().CertificateSigningRequests().UpdateStatus(ctx, csr, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("unable to store the signed certificate: %w", err)
	}
	c.signed(d.checked.Provider)
	klog.FromContext(ctx).Info("Issued", "node", d.checked.NodeName, "attestor", d.checked.Provider)
	return nil
}

func (c *Controller) writeChallenge(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, challenge []byte) error {
	if csr.Annotations[attestor.AnnotationChallenge] == string(challenge) {
		return nil
	}
	if _, err := c.annotate(ctx, csr, attestor.AnnotationChallenge, string(challenge)); err != nil {
		return err
	}
	c.metric(DecisionChallenged, "")
	klog.FromContext(ctx).Info("Challenged")
	return nil
}

// annotate sets an annotation on csr and returns the CSR as written.
func (c *Controller) annotate(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, key, value string) (*certificatesv1.CertificateSigningRequest, error) {
	if csr.Annotations[key] == value {
		return csr, nil
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{key: value}}})
	if err != nil {
		return nil, err
	}
	out, err := c.cfg.Client.CertificatesV1().CertificateSigningRequests().Patch(ctx, csr.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		return nil, fmt.Errorf("unable to annotate %s: %w", key, err)
	}
	return out, nil
}

func findCondition(csr *certificatesv1.CertificateSigningRequest, t certificatesv1.RequestConditionType) *certificatesv1.CertificateSigningRequestCondition {
	for i := range csr.Status.Conditions {
		if c := &csr.Status.Conditions[i]; c.Type == t && c.Status != corev1.ConditionFalse {
			return c
		}
	}
	return nil
}

func hasCondition(csr *certificatesv1.CertificateSigningRequest, t certificatesv1.RequestConditionType) bool {
	return findCondition(csr, t) != nil
}
