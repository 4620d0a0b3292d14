package controller

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
)

// apply writes a decision on csr: the one place a CSR is written. It
// returns an error when the request must be retried, and after > 0 when it
// must be looked at again then.
func (c *Controller) apply(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, d *engine.Decision) (after time.Duration, err error) {
	if v := d.Verification; v != nil {
		c.verified(v)
	}
	if d.Machine != nil {
		ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("machine", types.NamespacedName{Namespace: d.Machine.Namespace, Name: d.Machine.Name}))
	}
	logger := klog.FromContext(ctx)
	switch d.Outcome {
	case engine.Skip:
		return 0, nil
	case engine.Retry:
		return 0, d.Err
	case engine.Wait:
		logger.V(4).Info("Challenged, waiting for the answer", "lookAgainIn", d.After)
		return d.After, nil
	}
	if len(d.Annotations) > 0 {
		if csr, err = c.annotate(ctx, csr, d.Annotations); err != nil {
			return 0, err
		}
	}
	switch d.Outcome {
	case engine.Challenge:
		c.metric(DecisionChallenged, "")
		logger.Info("Challenged", "node", d.NodeName, "requester", csr.Spec.Username)
		return 0, nil
	case engine.Deny:
		_, err := c.condition(ctx, csr, d, certificatesv1.CertificateDenied, DecisionDenied)
		return 0, err
	case engine.Fail:
		_, err := c.condition(ctx, csr, d, certificatesv1.CertificateFailed, DecisionFailed)
		return 0, err
	case engine.Approve:
		if d.Consume != nil {
			if err := c.consume(ctx, d.Consume, csr); err != nil {
				return 0, err
			}
		}
		approved, err := c.condition(ctx, csr, d, certificatesv1.CertificateApproved, DecisionApproved)
		if err != nil {
			return 0, err
		}
		if d.Issue == nil || d.Profile.Signer == nil {
			return 0, nil
		}
		return 0, c.sign(ctx, approved, true, d)
	case engine.Sign:
		return 0, c.sign(ctx, csr, false, d)
	}
	return 0, fmt.Errorf("unknown decision %q", d.Outcome)
}

// condition writes an Approved, Denied or Failed condition and returns the
// CSR as written.
func (c *Controller) condition(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, d *engine.Decision, typ certificatesv1.RequestConditionType,
	decision string) (*certificatesv1.CertificateSigningRequest, error) {
	if typ == certificatesv1.CertificateDenied {
		if err := c.denying(ctx, csr, d.Reason); err != nil {
			return nil, err
		}
	}
	written, err := c.addCondition(ctx, csr, certificatesv1.CertificateSigningRequestCondition{
		Type:           typ,
		Status:         corev1.ConditionTrue,
		Reason:         d.Reason,
		Message:        d.Message,
		LastUpdateTime: metav1.Now(),
	})
	if err != nil {
		return nil, fmt.Errorf("unable to write condition %s: %w", typ, err)
	}
	c.metric(decision, d.Reason)
	c.record(csr.Name, d.Machine, decision, d.Reason, d.Message)
	logger := klog.FromContext(ctx)
	switch typ {
	case certificatesv1.CertificateApproved:
		logger.Info("Approved", "node", d.NodeName, "providerID", d.ProviderID, "signer", csr.Spec.SignerName, "requester", csr.Spec.Username)
	case certificatesv1.CertificateDenied:
		logger.Info("Denied", "reason", d.Reason, "message", d.Message, "signer", csr.Spec.SignerName, "requester", csr.Spec.Username)
	default:
		logger.Info("Failed an approved request", "message", d.Message)
	}
	return written, nil
}

// denying tells Issuing of a denied renewal (a client certificate request
// filed with the node's own credential) before the denial is written: an
// error leaves the request undenied, to be decided again. The answered
// request consume denies is not a renewal denied: its answer is approved.
func (c *Controller) denying(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, reason string) error {
	node, ok := strings.CutPrefix(csr.Spec.Username, attestor.NodeUserPrefix)
	p, known := c.engine.Profile(csr.Spec.SignerName)
	if c.cfg.Issuing == nil || !ok || !known || p.Kind != checks.Client {
		return nil
	}
	if err := c.cfg.Issuing.Denying(ctx, node, csr.Name, reason); err != nil {
		return fmt.Errorf("denial of node %s's renewal not recorded yet: %w", node, err)
	}
	return nil
}

