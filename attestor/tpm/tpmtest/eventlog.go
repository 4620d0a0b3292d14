package tpmtest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"sync"

	"github.com/google/go-eventlog/register"
	"github.com/google/go-eventlog/tcg"
	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// GoTPMToolsDir returns the directory of the go-tpm-tools module in the
// module cache, downloading the module first where only its go.mod is
// there (go mod download, run in the current directory, which must be
// inside this module; the version is go.mod's). Its internal/test holds
// real machines' event logs and real GCE attestations, which tests read in
// place. The go command runs once per test process.
func GoTPMToolsDir() (string, error) { return goTPMToolsDir() }

var goTPMToolsDir = sync.OnceValues(func() (string, error) {
	cmd := exec.Command("go", "mod", "download", "-json", "github.com/google/go-tpm-tools")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("unable to download go-tpm-tools into the module cache: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	var m struct{ Dir, Error string }
	if err := json.Unmarshal(out, &m); err != nil {
		return "", fmt.Errorf("unable to read go mod download's answer for go-tpm-tools: %w", err)
	}
	if m.Error != "" || m.Dir == "" {
		return "", fmt.Errorf("go-tpm-tools is not in the module cache (go mod download: %q): the real event logs must be present", m.Error)
	}
	return m.Dir, nil
})

// RealEventLogPath returns the path of one of go-tpm-tools' real
// measured-boot event logs (internal/test/eventlogs/name, e.g.
// "rhel8-uefi.bin") in the module cache.
func RealEventLogPath(name string) (string, error) {
	dir, err := GoTPMToolsDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, "internal", "test", "eventlogs", name), nil
}

// ExtendEventLog makes tp's SHA-256 PCRs those of the machine that wrote
// rawLog: it extends every measured event's SHA-256 digest into its PCR,
// in log order, as that machine's firmware and boot loader did. tp must be
// freshly started (PCRs at zero), and the log must not start PCR 0 at
// another locality, which only the platform can do.
func ExtendEventLog(tp transport.TPM, rawLog []byte) error {
	el, err := tcg.ParseEventLog(rawLog, tcg.ParseOpts{})
	if err != nil {
		return fmt.Errorf("unable to parse the event log: %w", err)
	}
	for _, e := range el.Events(register.HashSHA256) {
		if e.Type == 0x03 { // EV_NO_ACTION: not measured
			if bytes.HasPrefix(e.Data, []byte("StartupLocality")) {
				return fmt.Errorf("the log starts PCR 0 at another locality, which software cannot reproduce")
			}
			continue
		}
		if len(e.Digest) != 32 {
			return fmt.Errorf("event %d of PCR %d has no SHA-256 digest", e.Num(), e.Index)
		}
		if _, err := (tpm2.PCRExtend{
			PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(e.Index), Auth: tpm2.PasswordAuth(nil)},
			Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: tpm2.TPMAlgSHA256, Digest: e.Digest}}},
		}).Execute(tp); err != nil {
			return fmt.Errorf("unable to extend PCR %d: %w", e.Index, err)
		}
	}
	return nil
}
