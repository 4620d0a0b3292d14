package tpm

import (
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	json "github.com/go-json-experiment/json"
	"sigs.k8s.io/yaml"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Policy document identity.
const (
	PolicyAPIVersion = "kubelet-authenticator.x-k8s.io/v1alpha1"
	PolicyKind       = "TPMBootPolicy"
)

// Deny reasons of the boot-state policy. Each violated rule is its own
// denial; all of them are reported at once.
const (
	// ReasonEventLogMismatch: the event log does not reproduce the quoted
	// PCRs (altered, truncated, or another boot's log).
	ReasonEventLogMismatch = "EventLogMismatch"
	// ReasonBootStateRequired: the policy requires boot state and the
	// evidence carries no event log, or the log does not show what a rule
	// needs.
	ReasonBootStateRequired = "BootStateRequired"
	// ReasonPCRSelectionMismatch: the quote covers other PCRs than the
	// policy names.
	ReasonPCRSelectionMismatch = "PCRSelectionMismatch"
	// ReasonSecureBootDisabled: the policy requires Secure Boot and the
	// firmware measured it disabled (or not at all).
	ReasonSecureBootDisabled = "SecureBootDisabled"
	// ReasonBootLoaderNotAllowed: an EFI application the firmware started
	// is not in allowedBootLoaderDigests.
	ReasonBootLoaderNotAllowed = "BootLoaderNotAllowed"
	// ReasonKernelNotAllowed: the kernel's digest is not in
	// allowedKernelDigests.
	ReasonKernelNotAllowed = "KernelNotAllowed"
	// ReasonKernelCommandLineNotAllowed: a required kernel argument is
	// missing or a forbidden one is present.
	ReasonKernelCommandLineNotAllowed = "KernelCommandLineNotAllowed"
	// ReasonDbxOutdated: the firmware's dbx has fewer entries than the
	// policy's minimum, or lacks a revocation the policy requires.
	ReasonDbxOutdated = "DbxOutdated"
	// ReasonPCRValueNotAllowed: a PCR the policy pins holds another value.
	ReasonPCRValueNotAllowed = "PCRValueNotAllowed"
)

// Policy is a Cluster's TPM boot-state policy (YAML or JSON). Every rule
// is optional; an empty policy changes nothing.
//
//	apiVersion: kubelet-authenticator.x-k8s.io/v1alpha1
//	kind: TPMBootPolicy
//	pcrs: {bank: sha256, indices: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}
//	requireBootState: true
//	requireSecureBoot: true
//	allowedBootLoaderDigests: [<hex>, ...]
//	allowedKernelDigests: [<hex>, ...]
//	kernelCommandLine: {required: [lockdown=integrity], forbidden: [init, single]}
//	dbx: {minEntries: 371, requiredHashes: [<hex>, ...]}
//	pcrValues: [{index: 0, digest: <hex>}]
type Policy struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	// PCRs is the PCR selection the quote must cover, exactly.
	PCRs *PCRSelection `json:"pcrs,omitempty"`
	// RequireBootState requires v2 evidence with an event log that
	// replays. Any rule on the boot state below implies it.
	RequireBootState bool `json:"requireBootState,omitempty"`
	// RequireSecureBoot requires the firmware to have measured Secure Boot
	// enabled.
	RequireSecureBoot bool `json:"requireSecureBoot,omitempty"`
	// AllowedBootLoaderDigests lists the Authenticode digests (hex, in the
	// replayed bank) every image measured in PCR 4 must have, whatever type
	// its event claims: shim, GRUB, and a kernel the boot loader starts
	// through the firmware.
	AllowedBootLoaderDigests []string `json:"allowedBootLoaderDigests,omitempty"`
	// AllowedKernelDigests lists the digests (hex, as sha256sum prints for
	// a sha256 bank) the kernel file GRUB loaded must have. The kernel is
	// found by its position in PCR 9, which a root that extends PCR 9
	// after boot can shift: see docs/attestors/tpm.md.
	AllowedKernelDigests []string `json:"allowedKernelDigests,omitempty"`
	// KernelCommandLine constrains the kernel's arguments.
	KernelCommandLine *CommandLineRule `json:"kernelCommandLine,omitempty"`
	// DBX requires an up-to-date revocation database.
	DBX *DBXRule `json:"dbx,omitempty"`
	// PCRValues pins PCRs of the quoted bank to exact values (immutable
	// images on identical firmware).
	PCRValues []PinnedPCR `json:"pcrValues,omitempty"`
}

// PCRSelection is a bank and PCR numbers.
type PCRSelection struct {
	// Bank is sha1, sha256, sha384 or sha512.
	Bank string `json:"bank"`
	// Indices are PCR numbers, 0-23.
	Indices []int `json:"indices"`
}

