package tpm

import (
	"context"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

const policyHeader = "apiVersion: kubelet-authenticator.x-k8s.io/v1alpha1\nkind: TPMBootPolicy\n"

func TestParsePolicyReportsEveryProblem(t *testing.T) {
	doc := `apiVersion: v1
kind: Policy
pcrs: {bank: md5, indices: [3, 3, 24]}
allowedKernelDigests: [xyz]
kernelCommandLine: {required: [quiet, "a b"], forbidden: [quiet]}
dbx: {minEntries: -1}
pcrValues: [{index: 5, digest: "00"}]
`
	_, err := ParsePolicy([]byte(doc))
	if err == nil {
		t.Fatal("an invalid policy was accepted")
	}
	for _, want := range []string{`apiVersion is "v1"`, `kind is "Policy"`, `"md5"`, "3 is listed twice", "24 is not a PCR",
		`"xyz"`, `"a b"`, `"quiet" is both required and forbidden`, "minEntries is negative", "PCR 5 is not in pcrs.indices",
		"lacks PCR 8"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not report %q", err, want)
		}
	}
	for _, doc := range []string{
		policyHeader + "requireSecureBoot: true\nrequireSecureBoot: false\n",
		policyHeader + "requireSecureboot: true\n",
		policyHeader + "pcrs: {bank: sha256, indices: [0]}\npcrValues: [{index: 0, digest: abcd}]\n",
		policyHeader + "pcrValues: [{index: 0, digest: abcd}]\n",
		policyHeader + "pcrs: {bank: sha512, indices: [7]}\nrequireSecureBoot: true\n",
	} {
		if _, err := ParsePolicy([]byte(doc)); err == nil {
			t.Errorf("policy accepted:\n%s", doc)
		}
	}
	p, err := ParsePolicy([]byte(`{"apiVersion":"kubelet-authenticator.x-k8s.io/v1alpha1","kind":"TPMBootPolicy","requireSecureBoot":true,"allowedKernelDigests":["` + strings.Repeat("AB", 32) + `"]}`))
	if err != nil || !p.RequireSecureBoot || p.AllowedKernelDigests[0] != strings.Repeat("ab", 32) {
		t.Fatalf("JSON policy: %+v, %v", p, err)
	}
}

// TestPolicyThatDoesNotParseIsTransient: the operator's mistake never
// denies a node; the request waits until the policy is fixed.
func TestPolicyThatDoesNotParseIsTransient(t *testing.T) {
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	e := newEngine(newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters}), nil)
	e.policy = []byte(policyHeader + "requireSecureBoot: yes please\n")
	key := newKey(t)
	csrDER, _ := csrFor(t, key, testNode, testProviderID)
	_, err := e.verify(t, e.file(t, "csr-1", csrDER, evidenceOf(t, VersionV2, soft.quote(t, key), nil), nil))
	if err == nil {
		t.Fatal("verified under a policy that does not parse")
	}
	if _, ok := attestor.AsDenial(err); ok {
		t.Fatalf("a policy that does not parse denied the request: %v", err)
	}
}

