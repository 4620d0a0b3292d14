package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// TestPrintsAPolicyOfARealBoot runs the command on a real event log
// (go-tpm-tools', from the module cache) and parses what it prints.
func TestPrintsAPolicyOfARealBoot(t *testing.T) {
	log, err := tpmtest.RealEventLogPath("rhel8-uefi.bin")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(log); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := run([]string{"--event-log", log, "--pin", "4,7"}, &buf); err != nil {
		t.Fatal(err)
	}
	p, err := tpm.ParsePolicy(buf.Bytes())
	if err != nil {
		t.Fatalf("the printed policy does not parse: %v\n%s", err, buf.Bytes())
	}
	if !p.RequireSecureBoot || len(p.AllowedKernelDigests) != 1 || len(p.AllowedBootLoaderDigests) != 3 || len(p.PCRValues) != 2 {
		t.Errorf("policy %+v", p)
	}
	if !strings.Contains(buf.String(), "vmlinuz-4.18.0-240.22.1.el8_3.x86_64") {
		t.Errorf("the output does not name the kernel:\n%s", buf.Bytes())
	}
	buf.Reset()
	if err := run([]string{"--event-log", log, "--state"}, &buf); err != nil || !strings.Contains(buf.String(), `"secureBoot": true`) {
		t.Errorf("--state: %v\n%s", err, buf.Bytes())
	}
	for _, args := range [][]string{{"--event-log", filepath.Join(t.TempDir(), "absent")}, {"--event-log", log, "--pin", "12"}, {"--event-log", log, "--bank", "sha512"}, {"stray"}} {
		if err := run(args, &buf); err == nil {
			t.Errorf("%q succeeded", args)
		}
	}
}

// TestHelp: --help prints what the command does and its flags, and exits
// 0 (an image builder's script checks the tool with it).
func TestHelp(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "tpm-boot-policy")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("--help: %v\n%s", err, out)
	}
	for _, want := range []string{"measured-boot event log", "-event-log", "-pcrs", "-pin", "-state"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("--help does not mention %q:\n%s", want, out)
		}
	}
	if out, err := exec.Command(bin, "--no-such-flag").CombinedOutput(); err == nil {
		t.Errorf("an unknown flag exited 0:\n%s", out)
	}
}