// CommandLineRule constrains kernel arguments. An entry "name=value" is
// that exact argument; an entry "name" is the bare flag when required, and
// any argument of that name (with or without a value) when forbidden.
type CommandLineRule struct {
	Required  []string `json:"required,omitempty"`
	Forbidden []string `json:"forbidden,omitempty"`
}

// DBXRule requires a dbx with at least MinEntries entries (certificates
// and hashes) and every hash of RequiredHashes (hex SHA-256, as dbx lists
// revoked images).
type DBXRule struct {
	MinEntries     int      `json:"minEntries,omitempty"`
	RequiredHashes []string `json:"requiredHashes,omitempty"`
}

// PinnedPCR is a PCR's required value in the quoted bank.
type PinnedPCR struct {
	Index  int    `json:"index"`
	Digest string `json:"digest"`
}

// ParsePolicy parses and validates a policy document, strictly (unknown
// fields and duplicate keys are errors), and reports every problem at once.
func ParsePolicy(doc []byte) (*Policy, error) {
	// YAML to JSON refusing duplicate keys, then a case-sensitive JSON
	// decoder refusing unknown members: "requireSecureboot" is a mistake
	// to report, not a spelling of requireSecureBoot.
	js, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return nil, fmt.Errorf("unable to parse the TPM boot policy: %w", err)
	}
	var p Policy
	if err := json.Unmarshal(js, &p, json.RejectUnknownMembers(true)); err != nil {
		return nil, fmt.Errorf("unable to parse the TPM boot policy: %w", err)
	}
	if err := p.validate(); err != nil {
		return nil, fmt.Errorf("invalid TPM boot policy: %w", err)
	}
	p.normalize()
	return &p, nil
}

func (p *Policy) validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if p.APIVersion != PolicyAPIVersion {
		bad("apiVersion is %q, want %q", p.APIVersion, PolicyAPIVersion)
	}
	if p.Kind != PolicyKind {
		bad("kind is %q, want %q", p.Kind, PolicyKind)
	}
	// sizes are the digest sizes a digest may have: the bank's, or any
	// replayable bank's when the policy names none.
	sizes := []int{20, 32, 48}
	if s := p.PCRs; s != nil {
		n := pcrBankHashSize(s.Bank)
		switch {
		case n == 0:
			bad("pcrs.bank %q is not sha1, sha256, sha384 or sha512", s.Bank)
		case s.Bank == "sha512" && p.needsLog():
			bad("pcrs.bank sha512: event logs are replayed against sha1, sha256 or sha384; rules on the boot state need one of those")
		default:
			sizes = []int{n}
		}
		if len(s.Indices) == 0 {
			bad("pcrs.indices is empty")
		}
		seen := map[int]bool{}
		for _, i := range s.Indices {
			if i < 0 || i > 23 {
				bad("pcrs.indices: %d is not a PCR (0-23)", i)
			}
			if seen[i] {
				bad("pcrs.indices: %d is listed twice", i)
			}
			seen[i] = true
		}
		for _, need := range []struct {
			on  bool
			pcr int
			why string
		}{
			{p.RequireSecureBoot || p.DBX != nil, 7, "requireSecureBoot and dbx read PCR 7"},
			{len(p.AllowedBootLoaderDigests) > 0, 4, "allowedBootLoaderDigests reads PCR 4"},
			{len(p.AllowedKernelDigests) > 0, 9, "allowedKernelDigests reads PCR 9"},
			{len(p.AllowedKernelDigests) > 0 || p.KernelCommandLine != nil, 8, "allowedKernelDigests and kernelCommandLine read PCR 8"},
		} {
			if need.on && !seen[need.pcr] {
				bad("pcrs.indices lacks PCR %d: %s", need.pcr, need.why)
			}
		}
		for _, v := range p.PCRValues {
			if !seen[v.Index] {
				bad("pcrValues: PCR %d is not in pcrs.indices", v.Index)
			}
		}
	} else if len(p.PCRValues) > 0 {
		bad("pcrValues needs pcrs: a pinned value is of one bank")
	}
	checkDigests := func(field string, ds []string, sizes []int) {
		for _, d := range ds {
			b, err := hex.DecodeString(d)
			if err != nil || !slices.Contains(sizes, len(b)) {
				bad("%s: %q is not a hex digest of %v bytes", field, d, sizes)
			}
		}
	}
	checkDigests("allowedBootLoaderDigests", p.AllowedBootLoaderDigests, sizes)
	checkDigests("allowedKernelDigests", p.AllowedKernelDigests, sizes)
	if c := p.KernelCommandLine; c != nil {
		if len(c.Required) == 0 && len(c.Forbidden) == 0 {
			bad("kernelCommandLine sets neither required nor forbidden")
		}
		for _, a := range append(slices.Clone(c.Required), c.Forbidden...) {
			if a == "" || strings.ContainsAny(a, " \t\n") {
				bad("kernelCommandLine: %q is not one kernel argument", a)
			}
		}
		for _, a := range c.Required {
			for _, f := range c.Forbidden {
				if argMatches(a, f) {
					bad("kernelCommandLine: %q is both required and forbidden (by %q)", a, f)
				}
			}
		}
	}
	if d := p.DBX; d != nil {
		if d.MinEntries < 0 {
			bad("dbx.minEntries is negative")
		}
		if d.MinEntries == 0 && len(d.RequiredHashes) == 0 {
			bad("dbx sets neither minEntries nor requiredHashes")
		}
		checkDigests("dbx.requiredHashes", d.RequiredHashes, []int{32})
	}
	pinned := map[int]bool{}
	for _, v := range p.PCRValues {
		if pinned[v.Index] {
			bad("pcrValues: PCR %d is pinned twice", v.Index)
		}
		pinned[v.Index] = true
		if p.PCRs != nil {
			checkDigests(fmt.Sprintf("pcrValues[%d]", v.Index), []string{v.Digest}, []int{pcrBankHashSize(p.PCRs.Bank)})
		}
	}
	return errors.Join(errs...)
}

