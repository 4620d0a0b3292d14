// Package serving decides kubelet serving certificate requests of a
// workload cluster: it approves kubelet's own kubernetes.io/kubelet-serving
// CSRs (ServerTLSBootstrap), which kube-controller-manager then signs, and
// approves and signs the attested cluster.x-k8s.io/kubelet-serving-<provider>
// CSRs with a serving CA the controller manages.
//
// Both accept a request only from the node for its own name, with exactly
// the serving usages, and with DNS and IP subject alternative names that all
// belong to the node's Machine (status.addresses). Each handler plugs into
// the CSR controller of package controller as a controller.Handler.
package serving

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net"
	"slices"
	"strings"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/controller"
)

// Reasons of serving decisions (the subject, key and CA reasons are those
// of package checks; the Machine ones come from the Machines lookup).
const (
	// ReasonServingVerified approves a kubelet-serving CSR whose SANs all
	// belong to the node's Machine.
	ReasonServingVerified = "ServingAddressesVerified"
	// ReasonSANTypeNotAllowed: the request carries email or URI SANs; a
	// kubelet serving certificate has only DNS and IP SANs.
	ReasonSANTypeNotAllowed = "SANTypeNotAllowed"
	// ReasonSANNotMachineAddress: a DNS or IP SAN is not one of the Machine's
	// status.addresses.
	ReasonSANNotMachineAddress = "SANNotMachineAddress"
	// ReasonNoSANs: the request names no DNS or IP address to serve on.
	ReasonNoSANs = "NoSANs"
)

// Machine is what the serving rules need to know about a node's Machine.
type Machine struct {
	Namespace, Name string
	// UID owns the Machine's trust-on-first-use record.
	UID         types.UID
	ProviderID  string
	Annotations map[string]string
	// DNSNames are its Hostname, InternalDNS and ExternalDNS addresses; IPs
	// its InternalIP and ExternalIP addresses.
	DNSNames []string
	IPs      []net.IP
}

// Machines finds a node's Machine. A node no Machine accounts for is
// reported as a *checks.Failure; any other error is transient.
type Machines interface {
	// ForNode returns the Machine that is node nodeName (its nodeRef, or
	// before that its name or a Hostname or InternalDNS address).
	ForNode(ctx context.Context, nodeName string) (*Machine, error)
	// Match returns the Machine with providerID that claims nodeName, like
	// controller.MachineMatcher.
	Match(ctx context.Context, nodeName, providerID string) (*Machine, error)
}

