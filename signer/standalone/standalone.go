// Package standalone is what the signer needs to run without Cluster API
// (kubeadm or bare-metal clusters), in the cluster it serves: an allowlist
// of nodes kept in a ConfigMap of that cluster takes the place of Machines,
// and the CA comes from files or a Secret.
//
// An allowlist entry names a node, its provider ID and, optionally, the
// stable identity its attestor must prove (an EK hash, an instance ID),
// annotations handed to the verifier (a pinned TPM endorsement key), and
// the addresses its serving certificates may name.
package standalone

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// AllowlistKey is the ConfigMap key holding the allowlist.
const AllowlistKey = "allowlist.yaml"

// Entry is one node the signer may issue certificates for.
type Entry struct {
	// NodeName is the node's name (CN=system:node:<nodeName>).
	NodeName string `json:"nodeName"`
	// ProviderID is the provider ID the node must claim and prove.
	ProviderID string `json:"providerID"`
	// Identity, when set, is the stable identity the attestor must prove
	// ("tpm:ek-sha256:...", an instance ID).
	Identity string `json:"identity,omitempty"`
	// Annotations are handed to the verifier as the Machine's would be
	// (cluster-x-k8s-io/tpm-endorsement-key pins a TPM's EK).
	Annotations map[string]string `json:"annotations,omitempty"`
	// DNSNames and IPs are the node's addresses: the only subject
	// alternative names its serving certificates may have, as a Machine's
	// addresses are in Cluster API mode. The Node's own status is not
	// used: the node writes it.
	DNSNames []string `json:"dnsNames,omitempty"`
	IPs      []string `json:"ips,omitempty"`
}

// Allowlist is the content of the allowlist ConfigMap key.
type Allowlist struct {
	Nodes []Entry `json:"nodes"`
}

// ParseAllowlist parses and validates an allowlist, reporting every
// problem at once.
func ParseAllowlist(data []byte) (*Allowlist, error) {
	var a Allowlist
	if err := yaml.UnmarshalStrict(data, &a); err != nil {
		return nil, fmt.Errorf("unable to parse the allowlist: %w", err)
	}
	var errs []error
	seenName, seenID := map[string]int{}, map[string]int{}
	for i, e := range a.Nodes {
		if msgs := validation.IsDNS1123Subdomain(e.NodeName); len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("nodes[%d].nodeName %q: %s", i, e.NodeName, strings.Join(msgs, "; ")))
		}
		if e.ProviderID == "" {
			errs = append(errs, fmt.Errorf("nodes[%d] (%s): providerID is required", i, e.NodeName))
		}
		for _, n := range e.DNSNames {
			if msgs := validation.IsDNS1123Subdomain(strings.ToLower(n)); len(msgs) > 0 {
				errs = append(errs, fmt.Errorf("nodes[%d] (%s).dnsNames %q: %s", i, e.NodeName, n, strings.Join(msgs, "; ")))
			}
		}
		for _, ip := range e.IPs {
			if net.ParseIP(ip) == nil {
				errs = append(errs, fmt.Errorf("nodes[%d] (%s).ips %q: not an IP address", i, e.NodeName, ip))
			}
		}
		if j, ok := seenName[e.NodeName]; ok {
			errs = append(errs, fmt.Errorf("nodes[%d] and nodes[%d] both name node %q", j, i, e.NodeName))
		}
		if j, ok := seenID[e.ProviderID]; ok && e.ProviderID != "" {
			errs = append(errs, fmt.Errorf("nodes[%d] and nodes[%d] both have provider ID %q", j, i, e.ProviderID))
		}
		seenName[e.NodeName], seenID[e.ProviderID] = i, i
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("invalid allowlist: %w", err)
	}
	return &a, nil
}

// Matcher matches nodes against the allowlist in a ConfigMap. It implements
// engine.Machines; the ConfigMap is read on every request, so an
// edit takes effect at once. A missing or invalid allowlist is an error
// (retried), never a reason to deny: fixing it lets pending nodes in.
//
// An entry stands for a Machine: it has a UID of its own, derived from the
// allowlist, the node name and the provider ID (so an entry given another
// provider ID, a replaced machine, is another Machine to trust on first
// use), and its node has joined once the cluster has a Node of that name.
// It also implements tofu.Owners: a trust-on-first-use record belongs to
// an entry for as long as the allowlist has it.
type Matcher struct {
	Client    kubernetes.Interface
	ConfigMap types.NamespacedName
}

// MatchMachine implements engine.Machines.
func (m *Matcher) MatchMachine(ctx context.Context, nodeName, providerID string) (*engine.Machine, error) {
	e, err := m.entry(ctx, nodeName)
	if err != nil {
		return nil, err
	}
	if e.ProviderID != providerID {
		return nil, &attestor.DenyError{Reason: attestor.ReasonAllowlistProviderIDMismatch, Message: fmt.Sprintf(
			"node %q is allowed with provider ID %q, not %q (allowlist %s)", nodeName, e.ProviderID, providerID, m.ConfigMap)}
	}
	return m.machine(ctx, e)
}

