package controller

import (
	"context"
	"encoding/json"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

// bound is a one-round verifier with a key-bound version (v1) and a
// cluster-bound one (v2), as the cloud providers have.
type bound struct{ calls int }

func (*bound) Versions() []string               { return []string{"v2", "v1"} }
func (*bound) ClusterBound(version string) bool { return version == "v2" }
func (b *bound) Verify(_ context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	b.calls++
	var ev challengeEvidence
	if err := json.Unmarshal(in.Evidence, &ev); err != nil {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "%v", err)
	}
	return &attestor.Result{Identity: &attestor.Identity{ProviderID: ev.ProviderID, Stable: "fake:" + in.NodeName}}, nil
}

// TestRequireClusterBinding: a Cluster that requires cluster-bound
// evidence denies key-bound evidence UnsupportedEvidenceVersion, without
// a verifier call, naming only the cluster-bound versions in
// supported-versions (where the node reads the version to file anew in),
// and issues for cluster-bound evidence; a Cluster that does not require
// it accepts both.
func TestRequireClusterBinding(t *testing.T) {
	for _, tc := range []struct {
		name    string
		require bool
		version string
		want    string
	}{
		{"required, key-bound evidence", true, "v1", "Denied/" + attestor.ReasonUnsupportedEvidenceVersion},
		{"required, cluster-bound evidence", true, "v2", "Approved/" + attestor.ReasonAttestationVerified},
		{"not required, key-bound evidence", false, "v1", "Approved/" + attestor.ReasonAttestationVerified},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := &bound{}
			r := newRig(t, false, func(c *Config) {
				c.Engine.Profiles = engine.Profiles(engine.ProfileSet{
					Verifiers: map[string]attestor.Verifier{"fake": v},
					Client:    c.Engine.Profiles[0].Signer,
					Serving:   c.Engine.Profiles[1].Signer,
				})
				c.Engine.RequireClusterBinding = tc.require
			})
			r.file("csr", signertest.Request{NodeName: "node-1", ProviderID: pid}, challengeEvidence{Version: tc.version, ProviderID: pid})
			if _, err := r.sync("csr"); err != nil {
				t.Fatal(err)
			}
			got := r.get("csr")
			if c := cond(got); c != tc.want {
				t.Fatalf("%s, want %s", c, tc.want)
			}
			if tc.want[:6] != "Denied" {
				return
			}
			if s := got.Annotations[attestor.AnnotationSupportedVersions]; s != "v2" {
				t.Errorf("supported-versions %q, want v2", s)
			}
			if v.calls != 0 {
				t.Errorf("the verifier was called %d times", v.calls)
			}
		})
	}
}
