package controller

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// Results of a verification, as reported to VerificationMetrics.
const (
	VerifyResultVerified   = "verified"
	VerifyResultChallenged = "challenged"
	VerifyResultDenied     = "denied"
	VerifyResultError      = "error"
)

// SeenMetrics counts the pending CSRs of the controller's signer names it
// sees (once per CSR and informer start). The Metrics implementation may
// implement it.
type SeenMetrics interface {
	Seen(cluster, signerName string)
}

// SignedMetrics counts the certificates the controller issued. The Metrics
// implementation may implement it.
type SignedMetrics interface {
	Signed(cluster, provider string)
}

// VerificationMetrics observes how long each attestor's verifier took, by
// result (VerifyResult*). The Metrics implementation may implement it.
type VerificationMetrics interface {
	Verified(provider, result string, took time.Duration)
}

// Recorder records each decision where the people who run the fleet look
// for it: a Kubernetes Event on the Machine (package capi). machine is nil
// when the request matched none; decision is DecisionApproved,
// DecisionDenied or DecisionFailed. Implementations must not block and may
// drop or aggregate records.
type Recorder interface {
	Decided(csr string, machine *Machine, decision, reason, message string)
}

func (c *Controller) seen(signerName string) {
	if m, ok := c.cfg.Metrics.(SeenMetrics); ok {
		m.Seen(c.cfg.Cluster, signerName)
	}
}

func (c *Controller) signed(provider string) {
	if m, ok := c.cfg.Metrics.(SignedMetrics); ok {
		m.Signed(c.cfg.Cluster, provider)
	}
}

func (c *Controller) verified(provider, result string, since time.Time) {
	if m, ok := c.cfg.Metrics.(VerificationMetrics); ok {
		m.Verified(provider, result, time.Since(since))
	}
}

func (c *Controller) record(csr string, machine *Machine, decision, reason, message string) {
	if c.cfg.Events != nil {
		c.cfg.Events.Decided(csr, machine, decision, reason, message)
	}
}

// withMachine adds the Machine's name to the logger of ctx, so that every
// decision about a request that matched one says which.
func withMachine(ctx context.Context, m *Machine) context.Context {
	if m == nil {
		return ctx
	}
	return klog.NewContext(ctx, klog.FromContext(ctx).WithValues("machine", types.NamespacedName{Namespace: m.Namespace, Name: m.Name}))
}
