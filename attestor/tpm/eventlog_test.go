package tpm

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-eventlog/tcg"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// goTPMToolsDir is the go-tpm-tools module directory in the module cache:
// its real event logs are read from there at test time, never copied.
func goTPMToolsDir(tb testing.TB) string {
	tb.Helper()
	dir, err := tpmtest.GoTPMToolsDir()
	if err != nil {
		tb.Fatal(err)
	}
	return dir
}

// realEventLog reads one of go-tpm-tools' real event logs.
func realEventLog(tb testing.TB, name string) []byte {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join(goTPMToolsDir(tb), "internal", "test", "eventlogs", name))
	if err != nil {
		tb.Fatalf("real event log missing: %v", err)
	}
	return b
}

// logPCRs computes the PCR values a log's own events produce in bank
// (the values a TPM that measured this boot would hold).
func logPCRs(tb testing.TB, raw []byte, bank string) []PCRValue {
	tb.Helper()
	pcrs, err := LogPCRs(raw, bank)
	if err != nil {
		tb.Fatal(err)
	}
	return pcrs
}

// logBank is the strongest bank a log carries digests of.
func logBank(tb testing.TB, raw []byte) string {
	tb.Helper()
	el, err := tcg.ParseEventLog(raw, tcg.ParseOpts{})
	if err != nil {
		tb.Fatal(err)
	}
	for _, b := range replayBanks {
		for _, a := range el.Algs {
			if a == b.alg {
				return b.name
			}
		}
	}
	tb.Fatalf("log has no known bank: %v", el.Algs)
	return ""
}

// realLogs is every real event log go-tpm-tools ships, with the boot
// state the verifier derives from it.
var realLogs = []struct {
	file       string
	secureBoot bool
	// kernel is the kernel's path, "" where none is derivable (systemd-boot,
	// a GRUB that measures no kernel).
	kernel string
	// dbxEntries is the number of dbx entries.
	dbxEntries int
	// apps is the number of images measured in PCR 4 (its events whose
	// digests do not cover their data).
	apps int
}{
	{"arch-linux-workstation.bin", false, "", 77, 2},
	{"confidential-gke-debug-251000_eventlog.bin", true, "/syslinux/vmlinuz.B", 4, 3},
	{"cos-101-amd-sev.bin", true, "/syslinux/vmlinuz.A", 4, 4},
	{"cos-85-amd-sev.bin", true, "/syslinux/vmlinuz.A", 4, 3},
	{"cos-93-amd-sev.bin", true, "/syslinux/vmlinuz.A", 4, 3},
	{"debian-10.bin", true, "", 186, 3},
	{"eventlogwithsp800155.bin", true, "/syslinux/vmlinuz.B", 4, 3},
	{"gdc-host.bin", false, "/vmlinuz-6.9.0-rc7+", 460, 3},
	{"glinux-alex.bin", false, "", 0, 1},
	{"rhel8-uefi.bin", true, "(hd0,gpt2)/boot/vmlinuz-4.18.0-240.22.1.el8_3.x86_64", 186, 3},
	{"ubuntu-1804-amd-sev.bin", false, "/boot/vmlinuz-5.4.0-1046-gcp", 77, 2},
	{"ubuntu-2104-no-dbx.bin", false, "/boot/vmlinuz-5.11.0-1008-gcp", 0, 2},
	{"ubuntu-2104-no-secure-boot.bin", false, "/boot/vmlinuz-5.11.0-1006-gcp", 186, 2},
	{"ubuntu-2404-amd-sevsnp.bin", false, "/vmlinuz-6.8.0-1010-gcp", 371, 2},
}

// TestRealEventLogsReplay: every real event log go-tpm-tools ships parses
// and replays against the PCRs its own events produce, and yields the
// machine state recorded here.
func TestRealEventLogsReplay(t *testing.T) {
	entries, err := os.ReadDir(filepath.Join(goTPMToolsDir(t), "internal", "test", "eventlogs"))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != len(realLogs) {
		t.Errorf("go-tpm-tools ships %d event logs, the table has %d: add the new ones", len(entries), len(realLogs))
	}
	for _, c := range realLogs {
		t.Run(c.file, func(t *testing.T) {
			raw := realEventLog(t, c.file)
			bank := logBank(t, raw)
			st, err := ReplayEventLog(raw, logPCRs(t, raw, bank))
			if err != nil {
				t.Fatalf("ReplayEventLog: %v", err)
			}
			js, _ := json.Marshal(st)
			t.Logf("%s", js)
			if st.Bank != bank {
				t.Errorf("replayed bank %s, want %s", st.Bank, bank)
			}
			if st.SecureBoot != c.secureBoot {
				t.Errorf("secure boot %v, want %v", st.SecureBoot, c.secureBoot)
			}
			if st.KernelPath != c.kernel {
				t.Errorf("kernel %q, want %q (problems %q)", st.KernelPath, c.kernel, st.Problems)
			}
			if c.kernel != "" && (len(st.KernelDigest) != 2*pcrBankHashSize(bank) || st.KernelCommandLine == "") {
				t.Errorf("kernel digest %q and command line %q: want both", st.KernelDigest, st.KernelCommandLine)
			}
			if st.DBX.Entries() != c.dbxEntries {
				t.Errorf("%d dbx entries, want %d", st.DBX.Entries(), c.dbxEntries)
			}
			if len(st.BootApplications) != c.apps {
				t.Errorf("%d boot applications, want %d (problems %q)", len(st.BootApplications), c.apps, st.Problems)
			}
		})
	}
}
