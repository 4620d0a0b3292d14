// Tests of the node's systemd integration: the agent unit passes
// systemd-analyze verify and stays at or below an exposure threshold in
// systemd-analyze security, the kubelet drop-in combines with kubeadm's, and
// prepare-kubelet turns kubeadm's bootstrap kubeconfig into a kubeconfig
// whose user is the exec credential plugin.
package systemd_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
)

// maxExposure is the highest overall exposure level systemd-analyze security
// may give the agent unit (0 = locked down, 10 = unprotected). The unit
// scores 2.0 ("OK") with systemd 252: what keeps it above zero is root as
// the user (shared 0600 cache with the exec plugin that kubelet runs), host
// network (API server, metadata services) and the TPM device.
const maxExposure = 2.0

const (
	unitName      = "kubelet-authenticator.service"
	socketName    = "kubelet-authenticator-metrics.socket"
	sysusersName  = "kubelet-authenticator.sysusers.conf"
	dropInName    = "10-kubelet-authenticator.conf"
	templateName  = "kubelet-kubeconfig.yaml"
	prepareScript = "prepare-kubelet"
	binPath       = "/usr/local/bin/kubelet-authenticator"
	libexecDir    = "/usr/local/libexec/kubelet-authenticator"
)

// kubeadmDropIn is the drop-in kubeadm's packages install for kubelet
// (10-kubeadm.conf), which ours overrides.
const kubeadmDropIn = `[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
`

const kubeletUnit = `[Unit]
Description=kubelet: The Kubernetes Node Agent
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
RestartSec=10

[Install]
WantedBy=multi-user.target
`

func systemdAnalyze(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Fatalf("systemd-analyze is required (Debian package systemd): %v", err)
	}
	return path
}

// nodeRoot lays out a root directory holding the units as installed, the
// system's targets and slices, stub executables and kubelet with kubeadm's
// drop-in, so that systemd-analyze --root sees a node.
func nodeRoot(t *testing.T, withBinary bool) string {
	t.Helper()
	root := t.TempDir()
	systemUnits := filepath.Join(root, "usr/lib/systemd/system")
	mkdir(t, systemUnits)
	for _, pattern := range []string{"*.target", "*.slice"} {
		matches, _ := filepath.Glob(filepath.Join(hostUnitDir(t), pattern))
		for _, m := range matches {
			if fi, err := os.Lstat(m); err != nil || !fi.Mode().IsRegular() {
				continue
			}
			copyFile(t, m, filepath.Join(systemUnits, filepath.Base(m)), 0o644)
		}
	}
	write(t, filepath.Join(systemUnits, "kubelet.service"), kubeletUnit, 0o644)
	write(t, filepath.Join(root, "usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf"), kubeadmDropIn, 0o644)
	copyFile(t, unitName, filepath.Join(root, "etc/systemd/system", unitName), 0o644)
	copyFile(t, socketName, filepath.Join(root, "etc/systemd/system", socketName), 0o644)
	copyFile(t, dropInName, filepath.Join(root, "etc/systemd/system/kubelet.service.d", dropInName), 0o644)
	copyFile(t, prepareScript, filepath.Join(root, libexecDir, prepareScript), 0o755)
	write(t, filepath.Join(root, "usr/bin/kubelet"), "#!/bin/sh\nexit 0\n", 0o755)
	if withBinary {
		write(t, filepath.Join(root, binPath), "#!/bin/sh\nexit 0\n", 0o755)
	}
	return root
}

func hostUnitDir(t *testing.T) string {
	t.Helper()
	for _, d := range []string{"/usr/lib/systemd/system", "/lib/systemd/system"} {
		if _, err := os.Stat(filepath.Join(d, "multi-user.target")); err == nil {
			return d
		}
	}
	t.Fatal("no systemd unit directory with multi-user.target on this machine (Debian package systemd)")
	return ""
}