// normalize lower-cases digests.
func (p *Policy) normalize() {
	for _, l := range [][]string{p.AllowedBootLoaderDigests, p.AllowedKernelDigests} {
		for i := range l {
			l[i] = strings.ToLower(l[i])
		}
	}
	if p.DBX != nil {
		for i := range p.DBX.RequiredHashes {
			p.DBX.RequiredHashes[i] = strings.ToLower(p.DBX.RequiredHashes[i])
		}
	}
	for i := range p.PCRValues {
		p.PCRValues[i].Digest = strings.ToLower(p.PCRValues[i].Digest)
	}
}

// needsLog reports whether a rule reads the boot state.
func (p *Policy) needsLog() bool {
	return p.RequireBootState || p.RequireSecureBoot || len(p.AllowedBootLoaderDigests) > 0 ||
		len(p.AllowedKernelDigests) > 0 || p.KernelCommandLine != nil || p.DBX != nil
}

// needsQuote reports whether a rule reads quoted PCRs (v2 evidence).
func (p *Policy) needsQuote() bool {
	return p.needsLog() || p.PCRs != nil || len(p.PCRValues) > 0
}

// evaluate applies the policy to a first-round attestation whose quote
// (v2) has verified: version is the evidence version, pcrs the quoted PCR
// values, sel the quote's selection by bank, and state the replayed boot
// state (nil when the evidence carries no log, or noState says why the
// log it carries gives none). Every violated rule is its own denial.
func (p *Policy) evaluate(version string, pcrs []PCRValue, sel map[string][]int, state *BootState, noState string) error {
	if !quotes(version) {
		if p.needsQuote() {
			return attestor.Deny(attestor.ReasonUnsupportedEvidenceVersion,
				"the Cluster's TPM boot policy requires %s, %s or %s evidence (a quote of the boot PCRs); this node sent %s: upgrade its kubelet-authenticator",
				VersionV4, VersionV3, VersionV2, version)
		}
		return nil
	}
	var errs []error
	deny := func(reason, format string, args ...any) { errs = append(errs, attestor.Deny(reason, format, args...)) }

	if s := p.PCRs; s != nil {
		want := slices.Sorted(slices.Values(s.Indices))
		if len(sel) != 1 || !slices.Equal(sel[s.Bank], want) {
			deny(ReasonPCRSelectionMismatch, "the quote covers %s; the policy requires exactly %s PCRs %v: set the node's pcrBank and pcrs to match",
				formatSelection(sel), s.Bank, want)
		}
		for _, v := range p.PCRValues {
			got, ok := pcrValue(pcrs, s.Bank, v.Index)
			if !ok {
				continue // reported as a selection mismatch
			}
			if got != v.Digest {
				deny(ReasonPCRValueNotAllowed, "%s PCR %d is %s, the policy pins %s", s.Bank, v.Index, got, v.Digest)
			}
		}
	}
	if !p.needsLog() {
		return errors.Join(errs...)
	}
	if state == nil {
		if noState != "" {
			deny(ReasonBootStateRequired, "the Cluster's TPM boot policy requires boot state: %s", noState)
		} else {
			deny(ReasonBootStateRequired,
				"the Cluster's TPM boot policy requires boot state and the evidence carries no measured-boot event log: "+
					"make the event log readable by the agent (eventLogPath) and do not set noEventLog")
		}
		return errors.Join(errs...)
	}
	why := func(what string) string {
		for _, pr := range state.Problems {
			if strings.HasPrefix(pr, what) {
				return " (" + pr + ")"
			}
		}
		return ""
	}
	if p.RequireSecureBoot && !state.SecureBoot {
		if state.SecureBootKnown {
			deny(ReasonSecureBootDisabled, "the firmware measured Secure Boot disabled")
		} else {
			deny(ReasonSecureBootDisabled, "the event log does not show Secure Boot enabled%s", why("secure boot"))
		}
	}
	if len(p.AllowedBootLoaderDigests) > 0 {
		if len(state.BootApplications) == 0 {
			if w := why("boot applications"); w != "" {
				deny(ReasonBootLoaderNotAllowed, "the event log does not show which EFI applications started%s", w)
			} else {
				deny(ReasonBootLoaderNotAllowed, "the event log shows no EFI application started")
			}
		}
		for _, d := range state.BootApplications {
			if !slices.Contains(p.AllowedBootLoaderDigests, d) {
				deny(ReasonBootLoaderNotAllowed, "EFI application %s:%s is not in allowedBootLoaderDigests", state.Bank, d)
			}
		}
	}
	if len(p.AllowedKernelDigests) > 0 {
		switch {
		case state.KernelDigest == "":
			deny(ReasonKernelNotAllowed, "the event log shows no kernel GRUB loaded%s", why("kernel"))
		case !slices.Contains(p.AllowedKernelDigests, state.KernelDigest):
			deny(ReasonKernelNotAllowed, "kernel %s (%s:%s) is not in allowedKernelDigests", state.KernelPath, state.Bank, state.KernelDigest)
		}
	}
	if c := p.KernelCommandLine; c != nil {
		if state.KernelPath == "" {
			deny(ReasonKernelCommandLineNotAllowed, "the event log shows no kernel command line%s", why("kernel"))
		} else {
			args := strings.Fields(state.KernelCommandLine)
			var missing, present []string
			for _, r := range c.Required {
				if !slices.Contains(args, r) {
					missing = append(missing, r)
				}
			}
			for _, f := range c.Forbidden {
				for _, a := range args {
					if argMatches(a, f) {
						present = append(present, a)
					}
				}
			}
			if len(missing) > 0 {
				deny(ReasonKernelCommandLineNotAllowed, "the kernel command line lacks required arguments %q", missing)
			}
			if len(present) > 0 {
				deny(ReasonKernelCommandLineNotAllowed, "the kernel command line has forbidden arguments %q", present)
			}
		}
	}
	if d := p.DBX; d != nil {
		switch {
		case !state.SecureBootKnown:
			deny(ReasonDbxOutdated, "the event log does not show the dbx%s", why("secure boot"))
		default:
			if n := state.DBX.Entries(); n < d.MinEntries {
				deny(ReasonDbxOutdated, "the firmware's dbx has %d entries, the policy requires at least %d: apply the current dbx update", n, d.MinEntries)
			}
			var lacking []string
			for _, h := range d.RequiredHashes {
				if !slices.Contains(state.DBX.Hashes, h) {
					lacking = append(lacking, h)
				}
			}
			if len(lacking) > 0 {
				deny(ReasonDbxOutdated, "the firmware's dbx does not revoke %s: apply the current dbx update", strings.Join(lacking, ", "))
			}
		}
	}
	return errors.Join(errs...)
}

