package tpm

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"testing"
)

// replayHelperEnv makes the test binary, run as a child, replay the log
// of the test named in it, with its address space limited, and print what
// the replay allocated.
const replayHelperEnv = "KA_TEST_REPLAY_HELPER"

// replayLimit is the address space of the child: a parser that allocates
// gigabytes fails there, not on the machine.
const replayLimit = 3 << 30

// replayReport is what the child prints.
type replayReport struct {
	Err      string   `json:"err,omitempty"`
	Problems []string `json:"problems,omitempty"`
	Alloc    uint64   `json:"alloc"`
}

// replayInChild replays the log that log(t) returns in a child process
// whose address space is limited to replayLimit, and returns its report,
// failing the test when the child dies (a parser that allocated more).
func replayInChild(t *testing.T, log func(t testing.TB) []byte) replayReport {
	t.Helper()
	if os.Getenv(replayHelperEnv) == t.Name() {
		if err := syscall.Setrlimit(syscall.RLIMIT_AS, &syscall.Rlimit{Cur: replayLimit, Max: replayLimit}); err != nil {
			t.Fatal(err)
		}
		raw := log(t)
		pcrs := bootPCRs(t, raw, "sha256", softIndices)
		var r replayReport
		r.Alloc = allocated(func() {
			st, err := ReplayEventLog(raw, pcrs)
			if err != nil {
				r.Err = err.Error()
			} else {
				r.Problems = st.Problems
			}
		})
		js, _ := json.Marshal(r)
		fmt.Printf("\nREPORT %s\n", js)
		return r
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+strings.Split(t.Name(), "/")[0]+"$", "-test.count=1")
	cmd.Env = append(os.Environ(), replayHelperEnv+"="+t.Name())
	out, err := cmd.CombinedOutput()
	_, js, ok := strings.Cut(string(out), "\nREPORT ")
	if err != nil || !ok {
		tail := string(out)
		if len(tail) > 2000 {
			tail = tail[:2000]
		}
		t.Fatalf("the replay did not finish within %d GiB of address space (%v):\n%s", replayLimit>>30, err, tail)
	}
	js, _, _ = strings.Cut(js, "\n")
	var r replayReport
	if err := json.Unmarshal([]byte(js), &r); err != nil {
		t.Fatal(err)
	}
	return r
}

// allocated is how many bytes f allocates on the heap.
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// TestSignatureListSizeBelowGUID: a db whose signature list declares
// entries smaller than their owner GUID, measured as it is (any TPM whose
// PCR 7 the firmware did not extend can quote it), is refused with a
// reason before go-eventlog parses it, and its replay allocates little.
func TestSignatureListSizeBelowGUID(t *testing.T) {
	r := replayInChild(t, badSignatureListLog)
	if os.Getenv(replayHelperEnv) != "" {
		return
	}
	if r.Err != "" {
		t.Fatalf("the log does not replay: %s", r.Err)
	}
	if !strings.Contains(strings.Join(r.Problems, "\n"), "SignatureSize 0 is below 16") {
		t.Errorf("problems %q do not name the signature size", r.Problems)
	}
	t.Logf("%d-byte log: replay allocated %d bytes; problems %q", len(badSignatureListLog(t)), r.Alloc, r.Problems)
	if r.Alloc > 1<<20 {
		t.Errorf("the replay allocated %d bytes, more than 1 MiB", r.Alloc)
	}
}

// replayAllocPerByte bounds what a replay allocates per byte of log.
const replayAllocPerByte = 32

// TestReplayAllocationBound: replaying any real log allocates at most
// replayAllocPerByte times its size; a log of maxEventLog bytes, the
// largest evidence carries, is within the bound docs/attestors/tpm.md
// states.
func TestReplayAllocationBound(t *testing.T) {
	logs := map[string][]byte{}
	for _, c := range realLogs {
		logs[c.file] = realEventLog(t, c.file)
	}
	// As many events as fit in maxEventLog: the parsers' cost per event.
	l := splitLog(t, realEventLog(t, softLog))
	algs := l.events[0].algs
	l.events = nil
	for i := 0; len(l.bytes()) < maxEventLog-200; i++ {
		pcr, data := uint32(9), []byte("f")
		if i%2 == 0 {
			pcr, data = 8, []byte("grub_cmd: x")
		}
		e := agileEvent{pcr: pcr, typ: evIPL, algs: algs, digests: make([][]byte, len(algs)), data: data}
		e.measure(bytes.TrimPrefix(data, []byte("grub_cmd: ")))
		l.events = append(l.events, e)
	}
	logs["small GRUB events filling maxEventLog"] = l.bytes()
	for name, raw := range logs {
		pcrs := bootPCRs(t, raw, logBank(t, raw), softIndices)
		n := allocated(func() { _, _ = ReplayEventLog(raw, pcrs) })
		t.Logf("%s: %d bytes, replay allocated %d (%.1f per byte)", name, len(raw), n, float64(n)/float64(len(raw)))
		if n > replayAllocPerByte*uint64(len(raw)) {
			t.Errorf("%s: the replay allocated %d bytes, more than %d per byte of its %d", name, n, replayAllocPerByte, len(raw))
		}
	}
}