func failf(reason, format string, args ...any) *checks.Failure {
	return &checks.Failure{Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// checkRequest runs the serving rules that need no Machine: requester,
// subject, usages, key, SAN types, no CA. allowBootstrap also accepts a
// bootstrap token requester (attested requests, whose evidence names the
// node). It returns the node name and every failure.
func checkRequest(csr *certificatesv1.CertificateSigningRequest, x *x509.CertificateRequest, allowBootstrap bool) (string, []error) {
	var fails []error
	spec := &csr.Spec
	requester := ""
	switch {
	case strings.HasPrefix(spec.Username, checks.NodeUserPrefix):
		requester = strings.TrimPrefix(spec.Username, checks.NodeUserPrefix)
		if !slices.Contains(spec.Groups, checks.NodesGroup) {
			fails = append(fails, failf(checks.ReasonRequesterNotAllowed, "requester %q is not in group %s", spec.Username, checks.NodesGroup))
		}
	case allowBootstrap && strings.HasPrefix(spec.Username, checks.BootstrapUserPrefix) && slices.Contains(spec.Groups, checks.BootstrappersGroup):
	default:
		who := "the node itself (" + checks.NodeUserPrefix + "<name>)"
		if allowBootstrap {
			who += " or a bootstrap token"
		}
		fails = append(fails, failf(checks.ReasonRequesterNotAllowed, "requester %q may not ask for a kubelet serving certificate: only %s may", spec.Username, who))
	}
	name, subj := checks.CheckSubject(x)
	for _, f := range subj {
		fails = append(fails, f)
	}
	if requester != "" && name != "" && requester != name {
		fails = append(fails, failf(checks.ReasonRequesterMismatch, "node %q may ask only for its own serving certificate, not one for %q", requester, name))
	}

	isRSA := false
	switch k := x.PublicKey.(type) {
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() {
			fails = append(fails, failf(checks.ReasonKeyNotAllowed, "ECDSA key on curve %s: use P-256", k.Curve.Params().Name))
		}
	case *rsa.PublicKey:
		isRSA = true
		if n := k.N.BitLen(); n < checks.MinRSABits || n > checks.MaxRSABits {
			fails = append(fails, failf(checks.ReasonKeyNotAllowed, "RSA key of %d bits: use ECDSA P-256 (or RSA of %d to %d bits)", n, checks.MinRSABits, checks.MaxRSABits))
		}
	default:
		fails = append(fails, failf(checks.ReasonKeyNotAllowed, "%s key: use ECDSA P-256", x.PublicKeyAlgorithm))
	}
	if f := checkUsages(spec.Usages, isRSA); f != nil {
		fails = append(fails, f)
	}
	var bad []string
	for _, e := range x.EmailAddresses {
		bad = append(bad, "email:"+e)
	}
	for _, u := range x.URIs {
		bad = append(bad, "URI:"+u.String())
	}
	if len(bad) > 0 {
		fails = append(fails, failf(ReasonSANTypeNotAllowed, "subject alternative names %s are not allowed: a kubelet serving certificate carries only DNS and IP SANs", strings.Join(bad, ", ")))
	}
	if len(x.DNSNames)+len(x.IPAddresses) == 0 {
		fails = append(fails, failf(ReasonNoSANs, "the request names no DNS or IP address: request the node's addresses as SANs"))
	}
	if f := checks.CheckNotCA(x); f != nil {
		fails = append(fails, f)
	}
	return name, fails
}

// checkUsages requires exactly digital signature and server auth, plus key
// encipherment for RSA keys only.
func checkUsages(usages []certificatesv1.KeyUsage, isRSA bool) *checks.Failure {
	want := []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth}
	if isRSA {
		want = append(want, certificatesv1.UsageKeyEncipherment)
	}
	got := slices.Clone(usages)
	slices.Sort(got)
	got = slices.Compact(got)
	slices.Sort(want)
	if len(got) == len(usages) && slices.Equal(got, want) {
		return nil
	}
	if !isRSA && slices.Contains(usages, certificatesv1.UsageKeyEncipherment) && len(got) == 3 {
		return failf(checks.ReasonUsagesNotAllowed, "usage %q is allowed only for RSA keys: request %q and %q", certificatesv1.UsageKeyEncipherment, certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth)
	}
	return failf(checks.ReasonUsagesNotAllowed, "usages %v: request exactly [%s, %s] (plus %s for RSA keys)", usages, certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth, certificatesv1.UsageKeyEncipherment)
}

// checkSANs requires every DNS and IP SAN to be one of the Machine's
// addresses.
func checkSANs(x *x509.CertificateRequest, m *Machine) error {
	var foreign []string
	for _, n := range x.DNSNames {
		if !slices.ContainsFunc(m.DNSNames, func(d string) bool { return strings.EqualFold(d, n) }) {
			foreign = append(foreign, "DNS:"+n)
		}
	}
	for _, ip := range x.IPAddresses {
		if !slices.ContainsFunc(m.IPs, ip.Equal) {
			foreign = append(foreign, "IP:"+ip.String())
		}
	}
	if len(foreign) == 0 {
		return nil
	}
	ips := make([]string, len(m.IPs))
	for i, ip := range m.IPs {
		ips[i] = ip.String()
	}
	return failf(ReasonSANNotMachineAddress, "subject alternative names %s are not addresses of Machine %s/%s (DNS %q, IP %q); request only the node's own addresses",
		strings.Join(foreign, ", "), m.Namespace, m.Name, m.DNSNames, ips)
}

// writer writes decisions on CSRs and records them.
type writer struct {
	client  kubernetes.Interface
	cluster string
	metrics controller.Metrics
}

func (w *writer) metric(decision, reason string) {
	if w.metrics != nil {
		w.metrics.Decision(w.cluster, decision, reason)
	}
}

func (w *writer) condition(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, typ certificatesv1.RequestConditionType, reason, message string) (*certificatesv1.CertificateSigningRequest, error) {
	csr = csr.DeepCopy()
	csr.Status.Conditions = append(csr.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
		Type: typ, Status: corev1.ConditionTrue, Reason: reason, Message: message, LastUpdateTime: metav1.Now(),
	})
	out, err := w.client.CertificatesV1().CertificateSigningRequests().UpdateApproval(ctx, csr.Name, csr, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("unable to set condition %s: %w", typ, err)
	}
	if typ == certificatesv1.CertificateApproved {
		w.metric(controller.DecisionApproved, reason)
	} else {
		w.metric(controller.DecisionDenied, reason)
	}
	return out, nil
}

func (w *writer) annotate(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, key, value string) error {
	if csr.Annotations[key] == value {
		return nil
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{key: value}}})
	if err != nil {
		return err
	}
	if _, err := w.client.CertificatesV1().CertificateSigningRequests().Patch(ctx, csr.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("unable to annotate %s: %w", key, err)
	}
	return nil
}

func approvedBy(csr *certificatesv1.CertificateSigningRequest) (string, bool) {
	for _, c := range csr.Status.Conditions {
		if c.Type == certificatesv1.CertificateApproved && c.Status != corev1.ConditionFalse {
			return c.Reason, true
		}
	}
	return "", false
}
