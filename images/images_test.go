// Tests of the image integration: the kubelet_authenticator Ansible role is
// applied, through Ansible's chroot connection, to a Debian root file system
// built with mmdebstrap from the machine's package mirror, and the result is
// checked as a node would use it.
package images_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// rootfsPackages are installed on top of mmdebstrap's minbase variant:
// systemd for the unit directories and systemd-analyze --root, python3 for
// Ansible's modules.
var rootfsPackages = []string{"systemd", "python3"}

// maxExposure is the systemd-analyze security threshold (as in systemd/).
const maxExposure = 2.0

func repoRoot(t *testing.T) string {
	t.Helper()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Dir(wd)
}

// tools returns the paths of the commands the test runs. A missing one is a
// failure: test/tools/setup.sh installs them.
func tools(t *testing.T, names ...string) map[string]string {
	t.Helper()
	paths := map[string]string{}
	var missing []string
	for _, n := range names {
		p, err := exec.LookPath(n)
		if err != nil {
			missing = append(missing, n)
			continue
		}
		paths[n] = p
	}
	if len(missing) > 0 {
		t.Fatalf("missing tools %v: run test/tools/setup.sh (Debian packages in test/tools/apt-packages.txt)", missing)
	}
	if os.Geteuid() != 0 {
		t.Fatal("the image test builds and enters a root file system: it must run as root")
	}
	return paths
}