// bootOf is the boot state a real log yields on the soft TPM's selection.
func bootOf(t *testing.T, name string) *BootState {
	t.Helper()
	raw := realEventLog(t, name)
	st, err := ReplayEventLog(raw, bootPCRs(t, raw, "sha256", softIndices))
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestBootPolicy runs real boots (go-tpm-tools' event logs, quoted by the
// soft TPM) through the verifier under policies, rule by rule.
func TestBootPolicy(t *testing.T) {
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
	const sb, noSB = softLog, "ubuntu-2104-no-secure-boot.bin"
	st := bootOf(t, sb)
	if !st.SecureBoot || st.KernelDigest == "" || len(st.BootApplications) != 3 || st.DBX.Entries() == 0 {
		t.Fatalf("the Secure Boot log yields %+v", st)
	}
	otherKernel := strings.Repeat("ab", 32)
	pcr4 := ""
	for _, p := range bootPCRs(t, realEventLog(t, sb), "sha256", []int{4}) {
		pcr4 = hex.EncodeToString(p.Digest)
	}
	list := func(ds []string) string { return "[" + strings.Join(ds, ", ") + "]" }
	sel := "pcrs: {bank: sha256, indices: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}\n"

	type evidence struct {
		version string
		log     string // real log booted; "" quotes that boot without sending its log
		edit    func(t *testing.T, raw []byte) []byte
	}
	v2 := func(log string) evidence { return evidence{version: VersionV2, log: log} }
	for _, c := range []struct {
		name   string
		policy string // "" for none
		ev     evidence
		// reasons are the denials expected, in order; none for a challenge.
		reasons []string
		// mention is in the message of the first denial.
		mention string
	}{
		{name: "no policy, Secure Boot", ev: v2(sb)},
		{name: "no policy, no Secure Boot", ev: v2(noSB)},
		{name: "no policy, v1", ev: evidence{version: VersionV1}},
		{name: "no policy, v2 without a log", ev: evidence{version: VersionV2}},
		{name: "empty policy, v1", policy: policyHeader, ev: evidence{version: VersionV1}},
		{name: "requireSecureBoot, Secure Boot", policy: "requireSecureBoot: true\n", ev: v2(sb)},
		{name: "requireSecureBoot, no Secure Boot", policy: "requireSecureBoot: true\n", ev: v2(noSB), reasons: []string{ReasonSecureBootDisabled}},
		{name: "requireBootState, v1", policy: "requireBootState: true\n", ev: evidence{version: VersionV1}, reasons: []string{attestor.ReasonUnsupportedEvidenceVersion}},
		{name: "requireSecureBoot, v1", policy: "requireSecureBoot: true\n", ev: evidence{version: VersionV1}, reasons: []string{attestor.ReasonUnsupportedEvidenceVersion}},
		{name: "requireBootState, v2 without a log", policy: "requireBootState: true\n", ev: evidence{version: VersionV2}, reasons: []string{ReasonBootStateRequired}},
		{name: "pinned PCR, v2 without a log", policy: sel + "pcrValues: [{index: 4, digest: " + pcr4 + "}]\n", ev: evidence{version: VersionV2}},
		{name: "pinned PCR, other value", policy: sel + "pcrValues: [{index: 4, digest: " + otherKernel + "}]\n", ev: v2(noSB), reasons: []string{ReasonPCRValueNotAllowed}, mention: otherKernel},
		{name: "selection", policy: sel, ev: v2(sb)},
		{name: "another selection", policy: "pcrs: {bank: sha256, indices: [0, 2, 4, 7]}\n", ev: v2(sb), reasons: []string{ReasonPCRSelectionMismatch}},
		{name: "another bank", policy: "pcrs: {bank: sha384, indices: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}\n", ev: v2(sb), reasons: []string{ReasonPCRSelectionMismatch}},
		{name: "allowed kernel", policy: "allowedKernelDigests: [" + otherKernel + ", " + st.KernelDigest + "]\n", ev: v2(sb)},
		{name: "kernel not allowed", policy: "allowedKernelDigests: [" + otherKernel + "]\n", ev: v2(sb), reasons: []string{ReasonKernelNotAllowed}, mention: st.KernelDigest},
		{name: "allowed boot loaders", policy: "allowedBootLoaderDigests: " + list(st.BootApplications) + "\n", ev: v2(sb)},
		{name: "boot loader not allowed", policy: "allowedBootLoaderDigests: " + list(st.BootApplications[:2]) + "\n", ev: v2(sb), reasons: []string{ReasonBootLoaderNotAllowed}, mention: st.BootApplications[2]},
		{name: "required and forbidden kernel arguments", policy: "kernelCommandLine: {required: [ro, net.ifnames=0], forbidden: [init, single]}\n", ev: v2(sb)},
		{name: "missing kernel argument", policy: "kernelCommandLine: {required: [ro, lockdown=integrity]}\n", ev: v2(sb), reasons: []string{ReasonKernelCommandLineNotAllowed}, mention: "lockdown=integrity"},
		{name: "forbidden kernel argument", policy: "kernelCommandLine: {forbidden: [crashkernel]}\n", ev: v2(sb), reasons: []string{ReasonKernelCommandLineNotAllowed}, mention: "crashkernel=auto"},
		{name: "dbx up to date", policy: fmt.Sprintf("dbx: {minEntries: %d, requiredHashes: [%s]}\n", st.DBX.Entries(), st.DBX.Hashes[0]), ev: v2(sb)},
		{name: "dbx too small", policy: fmt.Sprintf("dbx: {minEntries: %d}\n", st.DBX.Entries()+1), ev: v2(sb), reasons: []string{ReasonDbxOutdated}},
		{name: "dbx without a revocation", policy: "dbx: {requiredHashes: [" + otherKernel + "]}\n", ev: v2(sb), reasons: []string{ReasonDbxOutdated}, mention: otherKernel},
		{name: "no dbx", policy: "dbx: {minEntries: 1}\n", ev: v2("ubuntu-2104-no-dbx.bin"), reasons: []string{ReasonDbxOutdated}},
		{name: "every violated rule at once", ev: v2(noSB),
			policy:  "requireSecureBoot: true\nallowedKernelDigests: [" + otherKernel + "]\nkernelCommandLine: {required: [lockdown=integrity]}\ndbx: {minEntries: 1000}\n",
			reasons: []string{ReasonSecureBootDisabled, ReasonKernelNotAllowed, ReasonKernelCommandLineNotAllowed, ReasonDbxOutdated}},
		{name: "event dropped, no policy", ev: evidence{version: VersionV2, log: sb, edit: func(t *testing.T, raw []byte) []byte { return dropEvent(t, raw, 9) }},
			reasons: []string{ReasonEventLogMismatch}},
		{name: "event altered, no policy", ev: evidence{version: VersionV2, log: sb, edit: func(t *testing.T, raw []byte) []byte {
			d, _ := hex.DecodeString(st.KernelDigest)
			alt, _ := hex.DecodeString(otherKernel)
			return alterBytes(t, raw, d, alt)
		}}, reasons: []string{ReasonEventLogMismatch}},
		{name: "event dropped, kernel allowed", policy: "allowedKernelDigests: [" + st.KernelDigest + "]\n",
			ev:      evidence{version: VersionV2, log: sb, edit: func(t *testing.T, raw []byte) []byte { return dropEvent(t, raw, 4) }},
			reasons: []string{ReasonEventLogMismatch}},
		{name: "another boot's log", ev: evidence{version: VersionV2, log: sb, edit: func(t *testing.T, _ []byte) []byte { return realEventLog(t, noSB) }},
			reasons: []string{ReasonEventLogMismatch}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEngine(v, nil)
			if c.policy != "" {
				e.policy = []byte(c.policy)
				if !strings.HasPrefix(c.policy, "apiVersion") {
					e.policy = []byte(policyHeader + c.policy)
				}
			}
			key := newKey(t)
			var a *Attestation
			if c.ev.version == VersionV1 {
				a = soft.attest(t, key)
			} else {
				name := c.ev.log
				if name == "" {
					name = softLog
				}
				raw := realEventLog(t, name)
				a = soft.quoteBoot(t, key, raw, "sha256", softIndices)
				if c.ev.log == "" {
					a.EventLog = nil
				}
				if c.ev.edit != nil {
					a.EventLog = c.ev.edit(t, raw)
				}
			}
			csrDER, _ := csrFor(t, key, testNode, testProviderID)
			res, err := e.verify(t, e.file(t, "csr-1", csrDER, evidenceOf(t, c.ev.version, a, nil), nil))
			if len(c.reasons) == 0 {
				if err != nil || res.Challenge == nil {
					t.Fatalf("got %+v, %v; want a challenge", res, err)
				}
				return
			}
			ds := attestor.Denials(err)
			var got []string
			for _, d := range ds {
				got = append(got, d.Reason)
			}
			if !slices.Equal(got, c.reasons) {
				t.Fatalf("denials %v (%v), want %v", got, err, c.reasons)
			}
			if !strings.Contains(ds[0].Message, c.mention) {
				t.Errorf("denial %q does not name %q", ds[0].Message, c.mention)
			}
		})
	}
}

// TestBootPolicyAppliesToTheAnswer: the policy is checked again when the
// challenge is answered, as it stands then, with every denial kept.
func TestBootPolicyAppliesToTheAnswer(t *testing.T) {
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
	e := newEngine(v, nil)
	key := newKey(t)
	csrDER, csr := csrFor(t, key, testNode, testProviderID)
	a := soft.quoteBoot(t, key, realEventLog(t, "ubuntu-2104-no-secure-boot.bin"), "sha256", softIndices)
	first := e.file(t, "csr-1", csrDER, evidenceOf(t, VersionV2, a, nil), nil)
	if _, err := e.verify(t, first); err != nil {
		t.Fatal(err)
	}
	// The operator tightens the policy before the node answers.
	e.policy = []byte(policyHeader + "requireSecureBoot: true\ndbx: {minEntries: 1000}\n")
	second := e.file(t, "csr-2", csrDER, evidenceOf(t, VersionV2, nil, &Response{CSRName: first.name, Proof: make([]byte, 32)}), nil)
	req := e.request(second)
	req.Answered = first.round()
	_, err := v.Verify(context.Background(), req)
	ds := attestor.Denials(err)
	if len(ds) != 2 || ds[0].Reason != ReasonSecureBootDisabled || ds[1].Reason != ReasonDbxOutdated || !strings.Contains(ds[1].Message, first.name) {
		t.Fatalf("answer under the tightened policy: %v", err)
	}
	_ = csr
}

// TestLogOfAnotherBank: a log with only SHA-1 digests (Debian 10 on GCE)
// cannot be replayed against a SHA-256 quote. That contradicts nothing:
// without a policy the request goes on, and a policy that needs boot
// state says to quote the SHA-1 bank, under which the same boot passes.
func TestLogOfAnotherBank(t *testing.T) {
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
	debian := realEventLog(t, "debian-10.bin")
	run := func(bank, policy string) error {
		e := newEngine(v, nil)
		if policy != "" {
			e.policy = []byte(policyHeader + policy)
		}
		key := newKey(t)
		var a *Attestation
		if bank == "sha1" {
			a = soft.quoteBoot(t, key, debian, "sha1", softIndices)
		} else {
			a = soft.quote(t, key) // another boot's SHA-256 PCRs
			a.EventLog = debian
		}
		csrDER, _ := csrFor(t, key, testNode, testProviderID)
		_, err := e.verify(t, e.file(t, "csr-1", csrDER, evidenceOf(t, VersionV2, a, nil), nil))
		return err
	}
	if err := run("sha256", ""); err != nil {
		t.Fatalf("a SHA-1 log with a SHA-256 quote and no policy: %v", err)
	}
	err := run("sha256", "requireSecureBoot: true\n")
	wantReason(t, err, ReasonBootStateRequired)
	if !strings.Contains(err.Error(), "pcrBank") {
		t.Errorf("denial %q does not say to change the node's pcrBank", err)
	}
	if err := run("sha1", "requireSecureBoot: true\n"); err != nil {
		t.Fatalf("the SHA-1 quote of the same boot: %v", err)
	}
}

func TestSupportedVersions(t *testing.T) {
	for _, c := range []struct {
		policy string
		want   string
	}{
		{"", "v4,v3,v2,v1"},
		{policyHeader, "v4,v3,v2,v1"},
		{policyHeader + "requireSecureBoot: true\n", "v4,v3,v2"},
		{policyHeader + "pcrs: {bank: sha256, indices: [7]}\n", "v4,v3,v2"},
	} {
		var doc []byte
		if c.policy != "" {
			doc = []byte(c.policy)
		}
		got, err := SupportedVersions(doc)
		if err != nil || strings.Join(got, ",") != c.want {
			t.Errorf("policy %q: %v, %v; want %s", c.policy, got, err, c.want)
		}
	}
	if _, err := SupportedVersions([]byte("kind: x\n")); err == nil {
		t.Error("an invalid policy gave versions")
	}
}