// consume denies the request whose challenge the request being approved
// (by) answered, before that one is approved. The write is conditional on
// the version the engine checked, so of two answers to one challenge only
// one is approved; if it fails, the answer is decided again, never
// approved. Its message names by (engine.ConsumedMessage): if by's own
// approval then fails, by is approved when decided again, and no other.
func (c *Controller) consume(ctx context.Context, first, by *certificatesv1.CertificateSigningRequest) error {
	if first.Name == "" {
		return fmt.Errorf("the answered request is unknown; deciding %s again", by.Name)
	}
	if _, err := c.addCondition(ctx, first, certificatesv1.CertificateSigningRequestCondition{
		Type:           certificatesv1.CertificateDenied,
		Status:         corev1.ConditionTrue,
		Reason:         attestor.ReasonChallengeAnswered,
		Message:        engine.ConsumedMessage(by.Name, by.UID),
		LastUpdateTime: metav1.Now(),
	}); err != nil {
		return fmt.Errorf("unable to close the answered request %s: %w", first.Name, err)
	}
	// Bookkeeping, not a decision of its own: no Event.
	c.metric(DecisionDenied, attestor.ReasonChallengeAnswered)
	klog.FromContext(ctx).Info("Closed the answered request", "answered", first.Name)
	return nil
}

// addCondition adds cond to csr's conditions through the approval
// subresource (the status one for Failed), conditional on the
// resourceVersion csr was read at, and returns the CSR as written.
//
// Where csr holds all of the request's metadata (updateBody), it is an
// update: its body leaves out the spec, which the API server keeps from
// the stored object on every update of a CSR, and is decoded as protobuf.
// Otherwise (the cache cut the metadata: forgetUnread) an update would
// write the requester's other metadata away, and it patches the
// conditions alone with a JSON patch (RFC 6902). The API server applies
// a patch to the stored object turned into JSON and decodes the result,
// which for a request carrying a TPM event log costs it more than the
// rest of the write.
func (c *Controller) addCondition(ctx context.Context, csr *certificatesv1.CertificateSigningRequest,
	cond certificatesv1.CertificateSigningRequestCondition) (*certificatesv1.CertificateSigningRequest, error) {
	api := c.cfg.Client.CertificatesV1().CertificateSigningRequests()
	if body := updateBody(csr); body != nil {
		body.Status.Conditions = append(body.Status.Conditions, cond)
		if cond.Type == certificatesv1.CertificateFailed {
			return api.UpdateStatus(ctx, body, metav1.UpdateOptions{})
		}
		return api.UpdateApproval(ctx, csr.Name, body, metav1.UpdateOptions{})
	}
	var ops []jsonPatchOp
	if csr.ResourceVersion != "" {
		ops = append(ops, jsonPatchOp{Op: "replace", Path: "/metadata/resourceVersion", Value: csr.ResourceVersion})
	}
	ops = append(ops, jsonPatchOp{Op: "add", Path: "/status/conditions", Value: append(slices.Clone(csr.Status.Conditions), cond)})
	patch, err := json.Marshal(ops)
	if err != nil {
		return nil, err
	}
	subresource := "approval"
	if cond.Type == certificatesv1.CertificateFailed {
		subresource = "status"
	}
	return api.Patch(ctx, csr.Name, types.JSONPatchType, patch, metav1.PatchOptions{}, subresource)
}

// updateBody returns the body of an update of csr that writes its
// metadata back as it is and its status as csr holds it, conditional on
// csr's resourceVersion; nil where csr cannot give one: it has no
// resourceVersion, or it is a cached copy whose metadata the cache cut
// (annotationMetadataCut). The spec is left out: every update of a CSR,
// of the object or of a subresource, keeps the stored spec whatever the
// body holds.
func updateBody(csr *certificatesv1.CertificateSigningRequest) *certificatesv1.CertificateSigningRequest {
	if csr.ResourceVersion == "" {
		return nil
	}
	if _, cut := csr.Annotations[annotationMetadataCut]; cut {
		return nil
	}
	return &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{
			Name:            csr.Name,
			UID:             csr.UID,
			ResourceVersion: csr.ResourceVersion,
			GenerateName:    csr.GenerateName,
			Labels:          csr.Labels,
			Annotations:     maps.Clone(csr.Annotations),
			Finalizers:      csr.Finalizers,
			OwnerReferences: csr.OwnerReferences,
		},
		Status: *csr.Status.DeepCopy(),
	}
}

// jsonPatchOp is one operation of a JSON patch (RFC 6902).
type jsonPatchOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value"`
}

