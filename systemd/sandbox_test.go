package systemd_test

// The serving certificate's address discovery run inside the agent unit's
// sandbox. systemd is not PID 1 on the test machines (systemd-run has no
// manager to talk to), so the test applies the parts of the unit's
// sandbox that discovery meets, the way systemd applies them, to a child
// process (this test binary, re-executed):
//
//   - ProcSubset= and ProtectProc=: a new mount namespace with a fresh
//     procfs instance mounted with subset= and hidepid= (systemd mounts the
//     same options);
//   - RestrictAddressFamilies=: a seccomp filter that fails socket() with
//     EAFNOSUPPORT for every family not listed (systemd's filter does the
//     same);
//   - NoNewPrivileges=.
//
// The child runs in a network namespace of its own with a default route
// on a veth pair (and a second interface without one), so that the
// expected address is known. SystemCallFilter= is not applied: the test
// checks instead, with systemd-analyze, that the unit's filter allows the
// system calls a netlink route dump makes.

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
	utilnet "k8s.io/apimachinery/pkg/util/net"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/serving"
)

// Environment of the re-executed child.
const (
	envChild    = "KA_SANDBOX_CHILD"    // "agent": the agent's discovery; "kubelet": ChooseHostInterface
	envFamilies = "KA_SANDBOX_FAMILIES" // RestrictAddressFamilies=, "" for no filter
	envProc     = "KA_SANDBOX_PROC"     // procfs mount options, "" to keep /proc
	envNet      = "KA_SANDBOX_NET"      // "dual" or "v6only"
)

// Addresses the child's network namespace gives the interface with the
// default route.
const (
	sandboxIPv4 = "192.0.2.10"
	sandboxIPv6 = "fd00:10::10"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(envChild); mode != "" {
		os.Exit(sandboxChild(mode))
	}
	os.Exit(m.Run())
}

// childResult is what the child reports on stdout.
type childResult struct {
	Address string `json:"address,omitempty"`
	Error   string `json:"error,omitempty"`
	Seccomp string `json:"seccomp"`
	ProcNet bool   `json:"procNet"`
}

func sandboxChild(mode string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "sandbox child:", err)
		return 2
	}
	if err := sandboxNetwork(os.Getenv(envNet)); err != nil {
		return fail(err)
	}
	if opts := os.Getenv(envProc); opts != "" {
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			return fail(fmt.Errorf("unable to make / private: %w", err))
		}
		if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
			return fail(fmt.Errorf("unable to mount /proc with %s: %w", opts, err))
		}
	}
	if families := os.Getenv(envFamilies); families != "" {
		if err := restrictAddressFamilies(strings.Fields(families)); err != nil {
			return fail(err)
		}
	}
	var res childResult
	status, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "Seccomp:"); ok {
			res.Seccomp = strings.TrimSpace(v)
		}
	}
	_, err := os.Stat("/proc/net/route")
	res.ProcNet = err == nil
	var ip net.IP
	switch mode {
	case "agent":
		// What the agent runs: serving.enabled without addresses.
		cfg := &config.NodeConfig{NodeName: "n1", Serving: config.ServingConfig{Enabled: true}}
		var ips []net.IP
		if _, ips, err = (&serving.Manager{Config: cfg}).Addresses(); err == nil {
			ip = ips[0]
		}
	case "kubelet":
		ip, err = utilnet.ChooseHostInterface()
	default:
		return fail(fmt.Errorf("unknown mode %q", mode))
	}
	if err != nil {
		res.Error = err.Error()
	} else {
		res.Address = ip.String()
	}
	if err := json.NewEncoder(os.Stdout).Encode(res); err != nil {
		return fail(err)
	}
	return 0
}

// sandboxNetwork lays out the child's network namespace: a bridge with an
// address and no default route, created first so that it is not simply
// the first interface, and a veth pair whose ka0 holds the default
// route(s).
func sandboxNetwork(layout string) error {
	cmds := [][]string{
		{"link", "set", "lo", "up"},
		{"link", "add", "ka-other", "type", "bridge"},
		{"link", "set", "ka-other", "up"},
		{"addr", "add", "198.51.100.5/24", "dev", "ka-other"},
		{"link", "add", "ka0", "type", "veth", "peer", "name", "ka1"},
		{"link", "set", "ka1", "up"},
		{"link", "set", "ka0", "up"},
		{"addr", "add", sandboxIPv4 + "/24", "dev", "ka0"},
		{"-6", "addr", "add", sandboxIPv6 + "/64", "dev", "ka0", "nodad"},
		{"-6", "route", "add", "default", "via", "fd00:10::1", "dev", "ka0"},
	}
	if layout != "v6only" {
		cmds = append(cmds, []string{"route", "add", "default", "via", "192.0.2.1", "dev", "ka0"})
	}
	for _, args := range cmds {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, out)
		}
	}
	return nil
}

