package serving

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/controller"
)

// KubeletServingApprover approves kubelet's own kubernetes.io/kubelet-serving
// CSRs (ServerTLSBootstrap) whose SANs all belong to the node's Machine, and
// denies the others. It does not sign: kube-controller-manager's csrsigning
// controller does. It implements controller.Handler.
type KubeletServingApprover struct {
	// Client talks to the workload cluster.
	Client kubernetes.Interface
	// Cluster names the workload cluster in metrics.
	Cluster string
	// Machines finds the node's Machine.
	Machines Machines
	// Metrics, when set, records decisions.
	Metrics controller.Metrics
}

// Sync implements controller.Handler.
func (a *KubeletServingApprover) Sync(ctx context.Context, csr *certificatesv1.CertificateSigningRequest) error {
	if _, ok := approvedBy(csr); ok {
		return nil // kube-controller-manager signs it
	}
	w := &writer{client: a.Client, cluster: a.Cluster, metrics: a.Metrics}
	deny := func(err error) error {
		reason, msg, _ := checks.Denial(err)
		if _, err := w.condition(ctx, csr, certificatesv1.CertificateDenied, reason, msg); err != nil {
			return err
		}
		klog.FromContext(ctx).Info("Denied a kubelet serving certificate", "reason", reason, "message", msg, "requester", csr.Spec.Username)
		return nil
	}
	x, err := parsePlainCSR(csr.Spec.Request)
	if err != nil {
		return deny(failf(checks.ReasonMalformedRequest, "spec.request: %v", err))
	}
	nodeName, fails := checkRequest(csr, x, false)
	if len(fails) > 0 {
		return deny(errors.Join(fails...))
	}
	m, err := a.Machines.ForNode(ctx, nodeName)
	if err != nil {
		if len(checks.Failures(err)) > 0 {
			return deny(err)
		}
		return fmt.Errorf("unable to find the Machine of node %q: %w", nodeName, err)
	}
	if err := checkSANs(x, m); err != nil {
		return deny(err)
	}
	msg := fmt.Sprintf("node %q asks for its own serving certificate with addresses of Machine %s/%s", nodeName, m.Namespace, m.Name)
	if _, err := w.condition(ctx, csr, certificatesv1.CertificateApproved, ReasonServingVerified, msg); err != nil {
		return err
	}
	klog.FromContext(ctx).Info("Approved a kubelet serving certificate", "node", nodeName, "machine", m.Namespace+"/"+m.Name, "dnsNames", x.DNSNames, "ips", x.IPAddresses)
	return nil
}

// parsePlainCSR parses spec.request of a kubernetes.io signer: one PKCS#10
// PEM block, whose signature verifies.
func parsePlainCSR(b []byte) (*x509.CertificateRequest, error) {
	block, rest := pem.Decode(b)
	if block == nil || block.Type != "CERTIFICATE REQUEST" {
		return nil, errors.New("not a PEM CERTIFICATE REQUEST")
	}
	if p, _ := pem.Decode(rest); p != nil {
		return nil, errors.New("more than one PEM block")
	}
	x, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("not a PKCS#10 request: %w", err)
	}
	if err := x.CheckSignature(); err != nil {
		return nil, fmt.Errorf("the PKCS#10 signature does not verify: %w", err)
	}
	return x, nil
}
