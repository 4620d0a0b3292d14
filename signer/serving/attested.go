package serving

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/controller"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// ReasonAttestedServingVerified approves an attested serving CSR.
const ReasonAttestedServingVerified = "AttestedServingVerified"

// AttestedSigner approves and signs the attested
// cluster.x-k8s.io/kubelet-serving-<provider> CSRs of one provider with a
// serving CA: the serving rules, the Cluster's authorized attestors, the
// Machine match by provider ID, and the evidence. It implements
// controller.Handler.
type AttestedSigner struct {
	// Client talks to the workload cluster.
	Client kubernetes.Interface
	// Cluster names the workload cluster in metrics.
	Cluster string
	// Provider is the provider whose serving signer name this serves, and
	// Verifier its verifier half.
	Provider string
	Verifier attestor.Verifier
	// Authorized lists the providers the Cluster authorizes.
	Authorized []string
	// Machines finds the node's Machine.
	Machines Machines
	// CA signs; MaxLifetime caps certificates.
	CA          *issue.CA
	MaxLifetime time.Duration
	// Identities applies trust on first use, as for client certificates:
	// a serving certificate for a Machine's addresses goes only to the
	// identity bound to that Machine. May be nil (no TOFU).
	Identities controller.IdentityBinder
	// Metrics, when set, records decisions.
	Metrics controller.Metrics
	// Now returns the current time; nil means time.Now.
	Now func() time.Time
}