// addressFamilies are the families the unit may name.
var addressFamilies = map[string]uint32{
	"AF_UNIX": unix.AF_UNIX, "AF_INET": unix.AF_INET, "AF_INET6": unix.AF_INET6,
	"AF_NETLINK": unix.AF_NETLINK, "AF_PACKET": unix.AF_PACKET,
}

// restrictAddressFamilies installs, for every thread of the process, a
// seccomp filter that lets socket() create only the listed families and
// fails it with EAFNOSUPPORT otherwise, as RestrictAddressFamilies= does
// with an allow list, after setting no_new_privs (NoNewPrivileges=).
func restrictAddressFamilies(names []string) error {
	var arch uint32
	switch runtime.GOARCH {
	case "amd64":
		arch = unix.AUDIT_ARCH_X86_64
	case "arm64":
		arch = unix.AUDIT_ARCH_AARCH64
	default:
		return fmt.Errorf("no seccomp architecture for %s", runtime.GOARCH)
	}
	var families []uint32
	for _, n := range names {
		f, ok := addressFamilies[n]
		if !ok {
			return fmt.Errorf("unknown address family %s", n)
		}
		families = append(families, f)
	}
	// struct seccomp_data: nr at 0, arch at 4, args[0] at 16 (its low 32
	// bits on these little-endian architectures).
	stmt := func(code uint16, k uint32) unix.SockFilter { return unix.SockFilter{Code: code, K: k} }
	jeq := func(k uint32, jt, jf uint8) unix.SockFilter {
		return unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, K: k, Jt: jt, Jf: jf}
	}
	n := uint8(len(families))
	prog := []unix.SockFilter{
		stmt(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, 4),
		jeq(arch, 0, n+3), // another architecture: deny (SystemCallArchitectures=native)
		stmt(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, 0),
		jeq(uint32(unix.SYS_SOCKET), 0, n+2), // not socket(): allow
		stmt(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, 16),
	}
	for i, f := range families {
		prog = append(prog, jeq(f, n-uint8(i), 0)) // listed: allow
	}
	prog = append(prog,
		stmt(unix.BPF_RET|unix.BPF_K, unix.SECCOMP_RET_ERRNO|uint32(unix.EAFNOSUPPORT)),
		stmt(unix.BPF_RET|unix.BPF_K, unix.SECCOMP_RET_ALLOW),
	)
	runtime.LockOSThread()
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("unable to set no_new_privs: %w", err)
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if _, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog))); errno != 0 {
		return fmt.Errorf("unable to install the seccomp filter: %w", errno)
	}
	return nil
}

// sandbox is how the child runs.
type sandbox struct {
	mode, families, proc, net string
}

func runSandboxed(t *testing.T, s sandbox) childResult {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"="+s.mode, envFamilies+"="+s.families, envProc+"="+s.proc, envNet+"="+s.net)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWNET}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("sandboxed child %+v: %v\n%s", s, err, stderr.String())
	}
	var res childResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("child output %q: %v", out, err)
	}
	return res
}

// unitSandbox returns the unit's RestrictAddressFamilies= and the procfs
// options of its ProcSubset= and ProtectProc=.
func unitSandbox(t *testing.T) (families []string, procOpts string) {
	t.Helper()
	s := unitSettings(t, unitName)
	for _, v := range s["Service.RestrictAddressFamilies"] {
		if strings.HasPrefix(v, "~") {
			t.Fatalf("RestrictAddressFamilies=%s: this test models an allow list", v)
		}
		families = append(families, strings.Fields(v)...)
	}
	if len(families) == 0 {
		t.Fatal("the unit has no RestrictAddressFamilies")
	}
	var opts []string
	if v := s["Service.ProcSubset"]; len(v) > 0 && v[len(v)-1] == "pid" {
		opts = append(opts, "subset=pid")
	}
	if v := s["Service.ProtectProc"]; len(v) > 0 && v[len(v)-1] != "default" {
		opts = append(opts, "hidepid="+v[len(v)-1])
	}
	if !slices.Contains(s["Service.NoNewPrivileges"], "yes") {
		t.Fatal("NoNewPrivileges is not yes: this test models it set")
	}
	return families, strings.Join(opts, ",")
}

