package engine

import (
	"fmt"
	"maps"
	"slices"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
)

// ProfileSet says which signer names a controller serves.
type ProfileSet struct {
	// Verifiers are the providers the controller knows, by name.
	Verifiers map[string]attestor.Verifier
	// ClientOnly names the providers that may issue client certificates
	// only, and register each node once (insecure: it proves nothing a
	// serving certificate or a second registration could rest on).
	ClientOnly []string
	// Client signs client certificates (the cluster's client CA).
	Client CertificateSigner
	// Serving signs attested serving certificates (the managed serving CA);
	// nil serves no attested serving signer names.
	Serving CertificateSigner
	// KubeletServing approves kubelet's own kubernetes.io/kubelet-serving
	// requests (kube-controller-manager signs them).
	KubeletServing bool
}

// Profiles returns the profiles of a ProfileSet, in a stable order.
func Profiles(s ProfileSet) []*Profile {
	var out []*Profile
	for _, p := range slices.Sorted(maps.Keys(s.Verifiers)) {
		v := s.Verifiers[p]
		out = append(out, &Profile{SignerName: attestor.ClientSignerName(p), Kind: checks.Client, Provider: p, Verifier: v, Signer: s.Client,
			JoinOnce: slices.Contains(s.ClientOnly, p)})
		if s.Serving == nil {
			continue
		}
		serving := &Profile{SignerName: attestor.ServingSignerName(p), Kind: checks.Serving, Provider: p, Verifier: v, Signer: s.Serving}
		if slices.Contains(s.ClientOnly, p) {
			serving = &Profile{SignerName: serving.SignerName, Kind: checks.Serving, Provider: p, Refused: fmt.Sprintf(
				"attestor %q issues client certificates only: "+
					"it proves nothing beyond a bootstrap token and the provider ID it claims, so it never vouches for a serving certificate; "+
					"use a hardware or cloud attestor for serving certificates",
				p)}
		}
		out = append(out, serving)
	}
	if s.KubeletServing {
		out = append(out, &Profile{SignerName: certificatesv1.KubeletServingSignerName, Kind: checks.Serving})
	}
	return out
}

// Authorizes reports whether a Cluster authorizing the providers
// authorized lets requests to p's signer name through to its checks:
// kubelet's own signer names belong to no provider.
func (p *Profile) Authorizes(authorized []string) bool {
	return p.Provider == "" || slices.Contains(authorized, p.Provider)
}

// Serves reports whether a request to p's signer name can be signed or
// approved, given the authorized providers: refused signer names and those
// of providers not authorized are denied whatever the request holds.
func (p *Profile) Serves(authorized []string) bool {
	return p.Refused == "" && p.Authorizes(authorized)
}