// ForNode implements engine.Machines: the allowlist entry of the node.
func (m *Matcher) ForNode(ctx context.Context, nodeName string) (*engine.Machine, error) {
	e, err := m.entry(ctx, nodeName)
	if err != nil {
		return nil, err
	}
	return m.machine(ctx, e)
}

// machinePrefix starts the name an entry goes by as a Machine (in
// messages and trust-on-first-use records).
const machinePrefix = "allowlist."

func (m *Matcher) machine(ctx context.Context, e *Entry) (*engine.Machine, error) {
	joined, err := m.joined(ctx, e.NodeName)
	if err != nil {
		return nil, err
	}
	ips := make([]net.IP, 0, len(e.IPs))
	for _, ip := range e.IPs {
		ips = append(ips, net.ParseIP(ip)) // valid: ParseAllowlist checked
	}
	return &engine.Machine{
		Namespace: m.ConfigMap.Namespace, Name: machinePrefix + e.NodeName, UID: m.entryUID(e),
		ProviderID: e.ProviderID, Annotations: e.Annotations, Identity: e.Identity, Joined: joined,
		DNSNames: e.DNSNames, IPs: ips, Description: fmt.Sprintf("allowlist entry %s of ConfigMap %s", e.NodeName, m.ConfigMap),
	}, nil
}

// entryUID is the UID of an allowlist entry as a Machine.
func (m *Matcher) entryUID(e *Entry) types.UID {
	h := sha256.Sum256([]byte(m.ConfigMap.String() + "\x00" + e.NodeName + "\x00" + e.ProviderID))
	return types.UID("allowlist-" + hex.EncodeToString(h[:16]))
}

// joined reports whether the cluster has a Node named nodeName: the node
// registered, and a bootstrap token cannot ask for its identity again.
func (m *Matcher) joined(ctx context.Context, nodeName string) (bool, error) {
	_, err := m.Client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	switch {
	case err == nil:
		return true, nil
	case apierrors.IsNotFound(err):
		return false, nil
	}
	return false, fmt.Errorf("unable to read Node %q: %w", nodeName, err)
}

// OwnerExists implements tofu.Owners: the allowlist still has the entry
// whose UID a record names. An allowlist that cannot be read is an error,
// never a reason to give an identity up.
func (m *Matcher) OwnerExists(ctx context.Context, owner types.NamespacedName, uid types.UID) (bool, error) {
	node, ok := strings.CutPrefix(owner.Name, machinePrefix)
	if !ok || owner.Namespace != m.ConfigMap.Namespace {
		return false, nil
	}
	e, err := m.entry(ctx, node)
	if len(attestor.Denials(err)) > 0 {
		return false, nil // not in the allowlist any more
	}
	if err != nil {
		return false, err
	}
	return m.entryUID(e) == uid, nil
}

// read reads and parses the allowlist. A missing or invalid one is an
// error (retried), never a denial.
func (m *Matcher) read(ctx context.Context) (*Allowlist, error) {
	cm, err := m.Client.CoreV1().ConfigMaps(m.ConfigMap.Namespace).Get(ctx, m.ConfigMap.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("allowlist ConfigMap %s does not exist: create it", m.ConfigMap)
	}
	if err != nil {
		return nil, fmt.Errorf("unable to read the allowlist ConfigMap %s: %w", m.ConfigMap, err)
	}
	a, err := ParseAllowlist([]byte(cm.Data[AllowlistKey]))
	if err != nil {
		return nil, fmt.Errorf("ConfigMap %s key %s: %w", m.ConfigMap, AllowlistKey, err)
	}
	return a, nil
}

// entry reads the allowlist (on every request, so an edit takes effect at
// once) and returns the node's entry.
func (m *Matcher) entry(ctx context.Context, nodeName string) (*Entry, error) {
	a, err := m.read(ctx)
	if err != nil {
		return nil, err
	}
	for i := range a.Nodes {
		if a.Nodes[i].NodeName == nodeName {
			return &a.Nodes[i], nil
		}
	}
	return nil, &attestor.DenyError{Reason: attestor.ReasonNodeNotAllowed, Message: fmt.Sprintf(
		"node %q is not in the allowlist %s: add an entry {nodeName, providerID} to key %s", nodeName, m.ConfigMap, AllowlistKey)}
}

// LoadCA loads the CA from PEM files, or, when secret is set, from the
// tls.crt and tls.key keys of that Secret.
func LoadCA(ctx context.Context, c kubernetes.Interface, certFile, keyFile string, secret types.NamespacedName) (*issue.CA, error) {
	if secret.Name != "" {
		s, err := c.CoreV1().Secrets(secret.Namespace).Get(ctx, secret.Name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("unable to read the CA secret %s: %w", secret, err)
		}
		ca, err := issue.LoadCA(s.Data[issue.SecretCertKey], s.Data[issue.SecretKeyKey])
		if err != nil {
			return nil, fmt.Errorf("CA secret %s: %w", secret, err)
		}
		return ca, nil
	}
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, fmt.Errorf("unable to read the CA certificate: %w", err)
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, fmt.Errorf("unable to read the CA key: %w", err)
	}
	return issue.LoadCA(certPEM, keyPEM)
}
