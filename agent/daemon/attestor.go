package daemon

import (
	"context"
	"time"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Instrument returns an attestor that behaves like a and calls observe
// with the duration and error of every Attest and Respond call. It keeps
// the optional interfaces (attestor.Responder, attestor.Annotator) a has,
// and only those.
func Instrument(a attestor.Attestor, observe func(time.Duration, error)) attestor.Attestor {
	t := &timed{Attestor: a, observe: observe}
	resp, isResp := a.(attestor.Responder)
	ann, isAnn := a.(attestor.Annotator)
	switch {
	case isResp && isAnn:
		return struct {
			*timed
			attestor.Responder
			attestor.Annotator
		}{t, &timedResponder{resp, observe}, ann}
	case isResp:
		return struct {
			*timed
			attestor.Responder
		}{t, &timedResponder{resp, observe}}
	case isAnn:
		return struct {
			*timed
			attestor.Annotator
		}{t, ann}
	default:
		return t
	}
}

type timed struct {
	attestor.Attestor
	observe func(time.Duration, error)
}

func (t *timed) Attest(ctx context.Context, req *attestor.Request) (attestor.Evidence, error) {
	start := time.Now()
	ev, err := t.Attestor.Attest(ctx, req)
	t.observe(time.Since(start), err)
	return ev, err
}

type timedResponder struct {
	r       attestor.Responder
	observe func(time.Duration, error)
}

func (t *timedResponder) Respond(ctx context.Context, req *attestor.Request, ch *attestor.Challenge) (attestor.Evidence, error) {
	start := time.Now()
	ev, err := t.r.Respond(ctx, req, ch)
	t.observe(time.Since(start), err)
	return ev, err
}
