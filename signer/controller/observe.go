package controller

import (
	"time"

	"sigs.k8s.io/kubelet-authenticator/signer/engine"
)

// Metrics records decisions. Implementations must be safe for concurrent
// use. An implementation may also implement SeenMetrics, SignedMetrics and
// VerificationMetrics.
type Metrics interface {
	Decision(cluster, decision, reason string)
}

// SeenMetrics counts the pending CSRs of the controller's signer names it
// sees (once per CSR and controller start).
type SeenMetrics interface {
	Seen(cluster, signerName string)
}

// SignedMetrics counts the certificates the controller issued.
type SignedMetrics interface {
	Signed(cluster, provider string)
}

// VerificationMetrics observes how long each attestor's verifier took, by
// result (engine.VerifyResult*).
type VerificationMetrics interface {
	Verified(provider, result string, took time.Duration)
}

// Recorder records each decision where the people who run the fleet look
// for it: the Cluster's status, and a Kubernetes Event on the Machine for
// a denial or failure (package capi). machine is nil
// when the request matched none; decision is DecisionApproved,
// DecisionDenied or DecisionFailed. Implementations must not block and may
// drop or aggregate records.
type Recorder interface {
	Decided(csr string, machine *engine.Machine, decision, reason, message string)
}

func (c *Controller) metric(decision, reason string) {
	if c.cfg.Metrics != nil {
		c.cfg.Metrics.Decision(c.cfg.Cluster, decision, reason)
	}
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

func (c *Controller) verified(v *engine.Verification) {
	if m, ok := c.cfg.Metrics.(VerificationMetrics); ok {
		m.Verified(v.Provider, v.Result, v.Took)
	}
}

func (c *Controller) record(csr string, machine *engine.Machine, decision, reason, message string) {
	if c.cfg.Events != nil {
		c.cfg.Events.Decided(csr, machine, decision, reason, message)
	}
}