// TestServingAddressDiscoveryInUnitSandbox: with serving.enabled and no
// serving.ipAddresses, the agent finds the node's address (that of the
// interface with the default route, IPv4 first, else IPv6) inside the
// unit's sandbox. The same child without AF_NETLINK finds nothing, and
// kubelet's own discovery (ChooseHostInterface, which reads
// /proc/net/route) inside the sandbox picks another interface: the
// sandbox the test builds is one discovery can fail in.
func TestServingAddressDiscoveryInUnitSandbox(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for mount and network namespaces (the unit's sandbox is rebuilt here, not by systemd)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Fatalf("ip is required (Debian package iproute2): %v", err)
	}
	families, procOpts := unitSandbox(t)
	unit := strings.Join(families, " ")
	t.Logf("unit sandbox: RestrictAddressFamilies=%s, /proc mounted with %q, NoNewPrivileges=yes", unit, procOpts)

	for _, c := range []struct{ net, want string }{{"dual", sandboxIPv4}, {"v6only", sandboxIPv6}} {
		res := runSandboxed(t, sandbox{mode: "agent", families: unit, proc: procOpts, net: c.net})
		if res.Seccomp != "2" || (procOpts != "" && res.ProcNet) {
			t.Fatalf("%s: the child is not sandboxed: seccomp mode %q, /proc/net/route visible %t", c.net, res.Seccomp, res.ProcNet)
		}
		if res.Error != "" || res.Address != c.want {
			t.Errorf("%s network: discovery in the unit's sandbox found %q (%s), want %s", c.net, res.Address, res.Error, c.want)
		}
	}

	// The sandbox has teeth. Without AF_NETLINK, nothing is found.
	noNetlink := slices.DeleteFunc(slices.Clone(families), func(f string) bool { return f == "AF_NETLINK" })
	if res := runSandboxed(t, sandbox{mode: "agent", families: strings.Join(noNetlink, " "), proc: procOpts, net: "dual"}); res.Error == "" ||
		!strings.Contains(res.Error, syscall.EAFNOSUPPORT.Error()) {
		t.Errorf("discovery without AF_NETLINK: found %q (%s), want %v", res.Address, res.Error, syscall.EAFNOSUPPORT)
	}
	// kubelet's discovery works in this network namespace, not in the
	// unit's sandbox: ProcSubset=pid hides /proc/net/route, and
	// ChooseHostInterface then falls back to the first interface with a
	// global address, which is not the one with the default route.
	if res := runSandboxed(t, sandbox{mode: "kubelet", net: "dual"}); res.Address != sandboxIPv4 {
		t.Fatalf("ChooseHostInterface outside the sandbox: %q (%s), want %s", res.Address, res.Error, sandboxIPv4)
	}
	if procOpts != "" {
		if res := runSandboxed(t, sandbox{mode: "kubelet", families: unit, proc: procOpts, net: "dual"}); res.Address == sandboxIPv4 {
			t.Errorf("ChooseHostInterface inside the unit's sandbox found %s: the sandbox does not hide /proc/net", res.Address)
		} else {
			t.Logf("ChooseHostInterface inside the unit's sandbox: %q (%s)", res.Address, res.Error)
		}
	}
}

// TestUnitSystemCallFilterAllowsNetlinkDiscovery: the system calls of a
// netlink route dump (Go's syscall.NetlinkRIB and net.Interfaces) are in
// the unit's SystemCallFilter= (its allowed sets minus its denied ones, as
// systemd-analyze expands them).
func TestUnitSystemCallFilterAllowsNetlinkDiscovery(t *testing.T) {
	analyze := systemdAnalyze(t)
	var allowed, denied []string
	for _, v := range unitSettings(t, unitName)["Service.SystemCallFilter"] {
		if rest, ok := strings.CutPrefix(v, "~"); ok {
			denied = append(denied, strings.Fields(rest)...)
		} else {
			allowed = append(allowed, strings.Fields(v)...)
		}
	}
	expand := func(sets []string) map[string]bool {
		out := map[string]bool{}
		var walk func(string)
		walk = func(name string) {
			if !strings.HasPrefix(name, "@") {
				out[name] = true
				return
			}
			listing, err := exec.Command(analyze, "syscall-filter", "--no-pager", name).Output()
			if err != nil {
				t.Fatalf("systemd-analyze syscall-filter %s: %v", name, err)
			}
			for _, line := range strings.Split(string(listing), "\n")[1:] {
				line = strings.TrimSpace(line)
				if line == "" || strings.HasPrefix(line, "#") {
					continue
				}
				walk(line)
			}
		}
		for _, s := range sets {
			walk(s)
		}
		return out
	}
	allow, deny := expand(allowed), expand(denied)
	var missing []string
	for _, call := range []string{"socket", "bind", "getsockname", "sendto", "recvfrom", "close"} {
		if !allow[call] || deny[call] {
			missing = append(missing, call)
		}
	}
	if len(missing) > 0 {
		t.Fatal(errors.New("SystemCallFilter denies " + strings.Join(missing, ", ") + ", which address discovery over netlink needs"))
	}
}