func TestUnitsVerify(t *testing.T) {
	analyze := systemdAnalyze(t)
	root := nodeRoot(t, true)
	out, err := exec.Command(analyze, "verify", "--root="+root, "--man=false", unitName, socketName, "kubelet.service").CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
	}

	// The check has teeth: a unit whose ExecStart is missing fails it.
	bare := nodeRoot(t, false)
	out, err = exec.Command(analyze, "verify", "--root="+bare, "--man=false", unitName).CombinedOutput()
	if err == nil || !strings.Contains(string(out), binPath) {
		t.Fatalf("systemd-analyze verify passed without %s: %v\n%s", binPath, err, out)
	}
	// ... and kubelet.service is checked with our drop-in applied.
	script := filepath.Join(libexecDir, prepareScript)
	if err := os.Remove(filepath.Join(bare, script)); err != nil {
		t.Fatal(err)
	}
	out, err = exec.Command(analyze, "verify", "--root="+bare, "--man=false", "kubelet.service").CombinedOutput()
	if err == nil || !strings.Contains(string(out), script) {
		t.Fatalf("systemd-analyze verify passed without %s: %v\n%s", script, err, out)
	}
}

var exposureLine = regexp.MustCompile(`Overall exposure level for ` + regexp.QuoteMeta(unitName) + `: ([0-9.]+)`)

func TestUnitSecurityExposure(t *testing.T) {
	analyze := systemdAnalyze(t)
	root := nodeRoot(t, true)
	out, err := exec.Command(analyze, "security", "--offline=true", "--no-pager", "--root="+root, unitName).CombinedOutput()
	if err != nil {
		t.Fatalf("systemd-analyze security: %v\n%s", err, out)
	}
	m := exposureLine.FindSubmatch(out)
	if m == nil {
		t.Fatalf("no overall exposure level in:\n%s", out)
	}
	level, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("exposure level %.1f (threshold %.1f)", level, maxExposure)
	if level > maxExposure {
		t.Fatalf("exposure level %.1f is above %.1f:\n%s", level, maxExposure, out)
	}
}

// unitSettings parses a unit file into section.key -> values in order.
func unitSettings(t *testing.T, path string) map[string][]string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	settings := map[string][]string{}
	section := ""
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";"):
		case strings.HasPrefix(line, "["):
			section = strings.Trim(line, "[]")
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok {
				t.Fatalf("%s: bad line %q", path, line)
			}
			settings[section+"."+k] = append(settings[section+"."+k], v)
		}
	}
	return settings
}

// TestUnitSettings pins what the node relies on, which an exposure score
// alone would not notice going: the TPM stays reachable, the cache stays
// writable, systemd knows when the agent is ready and alive, and its memory
// and task count are bounded. Neither the agent nor kubelet's drop-in
// orders kubelet after the agent: the agent is ready only once it holds a
// certificate, which on a new node follows kubeadm join, which cloud-init
// runs after kubelet's boot-time start (kubelet's exec plugin gets the
// certificate itself).
func TestUnitSettings(t *testing.T) {
	s := unitSettings(t, unitName)
	want := map[string]string{
		"Service.Type":                    "notify",
		"Service.NotifyAccess":            "main",
		"Service.Restart":                 "always",
		"Service.ProtectSystem":           "strict",
		"Service.NoNewPrivileges":         "yes",
		"Service.PrivateTmp":              "yes",
		"Service.ProtectHome":             "yes",
		"Service.DevicePolicy":            "closed",
		"Service.DeviceAllow":             "/dev/tpmrm0 rw",
		"Service.CapabilityBoundingSet":   "",
		"Service.RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
		"Service.StateDirectory":          "kubelet-authenticator",
		"Service.StateDirectoryMode":      "0700",
		"Install.WantedBy":                "multi-user.target kubelet.service",
		"Service.MemoryMax":               "256M",
		"Service.TasksMax":                "128",
	}
	for k, v := range want {
		if got := s[k]; !slices.Contains(got, v) {
			t.Errorf("%s = %q, want %q among them", k, got, v)
		}
	}
	for _, b := range s["Unit.Before"] {
		if strings.Contains(b, "kubelet.service") {
			t.Errorf("Before=%s: kubelet would wait for the agent's first certificate", b)
		}
	}
	for _, a := range unitSettings(t, dropInName)["Unit.After"] {
		if strings.Contains(a, unitName) {
			t.Errorf("kubelet's drop-in has After=%s: kubelet would wait for the agent's first certificate", a)
		}
	}
	if len(s["Service.WatchdogSec"]) == 0 {
		t.Error("no WatchdogSec")
	}
	if !slices.Contains(s["Service.SystemCallFilter"], "@system-service") {
		t.Errorf("SystemCallFilter = %q, want @system-service", s["Service.SystemCallFilter"])
	}
	if got := s["Service.PrivateDevices"]; slices.Contains(got, "yes") {
		t.Error("PrivateDevices=yes hides /dev/tpmrm0")
	}
	// The state directory is the node's default cache directory.
	if got := "/var/lib/" + s["Service.StateDirectory"][0]; got != config.DefaultCacheDir {
		t.Errorf("StateDirectory is %s, the default cache is %s", got, config.DefaultCacheDir)
	}
	if got := s["Service.ExecStart"]; len(got) != 1 || !strings.HasPrefix(got[0], binPath+" agent ") {
		t.Errorf("ExecStart = %q, want %s agent ...", got, binPath)
	}
	if got := s["Service.ExecStart"][0]; !strings.Contains(got, "--config="+config.DefaultPath) {
		t.Errorf("ExecStart = %q does not name %s", got, config.DefaultPath)
	}

	d := unitSettings(t, dropInName)
	if !slices.Contains(d["Service.ExecStartPre"], filepath.Join(libexecDir, prepareScript)) {
		t.Errorf("drop-in ExecStartPre = %q", d["Service.ExecStartPre"])
	}
	if !slices.Contains(d["Service.EnvironmentFile"], "-/run/kubelet-authenticator/kubelet.env") {
		t.Errorf("drop-in EnvironmentFile = %q", d["Service.EnvironmentFile"])
	}
	// systemd applies drop-ins in file name order: ours must come after
	// kubeadm's to override KUBELET_KUBECONFIG_ARGS.
	if dropInName <= "10-kubeadm.conf" {
		t.Errorf("%s sorts before 10-kubeadm.conf", dropInName)
	}
}

