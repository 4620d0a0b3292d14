package tpm

import (
	"bytes"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/google/go-eventlog/register"
	"github.com/google/go-eventlog/tcg"
)

// LogPCRs computes the PCR values of bank that a measured-boot event log's
// own events produce (from zero, or from the locality of a StartupLocality
// event for PCR 0), for the PCRs the log extends. It trusts the log: it is
// for the image builder, which reads the log of the boot it made, and for
// tests. A verifier replays a log against quoted PCRs instead
// (ReplayEventLog).
func LogPCRs(rawLog []byte, bank string) ([]PCRValue, error) {
	alg, ok := map[string]register.HashAlg{"sha1": register.HashSHA1, "sha256": register.HashSHA256, "sha384": register.HashSHA384}[bank]
	if !ok {
		return nil, fmt.Errorf("event logs have sha1, sha256 or sha384 digests, not %q", bank)
	}
	el, err := tcg.ParseEventLog(rawLog, tcg.ParseOpts{})
	if err != nil {
		return nil, fmt.Errorf("unable to parse the event log: %w", err)
	}
	if !slices.Contains(el.Algs, alg) {
		return nil, fmt.Errorf("the event log has no %s digests (it has %v)", bank, el.Algs)
	}
	h := alg.CryptoHash()
	vals := map[int][]byte{}
	for _, e := range el.Events(alg) {
		if e.Type == 0x03 { // EV_NO_ACTION: not measured
			if e.Index == 0 && len(e.Data) == 17 && bytes.HasPrefix(e.Data, []byte("StartupLocality")) {
				v := make([]byte, h.Size())
				v[len(v)-1] = e.Data[16]
				vals[0] = v
			}
			continue
		}
		if len(e.Digest) != h.Size() {
			return nil, fmt.Errorf("an event of PCR %d has no %s digest", e.Index, bank)
		}
		cur, ok := vals[e.Index]
		if !ok {
			cur = make([]byte, h.Size())
		}
		d := h.New()
		d.Write(cur)
		d.Write(e.Digest)
		vals[e.Index] = d.Sum(nil)
	}
	var out []PCRValue
	for i := range maxPCRIndex {
		if v, ok := vals[i]; ok {
			out = append(out, PCRValue{Bank: bank, Index: i, Digest: v})
		}
	}
	return out, nil
}

// GoldenOptions says which policy GoldenPolicy writes.
type GoldenOptions struct {
	// Bank is the PCR bank the nodes quote; "sha256" when empty.
	Bank string
	// PCRs are the PCRs the nodes quote; DefaultPCRs when empty.
	PCRs []int
	// Pin lists PCRs whose values the policy pins outright (pcrValues),
	// for fleets whose firmware is the builder's too. Each must be in PCRs.
	Pin []int
}

// GoldenPolicy reads the event log of the boot an image builder just made
// and returns the policy that admits exactly that boot: the PCR selection,
// boot state required, Secure Boot required when it was on, the boot
// loaders and kernel it started, and a dbx at least as large as its own,
// with the boot state it derived. An operator merges the policies of the
// images a fleet runs (allowing every digest during a rollout).
func GoldenPolicy(rawLog []byte, o GoldenOptions) (*Policy, *BootState, error) {
	if o.Bank == "" {
		o.Bank = "sha256"
	}
	if len(o.PCRs) == 0 {
		o.PCRs = DefaultPCRs
	}
	all, err := LogPCRs(rawLog, o.Bank)
	if err != nil {
		return nil, nil, err
	}
	var quoted []PCRValue
	for _, i := range o.PCRs {
		v := PCRValue{Bank: o.Bank, Index: i, Digest: make([]byte, pcrBankHashSize(o.Bank))}
		for _, p := range all {
			if p.Index == i {
				v = p
			}
		}
		quoted = append(quoted, v)
	}
	st, err := ReplayEventLog(rawLog, quoted)
	if err != nil {
		return nil, nil, err
	}
	p := &Policy{
		APIVersion:        PolicyAPIVersion,
		Kind:              PolicyKind,
		PCRs:              &PCRSelection{Bank: o.Bank, Indices: slices.Sorted(slices.Values(o.PCRs))},
		RequireBootState:  true,
		RequireSecureBoot: st.SecureBoot,
	}
	var missing []string
	if len(st.BootApplications) > 0 && slices.Contains(o.PCRs, 4) {
		p.AllowedBootLoaderDigests = slices.Compact(slices.Clone(st.BootApplications))
	} else {
		missing = append(missing, "boot loaders")
	}
	if st.KernelDigest != "" && slices.Contains(o.PCRs, 8) && slices.Contains(o.PCRs, 9) {
		p.AllowedKernelDigests = []string{st.KernelDigest}
	} else {
		missing = append(missing, "kernel")
	}
	if st.SecureBootKnown && st.DBX.Entries() > 0 && slices.Contains(o.PCRs, 7) {
		p.DBX = &DBXRule{MinEntries: st.DBX.Entries()}
	}
	for _, i := range o.Pin {
		if !slices.Contains(o.PCRs, i) {
			return nil, nil, fmt.Errorf("PCR %d is pinned but not quoted", i)
		}
		for _, q := range quoted {
			if q.Index == i {
				p.PCRValues = append(p.PCRValues, PinnedPCR{Index: i, Digest: fmt.Sprintf("%x", q.Digest)})
			}
		}
	}
	if err := p.validate(); err != nil {
		return nil, nil, fmt.Errorf("the golden policy does not validate: %w", err)
	}
	if len(missing) > 0 {
		st.Problems = append(st.Problems, "not in the policy: "+strings.Join(missing, ", "))
	}
	return p, st, nil
}

