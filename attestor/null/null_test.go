//go:build testattestors

package null

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/attestortest"
)

func TestRoundTrip(t *testing.T) {
	ctx := context.Background()
	binding := attestor.Binding([]byte("spki"))
	const pid = "test:///fleet/node-1"
	for _, tc := range []struct {
		name               string
		node, signer       []string
		stable             string
		version, want      string
		wantStable         string
		wantAttestErr      string
		wantDenial         string
		wantVersionsNode   []string
		wantVersionsSigner []string
	}{
		{name: "defaults", want: "v1", wantVersionsNode: []string{"v1"}, wantVersionsSigner: []string{"v1"}},
		{name: "newest first", node: []string{"v2", "v1"}, signer: []string{"v2", "v1"}, want: "v2",
			wantVersionsNode: []string{"v2", "v1"}, wantVersionsSigner: []string{"v2", "v1"}},
		{name: "asked for an older one", node: []string{"v2", "v1"}, signer: []string{"v1"}, version: "v1", want: "v1",
			wantVersionsNode: []string{"v2", "v1"}, wantVersionsSigner: []string{"v1"}},
		{name: "stable identity", stable: "machine-7", want: "v1", wantStable: "null:machine-7",
			wantVersionsNode: []string{"v1"}, wantVersionsSigner: []string{"v1"}},
		{name: "version the node cannot produce", node: []string{"v1"}, version: "v2", wantAttestErr: `cannot produce evidence version "v2"`},
		{name: "version the signer does not accept", node: []string{"v2"}, signer: []string{"v1"}, want: "v2", wantDenial: attestor.ReasonUnsupportedEvidenceVersion},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, err := NewAttestor(tc.node, tc.stable)
			if err != nil {
				t.Fatal(err)
			}
			v, err := NewVerifier(tc.signer)
			if err != nil {
				t.Fatal(err)
			}
			if tc.wantVersionsNode != nil && !slices.Equal(a.Versions(), tc.wantVersionsNode) {
				t.Errorf("node versions %q, want %q", a.Versions(), tc.wantVersionsNode)
			}
			if tc.wantVersionsSigner != nil && !slices.Equal(v.Versions(), tc.wantVersionsSigner) {
				t.Errorf("signer versions %q, want %q", v.Versions(), tc.wantVersionsSigner)
			}
			ev, err := a.Attest(ctx, &attestor.Request{NodeName: "node-1", ProviderID: pid, Binding: binding, Version: tc.version})
			if tc.wantAttestErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantAttestErr) {
					t.Fatalf("Attest error %v, want %q", err, tc.wantAttestErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got, err := attestor.EvidenceVersion(ev.Evidence)
			if err != nil || got != tc.want {
				t.Fatalf("evidence version %q (%v), want %q", got, err, tc.want)
			}
			res, err := v.Verify(ctx, &attestor.VerifyRequest{Evidence: ev.Evidence, Version: got, Binding: binding, NodeName: "node-1", ProviderID: pid})
			if tc.wantDenial != "" {
				if d, ok := attestor.AsDenial(err); !ok || d.Reason != tc.wantDenial {
					t.Fatalf("Verify = %v, want denial %s", err, tc.wantDenial)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if res.Identity == nil || res.Identity.ProviderID != pid || res.Identity.Stable != tc.wantStable {
				t.Fatalf("identity %+v, want provider ID %q, stable %q", res.Identity, pid, tc.wantStable)
			}
		})
	}
}

func TestVerifyDenies(t *testing.T) {
	ctx := context.Background()
	v, err := NewVerifier(nil)
	if err != nil {
		t.Fatal(err)
	}
	good, _ := json.Marshal(Evidence{Version: "v1", ProviderID: "test:///a"})
	for _, tc := range []struct {
		name, providerID string
		evidence         string
		reason           string
	}{
		{"other provider ID", "test:///b", string(good), attestor.ReasonAttestedProviderIDMismatch},
		{"not JSON", "test:///a", `{`, attestor.ReasonMalformedEvidence},
		{"unknown field", "test:///a", `{"version":"v1","providerID":"test:///a","extra":1}`, attestor.ReasonEvidenceUnknownField},
		{"trailing data", "test:///a", string(good) + `{}`, attestor.ReasonEvidenceTrailingData},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := v.Verify(ctx, &attestor.VerifyRequest{Evidence: attestor.Evidence(tc.evidence), Version: "v1", ProviderID: tc.providerID})
			if d, ok := attestor.AsDenial(err); !ok || d.Reason != tc.reason {
				t.Fatalf("Verify = %v, want denial %s", err, tc.reason)
			}
		})
	}
}

func TestConfigErrors(t *testing.T) {
	for _, versions := range [][]string{{""}, {"v1", "v1"}, {"v1,v2"}} {
		if _, err := NewAttestor(versions, ""); err == nil {
			t.Errorf("NewAttestor(%q) accepted", versions)
		}
		if _, err := NewVerifier(versions); err == nil {
			t.Errorf("NewVerifier(%q) accepted", versions)
		}
	}
	if _, err := (&Attestor{versions: []string{"v1"}}).Attest(context.Background(), &attestor.Request{}); err == nil {
		t.Error("Attest without a provider ID succeeded")
	}
}

func TestConformance(t *testing.T) {
	v, err := NewVerifier(nil)
	if err != nil {
		t.Fatal(err)
	}
	attestortest.Conformance(t, attestortest.Provider{
		Name: Name,
		NewAttestor: func(tb testing.TB) attestor.Attestor {
			a, err := NewAttestor(nil, "machine-1")
			if err != nil {
				tb.Fatal(err)
			}
			return a
		},
		Verifier:   v,
		NodeName:   "node-1",
		ProviderID: "test:///fleet/node-1",
		Unbound:    true,
		WantStable: "null:machine-1",
	})
}