// TestControlPlaneSecretsHidden: on a control-plane node the agent (root)
// cannot reach kubeadm's private keys, the admin and component kubeconfigs
// or etcd's data; each is optional ("-") so that workers, which have none,
// start the unit. The cluster CA certificate stays reachable: a bootstrap
// kubeconfig may name /etc/kubernetes/pki/ca.crt.
func TestControlPlaneSecretsHidden(t *testing.T) {
	var hidden []string
	for _, v := range unitSettings(t, unitName)["Service.InaccessiblePaths"] {
		hidden = append(hidden, strings.Fields(v)...)
	}
	for _, p := range []string{
		"/etc/kubernetes/pki/ca.key", "/etc/kubernetes/pki/apiserver.key", "/etc/kubernetes/pki/apiserver-kubelet-client.key",
		"/etc/kubernetes/pki/apiserver-etcd-client.key", "/etc/kubernetes/pki/front-proxy-ca.key",
		"/etc/kubernetes/pki/front-proxy-client.key", "/etc/kubernetes/pki/sa.key", "/etc/kubernetes/pki/etcd",
		"/etc/kubernetes/admin.conf", "/etc/kubernetes/super-admin.conf",
		"/etc/kubernetes/controller-manager.conf", "/etc/kubernetes/scheduler.conf", "/var/lib/etcd",
	} {
		if !slices.Contains(hidden, "-"+p) {
			t.Errorf("InaccessiblePaths does not hide -%s: %q", p, hidden)
		}
	}
	for _, h := range hidden {
		if !strings.HasPrefix(h, "-") {
			t.Errorf("InaccessiblePaths %s without '-': the unit fails where it is missing", h)
		}
		p := strings.TrimPrefix(h, "-")
		for _, needed := range []string{"/etc/kubernetes/pki/ca.crt", config.DefaultBootstrapKubeconfig, config.DefaultCacheDir, config.DefaultPath, "/dev/tpmrm0"} {
			if needed == p || strings.HasPrefix(needed, p+"/") {
				t.Errorf("InaccessiblePaths %s hides %s, which the agent reads", h, needed)
			}
		}
	}
}