// argMatches reports whether kernel argument arg is matched by rule: the
// same argument, or, for a rule without "=", any argument of that name.
func argMatches(arg, rule string) bool {
	if arg == rule {
		return true
	}
	if strings.Contains(rule, "=") {
		return false
	}
	name, _, _ := strings.Cut(arg, "=")
	return name == rule
}

func pcrValue(pcrs []PCRValue, bank string, index int) (string, bool) {
	for _, v := range pcrs {
		if v.Bank == bank && v.Index == index {
			return hex.EncodeToString(v.Digest), true
		}
	}
	return "", false
}

func formatSelection(sel map[string][]int) string {
	if len(sel) == 0 {
		return "no PCRs"
	}
	var parts []string
	for _, b := range slices.Sorted(maps.Keys(sel)) {
		parts = append(parts, fmt.Sprintf("%s PCRs %v", b, sel[b]))
	}
	return strings.Join(parts, " and ")
}

// SupportedVersions lists the evidence versions the verifier accepts under
// a Cluster's policy document (nil for none), newest first: v4, v3, v2 and
// v1, or only v4, v3 and v2 when the policy reads quoted PCRs. The signer can write
// it as the supported-versions annotation on a request denied
// UnsupportedEvidenceVersion, so that a node able to produce a quote files
// anew.
func SupportedVersions(policy []byte) ([]string, error) {
	all := (*Verifier)(nil).Versions()
	if policy == nil {
		return all, nil
	}
	p, err := ParsePolicy(policy)
	if err != nil {
		return nil, err
	}
	if p.needsQuote() {
		return slices.DeleteFunc(all, func(v string) bool { return !quotes(v) }), nil
	}
	return all, nil
}
