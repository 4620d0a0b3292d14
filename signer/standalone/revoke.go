package standalone

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
)

// DefaultRevocationPeriod is how often the allowlist is compared with the
// certificates issued.
const DefaultRevocationPeriod = 30 * time.Second

// Revocations revokes the node name of an allowlist entry once the entry
// is taken out (or given another provider ID: the machine was replaced),
// as Cluster API mode does when a Machine is deleted (package revoke): the
// certificates issued to the entry are refused by the cluster's admission
// policy until they expire, while those issued to a live entry of the same
// name stay valid. It is the controller's IssueHook, which records every
// certificate before it is handed out.
type Revocations struct {
	Matcher *Matcher
	Revoker *revoke.Revoker
}

// Issuing implements controller.IssueHook.
func (r *Revocations) Issuing(ctx context.Context, node string, m *engine.Machine, cert *x509.Certificate, att revoke.Attestation) error {
	if m == nil || m.UID == "" {
		return errors.New("no allowlist entry matched")
	}
	_, err := r.Revoker.Accept(ctx, node, revoke.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID, Source: revoke.SourceAllowlist}, cert, att)
	if revoke.Unenforceable(err) {
		klog.FromContext(ctx).Info("Issuing without checking the revoked node names", "node", node, "err", err.Error())
		return nil
	}
	return err
}

// Denying implements controller.IssueHook: the denial of node's renewal
// is recorded before it is written (revoke.Revoker.Deny).
func (r *Revocations) Denying(ctx context.Context, node, request, reason string) error {
	err := r.Revoker.Deny(ctx, node, request, reason)
	if revoke.Unenforceable(err) {
		klog.FromContext(ctx).Info("Denying without recording the denial", "node", node, "err", err.Error())
		return nil
	}
	return err
}

// Sync revokes the node names of the certificates issued to entries the
// allowlist no longer has, and keeps the admission policy as written. An
// allowlist it cannot read revokes nothing. It returns the names revoked.
func (r *Revocations) Sync(ctx context.Context) ([]string, error) {
	s, _, err := r.Revoker.Ensure(ctx)
	if err != nil {
		return nil, fmt.Errorf("unable to keep the revoked node names: %w", err)
	}
	a, err := r.Matcher.read(ctx)
	if err != nil {
		return nil, err
	}
	live := map[string]types.UID{}
	for i := range a.Nodes {
		live[a.Nodes[i].NodeName] = r.Matcher.entryUID(&a.Nodes[i])
	}
	gone := map[revoke.Machine][]string{}
	for _, c := range s.Issued {
		node, ours := strings.CutPrefix(c.Machine.Name, machinePrefix)
		if !ours || c.Machine.Source != revoke.SourceAllowlist || c.Machine.Namespace != r.Matcher.ConfigMap.Namespace || live[node] == c.Machine.UID {
			continue
		}
		if !slices.Contains(gone[c.Machine], c.Node) {
			gone[c.Machine] = append(gone[c.Machine], c.Node)
		}
	}
	claims := func(node string, uid types.UID) bool { return live[node] != "" && live[node] == uid }
	var revoked []string
	var errs []error
	for m, names := range gone {
		_, listed, err := r.Revoker.Revoke(ctx, m, names, claims)
		if err != nil {
			errs = append(errs, fmt.Errorf("unable to revoke the node names of %s: %w", m, err))
			continue
		}
		klog.FromContext(ctx).Info("Revoked the node names of an entry taken out of the allowlist", "entry", m.String(), "nodes", listed)
		revoked = append(revoked, listed...)
	}
	return revoked, errors.Join(errs...)
}

// Run calls Sync at once and every period (0: DefaultRevocationPeriod)
// until ctx is done.
func (r *Revocations) Run(ctx context.Context, period time.Duration) {
	if period <= 0 {
		period = DefaultRevocationPeriod
	}
	logger := klog.FromContext(ctx)
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		if _, err := r.Sync(ctx); err != nil && ctx.Err() == nil {
			logger.Error(err, "Revocation of the entries taken out of the allowlist incomplete; next try in a period")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