// TestTPMDeviceAsUnitCredentials opens a stand-in for /dev/tpmrm0 owned
// by tss:tss 0660, as udev leaves the device, with the credentials the
// unit gives the agent: root with the unit's capability bounding set (none,
// so no CAP_DAC_OVERRIDE) and its supplementary groups. A unit without
// tss among them cannot open the TPM.
func TestTPMDeviceAsUnitCredentials(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown the stand-in device and run as root without capabilities")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Fatalf("setpriv is required (Debian package util-linux): %v", err)
	}
	s := unitSettings(t, unitName)
	if got := s["Service.CapabilityBoundingSet"]; len(got) != 1 || got[0] != "" {
		t.Fatalf("CapabilityBoundingSet = %q; this test models an empty one", got)
	}
	tss, err := user.LookupGroup("tss")
	if err != nil {
		t.Skipf("no tss group on this machine: %v", err)
	}
	gid, _ := strconv.Atoi(tss.Gid)
	uid := gid // a tss user, if any, has no part in the check
	if u, err := user.Lookup("tss"); err == nil {
		uid, _ = strconv.Atoi(u.Uid)
	}
	var groups []string
	for _, v := range s["Service.SupplementaryGroups"] {
		for _, g := range strings.Fields(v) {
			grp, err := user.LookupGroup(g)
			if err != nil {
				t.Fatalf("SupplementaryGroups %s: %v", g, err)
			}
			groups = append(groups, grp.Gid)
		}
	}
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	dev := filepath.Join(dir, "tpmrm0")
	write(t, dev, "", 0o660)
	if err := os.Chown(dev, uid, gid); err != nil {
		t.Fatal(err)
	}
	open := func(groups []string) error {
		args := []string{"--reuid=0", "--regid=0", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"}
		if len(groups) > 0 {
			args = append(args, "--groups="+strings.Join(groups, ","))
		} else {
			args = append(args, "--clear-groups")
		}
		args = append(args, "--", "/bin/sh", "-c", `exec 3<>"$1"`, "sh", dev)
		out, err := exec.Command(setpriv, args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}
	// The check has teeth: without the group, root without capabilities
	// is refused.
	if err := open(nil); err == nil {
		t.Fatal("opened a tss:tss 0660 file as root without capabilities or groups: the check proves nothing here")
	}
	if err := open(groups); err != nil {
		t.Errorf("the agent, with SupplementaryGroups %q, cannot open a tss:tss 0660 TPM device: %v", s["Service.SupplementaryGroups"], err)
	}
}

// TestMetricsSocketUnit: the optional socket unit listens where the agent
// listens by default, hands the socket to the agent, is reachable by its
// group only, and the group (and tss) come from the sysusers.d entry.
func TestMetricsSocketUnit(t *testing.T) {
	s := unitSettings(t, socketName)
	want := map[string]string{
		"Socket.ListenStream":  config.DefaultMetricsSocket,
		"Socket.SocketMode":    "0660",
		"Socket.SocketUser":    "root",
		"Socket.SocketGroup":   "kubelet-authenticator-metrics",
		"Socket.DirectoryMode": "0755",
		"Socket.Service":       unitName,
		"Install.WantedBy":     "sockets.target",
	}
	for k, v := range want {
		if got := s[k]; !slices.Contains(got, v) {
			t.Errorf("%s: %s = %q, want %q among them", socketName, k, got, v)
		}
	}
	if config.DefaultMetricsBindAddress != "unix:"+config.DefaultMetricsSocket {
		t.Errorf("default metrics address %s is not the socket unit's %s", config.DefaultMetricsBindAddress, config.DefaultMetricsSocket)
	}
	svc := unitSettings(t, unitName)
	if !slices.Contains(svc["Unit.After"], socketName) {
		t.Errorf("%s is not ordered after %s: the agent could take the socket's path first", unitName, socketName)
	}
	if got := svc["Service.RuntimeDirectory"]; !slices.Contains(got, strings.TrimPrefix(filepath.Dir(config.DefaultMetricsSocket), "/run/")) {
		t.Errorf("RuntimeDirectory = %q: %s is not writable for the agent under ProtectSystem=strict", got, filepath.Dir(config.DefaultMetricsSocket))
	}
	if !slices.Contains(svc["Service.RuntimeDirectoryPreserve"], "yes") {
		t.Error("RuntimeDirectoryPreserve is not yes: stopping the agent would remove prepare-kubelet's kubelet.env")
	}

	sysusers, err := exec.LookPath("systemd-sysusers")
	if err != nil {
		t.Fatalf("systemd-sysusers is required (Debian package systemd): %v", err)
	}
	root := t.TempDir()
	mkdir(t, filepath.Join(root, "etc"))
	abs, err := filepath.Abs(sysusersName)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(sysusers, "--root="+root, abs).CombinedOutput(); err != nil {
		t.Fatalf("systemd-sysusers: %v\n%s", err, out)
	}
	data, err := os.ReadFile(filepath.Join(root, "etc/group"))
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range append(svc["Service.SupplementaryGroups"], s["Socket.SocketGroup"]...) {
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(g) + `:`).Match(data) {
			t.Errorf("%s does not create group %s:\n%s", sysusersName, g, data)
		}
	}
}

