// Command tpm-boot-policy prints the TPM boot policy (TPMBootPolicy) that
// admits the boot of the machine it runs on: an image builder runs it on
// the image's build VM, after booting the image, and the operator merges
// its output into the Cluster's policy. It reads the measured-boot event
// log only; it needs no TPM and changes nothing.
//
//	tpm-boot-policy [--event-log PATH] [--bank sha256] [--pcrs 0,1,...,9] [--pin 4,8,9] [--state]
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
)

func main() {
	err := run(os.Args[1:], os.Stdout)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "tpm-boot-policy:", err)
		os.Exit(1)
	}
}

func run(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tpm-boot-policy", flag.ContinueOnError)
	logPath := fs.String("event-log", tpm.DefaultEventLogPath, "the measured-boot event log of this boot")
	bank := fs.String("bank", "sha256", "the PCR bank the nodes quote (the agent's pcrBank)")
	pcrs := fs.String("pcrs", "", "the PCRs the nodes quote, comma-separated (the agent's pcrs; default 0-9)")
	pin := fs.String("pin", "", "PCRs to pin outright, comma-separated (only where the fleet's firmware is the builder's)")
	state := fs.Bool("state", false, "print the boot state the log proves (JSON) instead of the policy")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: tpm-boot-policy [flags]\n\n"+
			"Prints the TPM boot policy that admits this machine's boot, read from its\n"+
			"measured-boot event log (no TPM needed, nothing changed). Run it on an image's\n"+
			"build VM after booting the image; merge the output into the Cluster's policy.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	o := tpm.GoldenOptions{Bank: *bank}
	var err error
	if o.PCRs, err = ints(*pcrs); err != nil {
		return fmt.Errorf("--pcrs: %w", err)
	}
	if o.Pin, err = ints(*pin); err != nil {
		return fmt.Errorf("--pin: %w", err)
	}
	raw, err := os.ReadFile(*logPath)
	if err != nil {
		return fmt.Errorf("unable to read the event log: %w", err)
	}
	p, st, err := tpm.GoldenPolicy(raw, o)
	if err != nil {
		return err
	}
	if *state {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(st)
	}
	_, err = out.Write(p.YAML(st))
	return err
}

func ints(s string) ([]int, error) {
	if s == "" {
		return nil, nil
	}
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}