// sign signs an approved request. written says csr is what this signer's
// approval just returned; otherwise csr comes from the cache, which may lag
// behind this signer's own last write, and the live object is read first: a
// request is never signed twice. The certificate is stored by an update
// conditional on the resourceVersion read, so nothing written since is
// overwritten.
func (c *Controller) sign(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, written bool, d *engine.Decision) error {
	api := c.cfg.Client.CertificatesV1().CertificateSigningRequests()
	live := csr
	if !written {
		var err error
		live, err = api.Get(ctx, csr.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
	}
	if !c.engine.Pending(live) || !engine.HasCondition(live, certificatesv1.CertificateApproved) {
		return nil
	}
	certPEM, err := d.Profile.Signer.Sign(d.Issue)
	if err != nil {
		return fmt.Errorf("unable to sign: %w", err)
	}
	b, _ := pem.Decode(certPEM)
	if b == nil {
		return errors.New("the signer returned no PEM certificate")
	}
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		return fmt.Errorf("unable to parse the certificate just signed: %w", err)
	}
	if c.cfg.Issuing != nil && d.Profile.Kind == checks.Client {
		if err := c.cfg.Issuing.Issuing(ctx, d.NodeName, d.Machine, cert,
			revoke.Attestation{Provider: d.Profile.Provider, PolicySHA256: c.engine.PolicySHA256(d.Profile.Provider)}); err != nil {
			return fmt.Errorf("certificate for node %s not handed out yet: %w", d.NodeName, err)
		}
	}
	live.Status.Certificate = certPEM
	if _, err := api.UpdateStatus(ctx, live, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("unable to store the signed certificate: %w", err)
	}
	c.signed(d.Profile.Provider)
	// The certificate's fingerprint as kube-apiserver gives it in the
	// user's extra authentication.kubernetes.io/credential-id: an audit
	// log entry or `kubectl auth whoami` leads back to this line.
	klog.FromContext(ctx).Info("Issued", "node", d.NodeName, "signer", live.Spec.SignerName,
		"credentialID", podcert.CredentialIDPrefix+revoke.Fingerprint(cert), "serial", cert.SerialNumber.Text(16),
		"notAfter", cert.NotAfter.UTC().Format(time.RFC3339))
	return nil
}

// annotate sets annotations on csr and returns the CSR as written.
//
// Where csr holds all of the request's metadata (updateBody), it is an
// update of the request, conditional on the version decided on: a
// request changed since (by another replica, say, while a shard moves)
// is decided again rather than annotated. Its body leaves the spec out,
// which for a request carrying a TPM event log is most of what the API
// server would otherwise turn into JSON and back to apply a patch.
// Otherwise (the cache cut the metadata), or while the workload cluster's
// role does not grant update (a deploy/workload applied by hand before
// the verb was added: the API server answers 403), it is a merge patch of
// the annotations alone; after a 403 updates are tried again only after
// updateRetryAfter.
func (c *Controller) annotate(ctx context.Context, csr *certificatesv1.CertificateSigningRequest,
	set map[string]string) (*certificatesv1.CertificateSigningRequest, error) {
	changed := false
	for k, v := range set {
		if csr.Annotations[k] != v {
			changed = true
		}
	}
	if !changed {
		return csr, nil
	}
	api := c.cfg.Client.CertificatesV1().CertificateSigningRequests()
	if body := updateBody(csr); body != nil && c.mayUpdate() {
		if body.Annotations == nil {
			body.Annotations = map[string]string{}
		}
		maps.Copy(body.Annotations, set)
		out, err := api.Update(ctx, body, metav1.UpdateOptions{})
		if err == nil {
			if c.patchUntil.Load() != 0 {
				c.patchUntil.Store(0) // granted again
			}
			return out, nil
		}
		if !apierrors.IsForbidden(err) {
			return nil, fmt.Errorf("unable to annotate: %w", err)
		}
		c.updateForbidden(ctx, err)
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": set}})
	if err != nil {
		return nil, err
	}
	out, err := api.Patch(ctx, csr.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		return nil, fmt.Errorf("unable to annotate: %w", err)
	}
	return out, nil
}

// updateRetryAfter is how long after the API server refused an update of
// a request (403) annotate patches instead before it tries an update
// again: the controller re-applies deploy/workload with each token
// renewal, and an operator may re-apply it by hand.
const updateRetryAfter = 10 * time.Minute

// mayUpdate reports whether annotate may try an update.
func (c *Controller) mayUpdate() bool {
	until := c.patchUntil.Load()
	return until == 0 || c.now().UnixNano() >= until
}

// updateForbidden notes that the workload cluster refused an update of a
// request, and says so when it starts to (again after an update went
// through).
func (c *Controller) updateForbidden(ctx context.Context, err error) {
	if c.patchUntil.Swap(c.now().Add(updateRetryAfter).UnixNano()) == 0 {
		klog.FromContext(ctx).Info("The workload cluster refuses the controller updates of certificate signing requests: annotating them by patch; "+
			"apply deploy/workload again to grant the update verb", "err", err, "tryAgainIn", updateRetryAfter)
	}
}