func TestTmpfiles(t *testing.T) {
	data, err := os.ReadFile("kubelet-authenticator.tmpfiles.conf")
	if err != nil {
		t.Fatal(err)
	}
	modes := map[string]string{}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		if len(f) < 5 || f[0] != "d" {
			t.Fatalf("unexpected tmpfiles line %q", line)
		}
		modes[f[1]] = f[2] + " " + f[3] + " " + f[4]
	}
	if got := modes[config.DefaultCacheDir]; got != "0700 root root" {
		t.Errorf("cache dir %s: %q, want 0700 root root", config.DefaultCacheDir, got)
	}
	if _, ok := modes[filepath.Dir(config.DefaultPath)]; !ok {
		t.Errorf("no entry for %s", filepath.Dir(config.DefaultPath))
	}
	// systemd-tmpfiles itself accepts the file and creates the directories.
	tmpfiles, err := exec.LookPath("systemd-tmpfiles")
	if err != nil {
		t.Fatalf("systemd-tmpfiles is required (Debian package systemd): %v", err)
	}
	root := t.TempDir()
	abs, err := filepath.Abs("kubelet-authenticator.tmpfiles.conf")
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(tmpfiles, "--create", "--root="+root, abs).CombinedOutput()
	if err != nil {
		t.Fatalf("systemd-tmpfiles --create: %v\n%s", err, out)
	}
	fi, err := os.Stat(filepath.Join(root, config.DefaultCacheDir))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o700 || !fi.IsDir() {
		t.Errorf("cache dir created as %v", fi.Mode())
	}
}

func TestKubeconfigTemplate(t *testing.T) {
	cfg, err := clientcmd.LoadFromFile(templateName)
	if err != nil {
		t.Fatalf("clientcmd cannot load the template: %v", err)
	}
	// The CA file is kubeadm's; point at a stand-in so that client-go's
	// validation, which reads it, can run here.
	for name, c := range cfg.Clusters {
		if c.CertificateAuthority != "/etc/kubernetes/pki/ca.crt" {
			t.Errorf("cluster %s: certificate-authority %q, want kubeadm's /etc/kubernetes/pki/ca.crt", name, c.CertificateAuthority)
		}
		c.CertificateAuthority = filepath.Join(t.TempDir(), "ca.crt")
		write(t, c.CertificateAuthority, "", 0o644)
	}
	checkExecKubeconfig(t, cfg)
}

// checkExecKubeconfig checks what kubelet and client-go need from the
// kubeconfig: the current context's user is the exec plugin as documented.
func checkExecKubeconfig(t *testing.T, cfg *clientcmdapi.Config) {
	t.Helper()
	if err := clientcmd.Validate(*cfg); err != nil {
		t.Fatalf("kubeconfig does not validate: %v", err)
	}
	ctx := cfg.Contexts[cfg.CurrentContext]
	user := cfg.AuthInfos[ctx.AuthInfo]
	if user == nil || user.Exec == nil {
		t.Fatalf("current user %q has no exec plugin", ctx.AuthInfo)
	}
	e := user.Exec
	if e.APIVersion != "client.authentication.k8s.io/v1" || e.Command != binPath ||
		!slices.Equal(e.Args, []string{"credential"}) || e.InteractiveMode != clientcmdapi.NeverExecInteractiveMode || !e.ProvideClusterInfo {
		t.Errorf("exec = %+v", e)
	}
	if user.ClientCertificate != "" || user.ClientCertificateData != nil || user.Token != "" {
		t.Error("the kubeconfig carries a credential besides the plugin")
	}
	// client-go builds a client configuration from it (kubelet does the same).
	if _, err := clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig(); err != nil {
		t.Errorf("client configuration: %v", err)
	}
}

// prepareEnv is a node's files under a temp dir, as prepare-kubelet sees them.
type prepareEnv struct {
	dir, nodeConfig, bootstrap, kubeconfig, envFile string
}

