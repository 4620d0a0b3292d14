package daemon

import (
	"context"
	"time"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Instrument returns an attestor that behaves like a and calls observe
// with the duration and error of every Attest and Respond call. It is an
// attestor.Responder only when a is one.
func Instrument(a attestor.Attestor, observe func(time.Duration, error)) attestor.Attestor {
	t := &timed{Attestor: a, observe: observe}
	if resp, ok := a.(attestor.Responder); ok {
		return struct {
			*timed
			attestor.Responder
		}{t, &timedResponder{resp, observe}}
	}
	return t
}

type timed struct {
	attestor.Attestor
	observe func(time.Duration, error)
}

func (t *timed) Attest(ctx context.Context, req *attestor.Request) (*attestor.Attestation, error) {
	start := time.Now()
	att, err := t.Attestor.Attest(ctx, req)
	t.observe(time.Since(start), err)
	return att, err
}

type timedResponder struct {
	r       attestor.Responder
	observe func(time.Duration, error)
}

func (t *timedResponder) Respond(ctx context.Context, req *attestor.Request, ch *attestor.Challenge) (*attestor.Attestation, error) {
	start := time.Now()
	att, err := t.r.Respond(ctx, req, ch)
	t.observe(time.Since(start), err)
	return att, err
}