// YAML writes the policy as a YAML document, fields in the order of the
// Policy type, with st (the boot it was made from, may be nil) as
// comments.
func (p *Policy) YAML(st *BootState) []byte {
	var b bytes.Buffer
	q := strconv.Quote
	list := func(name string, items []string, comments []string) {
		if len(items) == 0 {
			return
		}
		fmt.Fprintf(&b, "%s:\n", name)
		indent := name[:len(name)-len(strings.TrimLeft(name, " "))]
		for i, it := range items {
			fmt.Fprintf(&b, "%s- %s", indent, q(it))
			if i < len(comments) && comments[i] != "" {
				fmt.Fprintf(&b, " # %s", comments[i])
			}
			b.WriteString("\n")
		}
	}
	fmt.Fprintf(&b, "apiVersion: %s\nkind: %s\n", p.APIVersion, p.Kind)
	if st != nil {
		fmt.Fprintf(&b, "# Made from a %s boot: Secure Boot %v, firmware %q, kernel %q\n", st.Bank, st.SecureBoot, st.Firmware, st.KernelPath)
		if st.KernelCommandLine != "" {
			fmt.Fprintf(&b, "# kernel command line: %s\n", st.KernelCommandLine)
		}
		for _, pr := range st.Problems {
			fmt.Fprintf(&b, "# not derived: %s\n", pr)
		}
	}
	if s := p.PCRs; s != nil {
		idx := make([]string, len(s.Indices))
		for i, n := range s.Indices {
			idx[i] = strconv.Itoa(n)
		}
		fmt.Fprintf(&b, "pcrs:\n  bank: %s\n  indices: [%s]\n", s.Bank, strings.Join(idx, ", "))
	}
	fmt.Fprintf(&b, "requireBootState: %v\nrequireSecureBoot: %v\n", p.RequireBootState, p.RequireSecureBoot)
	var appNotes []string
	if st != nil && len(st.BootApplications) == len(p.AllowedBootLoaderDigests) {
		for i := range st.BootApplications {
			appNotes = append(appNotes, fmt.Sprintf("EFI application %d of %d", i+1, len(st.BootApplications)))
		}
	}
	list("allowedBootLoaderDigests", p.AllowedBootLoaderDigests, appNotes)
	var kernelNotes []string
	if st != nil {
		kernelNotes = []string{st.KernelPath}
	}
	list("allowedKernelDigests", p.AllowedKernelDigests, kernelNotes)
	if c := p.KernelCommandLine; c != nil {
		b.WriteString("kernelCommandLine:\n")
		list("  required", c.Required, nil)
		list("  forbidden", c.Forbidden, nil)
	}
	if d := p.DBX; d != nil {
		b.WriteString("dbx:\n")
		if d.MinEntries > 0 {
			fmt.Fprintf(&b, "  minEntries: %d\n", d.MinEntries)
		}
		list("  requiredHashes", d.RequiredHashes, nil)
	}
	if len(p.PCRValues) > 0 {
		b.WriteString("pcrValues:\n")
		for _, v := range p.PCRValues {
			fmt.Fprintf(&b, "- index: %d\n  digest: %s\n", v.Index, q(v.Digest))
		}
	}
	return b.Bytes()
}