func newPrepareEnv(t *testing.T, optedIn bool) *prepareEnv {
	t.Helper()
	dir := t.TempDir()
	e := &prepareEnv{
		dir:        dir,
		nodeConfig: filepath.Join(dir, "etc/kubelet-authenticator/config.yaml"),
		bootstrap:  filepath.Join(dir, "etc/kubernetes/bootstrap-kubelet.conf"),
		kubeconfig: filepath.Join(dir, "etc/kubernetes/kubelet.conf"),
		envFile:    filepath.Join(dir, "run/kubelet-authenticator/kubelet.env"),
	}
	mkdir(t, filepath.Dir(e.kubeconfig))
	if optedIn {
		write(t, e.nodeConfig, "apiVersion: "+config.APIVersion+"\nkind: "+config.Kind+"\nattestor: tpm\n", 0o644)
	}
	return e
}

func (e *prepareEnv) run(t *testing.T) (string, error) {
	t.Helper()
	cmd := exec.Command("/bin/sh", prepareScript)
	cmd.Env = append(os.Environ(),
		"KA_NODE_CONFIG="+e.nodeConfig,
		"KA_BOOTSTRAP_KUBECONFIG="+e.bootstrap,
		"KA_KUBELET_KUBECONFIG="+e.kubeconfig,
		"KA_KUBECONFIG_TEMPLATE="+templateName,
		"KA_ENV_FILE="+e.envFile,
	)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// bootstrapKubeconfig is what kubeadm join writes (through client-go): one
// cluster with the CA inline and a bootstrap token.
func bootstrapKubeconfig(t *testing.T, path string, clusters int) []byte {
	t.Helper()
	ca := []byte("-----BEGIN CERTIFICATE-----\nMIIBdzCCAR2gAwIBAgIBADAKBggqhkjOPQQDAjAVMRMwEQYDVQQDEwprdWJlcm5ldGVz\n-----END CERTIFICATE-----\n")
	cfg := clientcmdapi.NewConfig()
	for i := range clusters {
		name := "kubernetes" + strings.Repeat("x", i)
		cfg.Clusters[name] = &clientcmdapi.Cluster{Server: "https://10.0.0." + strconv.Itoa(i+1) + ":6443", CertificateAuthorityData: ca}
		cfg.Contexts["tls-bootstrap-token-user@"+name] = &clientcmdapi.Context{Cluster: name, AuthInfo: "tls-bootstrap-token-user"}
		cfg.CurrentContext = "tls-bootstrap-token-user@" + name
	}
	cfg.AuthInfos["tls-bootstrap-token-user"] = &clientcmdapi.AuthInfo{Token: "abcdef.0123456789abcdef"}
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return ca
}

func TestPrepareKubeletWritesKubeconfigFromBootstrap(t *testing.T) {
	e := newPrepareEnv(t, true)
	ca := bootstrapKubeconfig(t, e.bootstrap, 1)
	out, err := e.run(t)
	if err != nil {
		t.Fatalf("prepare-kubelet: %v\n%s", err, out)
	}
	fi, err := os.Stat(e.kubeconfig)
	if err != nil {
		t.Fatalf("no kubelet kubeconfig: %v\n%s", err, out)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("kubelet kubeconfig mode %v, want 0600", fi.Mode().Perm())
	}
	cfg, err := clientcmd.LoadFromFile(e.kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	checkExecKubeconfig(t, cfg)
	cluster := cfg.Clusters[cfg.Contexts[cfg.CurrentContext].Cluster]
	if cluster.Server != "https://10.0.0.1:6443" || !bytes.Equal(cluster.CertificateAuthorityData, ca) || cluster.CertificateAuthority != "" {
		t.Errorf("cluster = server %q, CA file %q, CA data %q", cluster.Server, cluster.CertificateAuthority, cluster.CertificateAuthorityData)
	}
	// The bootstrap token is not copied.
	if data, _ := os.ReadFile(e.kubeconfig); bytes.Contains(data, []byte("abcdef")) {
		t.Error("the bootstrap token leaked into kubelet's kubeconfig")
	}
	wantEnv := "KUBELET_KUBECONFIG_ARGS=--kubeconfig=" + e.kubeconfig + " --rotate-certificates=false\n"
	if got, err := os.ReadFile(e.envFile); err != nil || string(got) != wantEnv {
		t.Errorf("env file = %q (%v), want %q", got, err, wantEnv)
	}

	// Later starts (kubeadm has removed the bootstrap kubeconfig) keep the
	// kubeconfig and the flags.
	if err := os.Remove(e.bootstrap); err != nil {
		t.Fatal(err)
	}
	before, _ := os.ReadFile(e.kubeconfig)
	if out, err := e.run(t); err != nil {
		t.Fatalf("second run: %v\n%s", err, out)
	}
	after, _ := os.ReadFile(e.kubeconfig)
	if !bytes.Equal(before, after) {
		t.Error("kubeconfig rewritten on a later start")
	}
	if got, _ := os.ReadFile(e.envFile); string(got) != wantEnv {
		t.Errorf("env file after restart = %q", got)
	}
}

func TestPrepareKubeletCAFile(t *testing.T) {
	e := newPrepareEnv(t, true)
	write(t, e.bootstrap, `apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority: /etc/kubernetes/pki/ca.crt
    server: "https://cp.example.test:6443"
  name: c
contexts:
- context: {cluster: c, user: u}
  name: x
current-context: x
users:
- name: u
  user:
    token: abcdef.0123456789abcdef
`, 0o600)
	if out, err := e.run(t); err != nil {
		t.Fatalf("prepare-kubelet: %v\n%s", err, out)
	}
	cfg, err := clientcmd.LoadFromFile(e.kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	c := cfg.Clusters[cfg.Contexts[cfg.CurrentContext].Cluster]
	if c.Server != "https://cp.example.test:6443" || c.CertificateAuthority != "/etc/kubernetes/pki/ca.crt" {
		t.Errorf("cluster = %+v", c)
	}
}

func TestPrepareKubeletLeavesOthersAlone(t *testing.T) {
	t.Run("not opted in", func(t *testing.T) {
		e := newPrepareEnv(t, false)
		bootstrapKubeconfig(t, e.bootstrap, 1)
		write(t, e.envFile, "stale\n", 0o644)
		if out, err := e.run(t); err != nil {
			t.Fatalf("prepare-kubelet: %v\n%s", err, out)
		}
		if _, err := os.Stat(e.kubeconfig); err == nil {
			t.Error("kubeconfig written on a node without NodeConfig")
		}
		if _, err := os.Stat(e.envFile); err == nil {
			t.Error("env file left in place")
		}
	})
	t.Run("kubeadm init node", func(t *testing.T) {
		e := newPrepareEnv(t, true)
		const kubeadmOwn = "apiVersion: v1\nkind: Config\nusers:\n- name: system:node:cp-0\n  user:\n    client-certificate-data: QUJD\n    client-key-data: QUJD\n"
		write(t, e.kubeconfig, kubeadmOwn, 0o600)
		bootstrapKubeconfig(t, e.bootstrap, 1)
		if out, err := e.run(t); err != nil {
			t.Fatalf("prepare-kubelet: %v\n%s", err, out)
		}
		if got, _ := os.ReadFile(e.kubeconfig); string(got) != kubeadmOwn {
			t.Error("kubeadm's kubelet.conf was changed")
		}
		if _, err := os.Stat(e.envFile); err == nil {
			t.Error("kubelet's flags changed for a kubeconfig that is not the plugin's")
		}
	})
	t.Run("before join", func(t *testing.T) {
		e := newPrepareEnv(t, true)
		if out, err := e.run(t); err != nil {
			t.Fatalf("prepare-kubelet: %v\n%s", err, out)
		}
		if _, err := os.Stat(e.kubeconfig); err == nil {
			t.Error("kubeconfig written without a bootstrap kubeconfig")
		}
	})
}

func TestPrepareKubeletRejectsAmbiguousBootstrap(t *testing.T) {
	e := newPrepareEnv(t, true)
	bootstrapKubeconfig(t, e.bootstrap, 2)
	out, err := e.run(t)
	if err == nil || !strings.Contains(out, "exactly one cluster") {
		t.Fatalf("prepare-kubelet accepted two clusters: %v\n%s", err, out)
	}
	if _, err := os.Stat(e.kubeconfig); err == nil {
		t.Error("kubeconfig written from an ambiguous bootstrap kubeconfig")
	}
}

func mkdir(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
}

func write(t *testing.T, path, content string, mode os.FileMode) {
	t.Helper()
	mkdir(t, filepath.Dir(path))
	if err := os.WriteFile(path, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

func copyFile(t *testing.T, src, dst string, mode os.FileMode) {
	t.Helper()
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	write(t, dst, string(data), mode)
}
