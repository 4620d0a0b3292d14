package tpm

import (
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// TestGoldenPolicyAdmitsItsBootOnly: the policy the image builder prints
// for a real boot admits that boot (quoted by the soft TPM, log attached)
// and denies another image's boot rule by rule.
func TestGoldenPolicyAdmitsItsBootOnly(t *testing.T) {
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
	for _, c := range []struct {
		golden, other string
		reasons       []string
	}{
		{softLog, "ubuntu-2104-no-secure-boot.bin", []string{ReasonPCRValueNotAllowed, ReasonSecureBootDisabled, ReasonBootLoaderNotAllowed, ReasonBootLoaderNotAllowed, ReasonKernelNotAllowed}},
		{"ubuntu-2104-no-secure-boot.bin", "ubuntu-2104-no-dbx.bin", []string{ReasonPCRValueNotAllowed, ReasonBootLoaderNotAllowed, ReasonKernelNotAllowed, ReasonDbxOutdated}},
	} {
		t.Run(c.golden, func(t *testing.T) {
			p, st, err := GoldenPolicy(realEventLog(t, c.golden), GoldenOptions{Pin: []int{4}})
			if err != nil {
				t.Fatal(err)
			}
			doc := p.YAML(st)
			t.Logf("%s", doc)
			if _, err := ParsePolicy(doc); err != nil {
				t.Fatalf("the printed policy does not parse: %v", err)
			}
			for _, boot := range []string{c.golden, c.other} {
				e := newEngine(v, nil)
				e.policy = doc
				key := newKey(t)
				csrDER, _ := csrFor(t, key, testNode, testProviderID)
				_, err := e.verify(t, e.file(t, "csr-1", csrDER, evidenceOf(t, VersionV2, soft.quoteBoot(t, key, realEventLog(t, boot), "sha256", softIndices), nil), nil))
				if boot == c.golden {
					if err != nil {
						t.Fatalf("the golden policy denies its own boot: %v", err)
					}
					continue
				}
				if got := denials(err); strings.Join(got, ",") != strings.Join(c.reasons, ",") {
					t.Errorf("%s under %s's policy: %v, want %v", boot, c.golden, err, c.reasons)
				}
			}
		})
	}
}

func denials(err error) []string {
	var out []string
	for _, d := range attestor.Denials(err) {
		out = append(out, d.Reason)
	}
	return out
}