func run(t *testing.T, dir string, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// hostMirror returns the machine's Debian suite and the apt sources file
// mmdebstrap should use (KA_IMAGE_MIRROR overrides it: a file or a URL).
func hostMirror(t *testing.T) (suite, mirror string, mirrorKey []byte) {
	t.Helper()
	osRelease, err := os.ReadFile("/etc/os-release")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^VERSION_CODENAME=(\S+)$`).FindSubmatch(osRelease)
	if m == nil {
		t.Fatal("no VERSION_CODENAME in /etc/os-release: the image test needs a Debian host")
	}
	suite = string(m[1])
	mirror = os.Getenv("KA_IMAGE_MIRROR")
	if mirror == "" {
		for _, f := range []string{"/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list"} {
			if _, err := os.Stat(f); err == nil {
				mirror = f
				break
			}
		}
	}
	if mirror == "" {
		t.Fatal("no Debian apt sources on this machine; set KA_IMAGE_MIRROR")
	}
	mirrorKey = []byte(mirror)
	if data, err := os.ReadFile(mirror); err == nil {
		mirrorKey = data
	}
	return suite, mirror, mirrorKey
}

// rootfsTarball returns a cached Debian root file system tarball, building it
// with mmdebstrap when the cache has none for these inputs.
func rootfsTarball(t *testing.T, mmdebstrap string) string {
	t.Helper()
	suite, mirror, mirrorKey := hostMirror(t)
	version, _ := exec.Command(mmdebstrap, "--version").Output()
	h := sha256.New()
	fmt.Fprintf(h, "suite=%s\npackages=%s\nmmdebstrap=%s\n", suite, strings.Join(rootfsPackages, ","), bytes.TrimSpace(version))
	h.Write(mirrorKey)
	sum := hex.EncodeToString(h.Sum(nil))[:16]

	cache := os.Getenv("KA_CACHE_DIR")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			t.Fatal(err)
		}
		cache = filepath.Join(home, ".cache", "kubelet-authenticator")
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		t.Fatal(err)
	}
	tarball := filepath.Join(cache, "rootfs-"+sum+".tar")
	if _, err := os.Stat(tarball); err == nil {
		t.Logf("root file system from cache: %s", tarball)
		return tarball
	}
	start := time.Now()
	tmp := tarball + ".tmp-" + strconv.Itoa(os.Getpid()) + ".tar"
	defer os.Remove(tmp)
	run(t, "", nil, mmdebstrap,
		"--variant=minbase", "--quiet",
		"--include="+strings.Join(rootfsPackages, ","),
		"--dpkgopt=path-exclude=/usr/share/man/*",
		"--dpkgopt=path-exclude=/usr/share/doc/*",
		"--dpkgopt=path-exclude=/usr/share/locale/*",
		suite, tmp, mirror)
	if err := os.Rename(tmp, tarball); err != nil {
		t.Fatal(err)
	}
	t.Logf("built %s in %s", tarball, time.Since(start).Round(time.Second))
	return tarball
}

// kubeletStub stands for what image-builder installs before the role: kubelet
// and the drop-in of kubeadm's packages.
var kubeletStub = map[string]string{
	"usr/bin/kubelet": "#!/bin/sh\nexit 0\n",
	"usr/lib/systemd/system/kubelet.service": `[Unit]
Description=kubelet: The Kubernetes Node Agent
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
RestartSec=10

[Install]
WantedBy=multi-user.target
`,
	"usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf": `[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
`,
}

func TestRoleOnDebianRootfs(t *testing.T) {
	start := time.Now()
	tl := tools(t, "mmdebstrap", "ansible-playbook", "systemd-analyze", "systemd-tmpfiles", "tar", "go", "chroot", "mount", "umount")
	repo := repoRoot(t)
	work := t.TempDir()

	// A release build (no build tags) of the node binary, with the flags go
	// test uses, so that it comes mostly from the build cache.
	bin := filepath.Join(work, "bin")
	t0 := time.Now()
	run(t, repo, nil, tl["go"], "build", "-o", filepath.Join(bin, "kubelet-authenticator"), "./cmd/kubelet-authenticator")
	run(t, repo, []string{"CGO_ENABLED=0"}, tl["go"], "build", "-o", filepath.Join(bin, "tpm-boot-policy"), "./cmd/tpm-boot-policy")
	t.Logf("built kubelet-authenticator and tpm-boot-policy in %s", time.Since(t0).Round(time.Second))

	tarball := rootfsTarball(t, tl["mmdebstrap"])
	root := filepath.Join(work, "rootfs")
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatal(err)
	}
	run(t, "", nil, tl["tar"], "-C", root, "--numeric-owner", "-xpf", tarball)
	for path, content := range kubeletStub {
		mode := os.FileMode(0o644)
		if strings.HasPrefix(path, "usr/bin/") {
			mode = 0o755
		}
		writeFile(t, filepath.Join(root, path), content, mode)
	}

	// The image's boot, for the golden-values step: a real machine's
	// event log (go-tpm-tools', from the module cache) where the kernel
	// would publish its own.
	bootLog, err := tpmtest.RealEventLogPath("rhel8-uefi.bin")
	if err != nil {
		t.Fatal(err)
	}
	rawLog, err := os.ReadFile(bootLog)
	if err != nil {
		t.Fatal(err)
	}
	const imageLog = "/run/reference-boot/binary_bios_measurements"
	writeFile(t, filepath.Join(root, imageLog), string(rawLog), 0o444)
	policyOut := filepath.Join(work, "tpm-boot-policy.yaml")

	// Apply the role as image-builder would, through the chroot connection.
	inventory := filepath.Join(work, "inventory")
	writeFile(t, inventory, fmt.Sprintf("[nodes]\nrootfs ansible_host=%s ansible_connection=community.general.chroot ansible_python_interpreter=/usr/bin/python3\n", root), 0o644)
	env := []string{
		"ANSIBLE_ROLES_PATH=" + filepath.Join(repo, "images/ansible/roles"),
		"ANSIBLE_LOCAL_TEMP=" + filepath.Join(work, "ansible-local"),
		"ANSIBLE_HOME=" + filepath.Join(work, "ansible-home"),
		"ANSIBLE_NOCOWS=1",
		"ANSIBLE_RETRY_FILES_ENABLED=0",
		"ANSIBLE_FORCE_COLOR=0",
	}
	args := []string{"-i", inventory, filepath.Join(repo, "images/ansible/kubelet-authenticator.yml"),
		"-e", "kubelet_authenticator_binary_src=" + filepath.Join(bin, "kubelet-authenticator"),
		"-e", "kubelet_authenticator_write_config=true",
		"-e", "kubelet_authenticator_attestor=aws",
		"-e", "kubelet_authenticator_request_timeout=3m",
		"-e", `{"kubelet_authenticator_tpm_endorsement_keys": ["ecc-p256"]}`,
		"-e", "kubelet_authenticator_metrics_socket=true",
		"-e", "kubelet_authenticator_boot_policy_tool=" + filepath.Join(bin, "tpm-boot-policy"),
		"-e", "kubelet_authenticator_boot_policy_event_log=" + imageLog,
		"-e", "kubelet_authenticator_boot_policy_dest=" + policyOut,
	}
	out := run(t, "", env, tl["ansible-playbook"], args...)
	if !regexp.MustCompile(`rootfs\s+: ok=\d+\s+changed=\d+\s+unreachable=0\s+failed=0`).MatchString(out) {
		t.Fatalf("unexpected play recap:\n%s", out)
	}
	// A second run changes nothing.
	out = run(t, "", env, tl["ansible-playbook"], args...)
	if !regexp.MustCompile(`rootfs\s+: ok=\d+\s+changed=0\s+unreachable=0\s+failed=0`).MatchString(out) {
		t.Errorf("second run changed the image:\n%s", out)
	}

	t.Run("files and modes", func(t *testing.T) {
		want := map[string]os.FileMode{
			"usr/local/bin/kubelet-authenticator":                                0o755,
			"usr/local/libexec/kubelet-authenticator/prepare-kubelet":            0o755,
			"etc/systemd/system/kubelet-authenticator.service":                   0o644,
			"etc/systemd/system/kubelet.service.d/10-kubelet-authenticator.conf": 0o644,
			"etc/tmpfiles.d/kubelet-authenticator.conf":                          0o644,
			"etc/systemd/system/kubelet-authenticator-metrics.socket":            0o644,
			"etc/sysusers.d/kubelet-authenticator.conf":                          0o644,
			"etc/kubelet-authenticator/kubelet-kubeconfig.yaml":                  0o644,
			"etc/kubelet-authenticator/config.yaml":                              0o644,
			"var/lib/kubelet-authenticator":                                      0o700 | os.ModeDir,
			"etc/kubernetes/trust-bundles":                                       0o755 | os.ModeDir,
		}
		for path, mode := range want {
			fi, err := os.Lstat(filepath.Join(root, path))
			if err != nil {
				t.Errorf("%s: %v", path, err)
				continue
			}
			if fi.Mode() != mode {
				t.Errorf("%s: mode %v, want %v", path, fi.Mode(), mode)
			}
		}
	})

	t.Run("installed files are the ones systemd/ tests", func(t *testing.T) {
		same := map[string]string{
			"systemd/kubelet-authenticator.service":        "etc/systemd/system/kubelet-authenticator.service",
			"systemd/10-kubelet-authenticator.conf":        "etc/systemd/system/kubelet.service.d/10-kubelet-authenticator.conf",
			"systemd/kubelet-authenticator.tmpfiles.conf":  "etc/tmpfiles.d/kubelet-authenticator.conf",
			"systemd/kubelet-kubeconfig.yaml":              "etc/kubelet-authenticator/kubelet-kubeconfig.yaml",
			"systemd/prepare-kubelet":                      "usr/local/libexec/kubelet-authenticator/prepare-kubelet",
			"systemd/kubelet-authenticator-metrics.socket": "etc/systemd/system/kubelet-authenticator-metrics.socket",
			"systemd/kubelet-authenticator.sysusers.conf":  "etc/sysusers.d/kubelet-authenticator.conf",
		}
		for src, dst := range same {
			a, err := os.ReadFile(filepath.Join(repo, src))
			if err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(filepath.Join(root, dst))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(a, b) {
				t.Errorf("the role installs a %s that differs from %s: keep the role's templates and systemd/ in step", dst, src)
			}
		}
	})

	t.Run("node configuration", func(t *testing.T) {
		c, err := config.Load(filepath.Join(root, "etc/kubelet-authenticator/config.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		if c.Attestor != "aws" || c.RequestTimeout.Duration != 3*time.Minute || len(c.TPM.EndorsementKeys) != 1 ||
			c.CacheDir != config.DefaultCacheDir || c.BootstrapKubeconfig != config.DefaultBootstrapKubeconfig {
			t.Errorf("config = %+v", c)
		}
		c.NodeName = "node-0"
		c.Default()
		if err := c.Validate(); err != nil {
			t.Errorf("the written configuration does not validate: %v", err)
		}
	})

	t.Run("boot policy recorded on the build host, tool gone from the image", func(t *testing.T) {
		doc, err := os.ReadFile(policyOut)
		if err != nil {
			t.Fatal(err)
		}
		p, err := tpm.ParsePolicy(doc)
		if err != nil {
			t.Fatalf("the recorded policy does not parse: %v\n%s", err, doc)
		}
		if !p.RequireSecureBoot || len(p.AllowedKernelDigests) != 1 {
			t.Errorf("the policy does not pin the image's Secure Boot boot:\n%s", doc)
		}
		left, _ := filepath.Glob(filepath.Join(root, "tmp", "*tpm-boot-policy*"))
		if len(left) > 0 {
			t.Errorf("left in the image: %q", left)
		}
	})

	t.Run("groups", func(t *testing.T) {
		data, err := os.ReadFile(filepath.Join(root, "etc/group"))
		if err != nil {
			t.Fatal(err)
		}
		for _, g := range []string{"tss", "kubelet-authenticator-metrics"} {
			if !regexp.MustCompile(`(?m)^` + g + `:`).Match(data) {
				t.Errorf("no group %s in the image", g)
			}
		}
		link := filepath.Join(root, "etc/systemd/system/sockets.target.wants/kubelet-authenticator-metrics.socket")
		if _, err := os.Readlink(link); err != nil {
			t.Errorf("metrics socket not enabled: %v", err)
		}
	})

	t.Run("unit enabled", func(t *testing.T) {
		for _, wants := range []string{"multi-user.target.wants", "kubelet.service.wants"} {
			link := filepath.Join(root, "etc/systemd/system", wants, "kubelet-authenticator.service")
			target, err := os.Readlink(link)
			if err != nil {
				t.Errorf("%s: %v", wants, err)
				continue
			}
			if target != "/etc/systemd/system/kubelet-authenticator.service" {
				t.Errorf("%s -> %s", link, target)
			}
		}
	})

	t.Run("systemd-analyze in the root", func(t *testing.T) {
		out, err := exec.Command(tl["systemd-analyze"], "verify", "--root="+root, "--man=false",
			"kubelet-authenticator.service", "kubelet-authenticator-metrics.socket", "kubelet.service").CombinedOutput()
		if err != nil || len(bytes.TrimSpace(out)) > 0 {
			t.Errorf("systemd-analyze verify: %v\n%s", err, out)
		}
		out, err = exec.Command(tl["systemd-analyze"], "security", "--offline=true", "--no-pager", "--root="+root,
			"kubelet-authenticator.service").CombinedOutput()
		if err != nil {
			t.Fatalf("systemd-analyze security: %v\n%s", err, out)
		}
		m := regexp.MustCompile(`Overall exposure level for kubelet-authenticator.service: ([0-9.]+)`).FindSubmatch(out)
		if m == nil {
			t.Fatalf("no exposure level:\n%s", out)
		}
		if level, _ := strconv.ParseFloat(string(m[1]), 64); level > maxExposure {
			t.Errorf("exposure %.1f above %.1f", level, maxExposure)
		}
	})

	t.Run("binaries run in the image", func(t *testing.T) {
		proc := filepath.Join(root, "proc")
		run(t, "", nil, tl["mount"], "-t", "proc", "proc", proc)
		defer func() { _ = exec.Command(tl["umount"], "-l", proc).Run() }()
		// The image's own systemd-tmpfiles accepts the entry.
		run(t, "", nil, "chroot", root, "systemd-tmpfiles", "--create", "/etc/tmpfiles.d/kubelet-authenticator.conf")
		out := run(t, "", nil, "chroot", root, "/usr/local/bin/kubelet-authenticator", "version")
		if strings.TrimSpace(out) == "" {
			t.Error("no version printed")
		}
		// prepare-kubelet with kubeadm's bootstrap kubeconfig in place
		// writes kubelet's exec-plugin kubeconfig.
		writeFile(t, filepath.Join(root, "etc/kubernetes/bootstrap-kubelet.conf"), `apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority-data: `+"QUJD"+`
    server: https://192.0.2.10:6443
  name: kubernetes
contexts:
- context:
    cluster: kubernetes
    user: tls-bootstrap-token-user
  name: tls-bootstrap-token-user@kubernetes
current-context: tls-bootstrap-token-user@kubernetes
users:
- name: tls-bootstrap-token-user
  user:
    token: abcdef.0123456789abcdef
`, 0o600)
		run(t, "", nil, "chroot", root, "/usr/local/libexec/kubelet-authenticator/prepare-kubelet")
		kc, err := os.ReadFile(filepath.Join(root, "etc/kubernetes/kubelet.conf"))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Contains(kc, []byte("server: https://192.0.2.10:6443")) || !bytes.Contains(kc, []byte("command: /usr/local/bin/kubelet-authenticator")) {
			t.Errorf("kubelet.conf:\n%s", kc)
		}
		env, err := os.ReadFile(filepath.Join(root, "run/kubelet-authenticator/kubelet.env"))
		if err != nil || !strings.Contains(string(env), "--rotate-certificates=false") || strings.Contains(string(env), "bootstrap-kubeconfig") {
			t.Errorf("kubelet.env = %q (%v)", env, err)
		}
	})
	t.Logf("image test took %s", time.Since(start).Round(time.Second))
}

func writeFile(t *testing.T, path, content string, mode os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}