// Sync implements controller.Handler.
func (s *AttestedSigner) Sync(ctx context.Context, csr *certificatesv1.CertificateSigningRequest) error {
	logger := klog.FromContext(ctx)
	reason, approved := approvedBy(csr)
	if approved && reason != ReasonAttestedServingVerified {
		return nil // approved by someone else: not attested, not signed by us
	}
	w := &writer{client: s.Client, cluster: s.Cluster, metrics: s.Metrics}
	deny := func(err error) error {
		reason, msg, _ := checks.Denial(err)
		typ := certificatesv1.CertificateDenied
		if approved {
			typ = certificatesv1.CertificateFailed
		}
		if typ == certificatesv1.CertificateFailed {
			c := csr.DeepCopy()
			c.Status.Conditions = append(c.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
				Type: typ, Status: "True", Reason: reason, Message: msg, LastUpdateTime: metav1.Now(),
			})
			if _, err := s.Client.CertificatesV1().CertificateSigningRequests().UpdateStatus(ctx, c, metav1.UpdateOptions{}); err != nil {
				return fmt.Errorf("unable to mark as failed: %w", err)
			}
			w.metric(controller.DecisionFailed, reason)
		} else if _, err := w.condition(ctx, csr, typ, reason, msg); err != nil {
			return err
		}
		logger.Info("Denied an attested serving certificate", "reason", reason, "message", msg, "requester", csr.Spec.Username)
		return nil
	}

	req, err := attestor.ParseRequest(csr.Spec.Request)
	if err != nil {
		return deny(failf(checks.ReasonMalformedRequest, "spec.request does not follow the wire contract: %v", err))
	}
	x := req.CSR
	var fails []error
	if req.Provider != s.Provider {
		fails = append(fails, failf(checks.ReasonProviderMismatch, "the provider block names %q but the signer name %q is for %q", req.Provider, csr.Spec.SignerName, s.Provider))
	}
	if err := x.CheckSignature(); err != nil {
		fails = append(fails, failf(checks.ReasonMalformedRequest, "the PKCS#10 signature does not verify: %v", err))
	}
	nodeName, more := checkRequest(csr, x, true)
	fails = append(fails, more...)
	providerID, err := attestor.ProviderIDFromExtensions(x.Extensions)
	if err != nil {
		fails = append(fails, failf(checks.ReasonProviderIDMissing, "%v: the node must state its provider ID", err))
	}
	if !slices.Contains(s.Authorized, s.Provider) {
		fails = append(fails, failf(controller.ReasonAttestorNotAuthorized, "the Cluster does not authorize attestor %q (authorized: %q)", s.Provider, s.Authorized))
	}
	if len(fails) > 0 {
		return deny(errors.Join(fails...))
	}
	if !slices.Contains(s.Verifier.Versions(), req.Version) {
		supported := strings.Join(s.Verifier.Versions(), ",")
		if err := w.annotate(ctx, csr, attestor.AnnotationSupportedVersions, supported); err != nil {
			return err
		}
		return deny(failf(controller.ReasonUnsupportedEvidenceVersion, "evidence version %q is not accepted by attestor %q; file a new request with one of %s", req.Version, s.Provider, supported))
	}
	m, err := s.Machines.Match(ctx, nodeName, providerID)
	if err != nil {
		if len(checks.Failures(err)) > 0 {
			return deny(err)
		}
		return fmt.Errorf("unable to match node %q (provider ID %q) to a Machine: %w", nodeName, providerID, err)
	}
	if err := checkSANs(x, m); err != nil {
		return deny(err)
	}
	res, err := s.Verifier.Verify(ctx, &attestor.VerifyRequest{
		Evidence: req.Evidence, Version: req.Version, Binding: attestor.Binding(x.RawSubjectPublicKeyInfo),
		CSR: x, NodeName: nodeName, ProviderID: providerID,
		CSRName: csr.Name, CSRUID: string(csr.UID), Username: csr.Spec.Username, Annotations: csr.Annotations,
		MachineAnnotations: maps.Clone(m.Annotations),
		LookupCSR:          s.lookupCSR,
	})
	if err != nil {
		if d, ok := attestor.AsDenial(err); ok {
			return deny(failf(d.Reason, "%s", d.Message))
		}
		return fmt.Errorf("attestor %q could not verify the evidence: %w", s.Provider, err)
	}
	switch {
	case res == nil || (res.Identity == nil && res.Challenge == nil):
		return fmt.Errorf("attestor %q returned neither an identity nor a challenge", s.Provider)
	case res.Identity == nil:
		if err := w.annotate(ctx, csr, attestor.AnnotationChallenge, string(res.Challenge)); err != nil {
			return err
		}
		w.metric(controller.DecisionChallenged, "")
		return nil
	}
	if got := res.Identity.ProviderID; got != providerID || got != m.ProviderID {
		return deny(failf(controller.ReasonAttestedProviderIDMismatch, "attestor %q proves provider ID %q, but the request claims %q and Machine %s/%s has %q",
			s.Provider, got, providerID, m.Namespace, m.Name, m.ProviderID))
	}
	if stable := res.Identity.Stable; stable != "" && s.Identities != nil {
		bound := &controller.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID, ProviderID: m.ProviderID, Annotations: m.Annotations}
		if err := s.Identities.Bind(ctx, bound, stable); err != nil {
			if _, _, ok := checks.Denial(err); ok {
				return deny(err)
			}
			return fmt.Errorf("unable to apply trust on first use to identity %s: %w", stable, err)
		}
	}

	if !approved {
		msg := fmt.Sprintf("attestor %q verified node %q with provider ID %q of Machine %s/%s; SANs are its addresses", s.Provider, nodeName, providerID, m.Namespace, m.Name)
		if csr, err = w.condition(ctx, csr, certificatesv1.CertificateApproved, ReasonAttestedServingVerified, msg); err != nil {
			return err
		}
	}
	now := time.Now()
	if s.Now != nil {
		now = s.Now()
	}
	var requested time.Duration
	if e := csr.Spec.ExpirationSeconds; e != nil && *e > 0 {
		requested = time.Duration(*e) * time.Second
	}
	certPEM, err := signServing(s.CA, x, providerID, csr.Spec.Usages, requested, s.MaxLifetime, now)
	if err != nil {
		return err
	}
	csr = csr.DeepCopy()
	csr.Status.Certificate = certPEM
	if _, err := s.Client.CertificatesV1().CertificateSigningRequests().UpdateStatus(ctx, csr, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("unable to store the signed certificate: %w", err)
	}
	logger.Info("Issued a serving certificate", "node", nodeName, "machine", m.Namespace+"/"+m.Name, "dnsNames", x.DNSNames, "ips", x.IPAddresses)
	return nil
}

func (s *AttestedSigner) lookupCSR(ctx context.Context, name string) (*attestor.CSRRecord, error) {
	csr, err := s.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("%w: %s", attestor.ErrCSRNotFound, name)
	}
	if err != nil {
		return nil, err
	}
	_, approved := approvedBy(csr)
	denied := false
	for _, c := range csr.Status.Conditions {
		if c.Type == certificatesv1.CertificateDenied {
			denied = true
		}
	}
	return &attestor.CSRRecord{
		Name: csr.Name, UID: string(csr.UID), Username: csr.Spec.Username, SignerName: csr.Spec.SignerName,
		Request: csr.Spec.Request, Annotations: csr.Annotations,
		Approved: approved, Denied: denied, Issued: len(csr.Status.Certificate) > 0,
	}, nil
}
