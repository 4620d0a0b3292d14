//go:build tpmsimulator

package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// annotationTPMPolicy holds a Cluster's TPM boot-state policy.
const annotationTPMPolicy = "kubelet-authenticator.x-k8s.io/tpm-policy"

// TestBootState runs boot-state attestation end to end: two swtpm TPMs
// hold real machines' boots in their PCRs (go-tpm-tools' event logs of a
// RHEL 8 machine with Secure Boot and of an Ubuntu 21.04 machine without,
// extended into them), the real node binary quotes its TPM and sends the
// log from its eventLogPath, and the real controller decides under the
// Cluster's tpm-policy annotation, which the golden-values tool
// (tpm-boot-policy) made from the Secure Boot machine's log.
func TestBootState(t *testing.T) {
	const sbName, noSBName = "rhel8-uefi.bin", "ubuntu-2104-no-secure-boot.bin"
	sbLog, sbRaw := realEventLog(t, sbName)
	noSBLog, noSBRaw := realEventLog(t, noSBName)
	sbSock, sbBundle := harness.StartSwtpm(t, sbRaw)
	noSBSock, noSBBundle := harness.StartSwtpm(t, noSBRaw)

	golden := goldenPolicy(t, sbLog)
	goldenPol, err := tpm.ParsePolicy(golden)
	if err != nil {
		t.Fatalf("the tool's policy does not parse: %v\n%s", err, golden)
	}
	if !goldenPol.RequireSecureBoot || len(goldenPol.AllowedKernelDigests) != 1 || len(goldenPol.AllowedBootLoaderDigests) == 0 {
		t.Fatalf("the golden policy of a Secure Boot machine does not pin its boot:\n%s", golden)
	}
	kernel := goldenPol.AllowedKernelDigests[0]

	args := []string{"--tpm-manufacturer-ca=" + sbBundle, "--tpm-manufacturer-ca=" + noSBBundle}
	env := scenario.Start(t, scenario.Options{Attestors: "tpm", NoController: true})
	env.AnnotateCluster(t, annotationTPMPolicy, string(golden))
	env.StartController(t, args...)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	node := func(name, sock, log string) *scenario.Node {
		n := env.NewNode(t, name, "test:///fleet/"+name, "tpm", "tpm:\n  device: unix://"+sock+"\n  eventLogPath: "+log+"\n")
		env.Machine(t, n)
		return n
	}
	sb := node("boot-sb", sbSock, sbLog)

	t.Run("the image's boot joins under its golden policy", func(t *testing.T) {
		whoami(ctx, t, env, sb)
		checkRound(t, env, sb.Name)
		first, _ := tpmCSRs(t, env, sb.Name)
		r, err := attestor.ParseRequest(first.Spec.Request)
		if err != nil {
			t.Fatal(err)
		}
		ev, err := tpm.DecodeEvidence(r.Evidence)
		if err != nil {
			t.Fatal(err)
		}
		if ev.Version != tpm.VersionV4 || len(ev.Attestation.Quote) == 0 || !bytes.Equal(ev.Attestation.EventLog, sbRaw) {
			t.Errorf("CSR #1 carries evidence %s, quote %d bytes, event log %d bytes; want v4 with a quote and the node's %d-byte log",
				ev.Version, len(ev.Attestation.Quote), len(ev.Attestation.EventLog), len(sbRaw))
		}
		// The answer quotes the PCRs again, for the boot that answered.
		_, second := tpmCSRs(t, env, sb.Name)
		r2, err := attestor.ParseRequest(second.Spec.Request)
		if err != nil {
			t.Fatal(err)
		}
		if ev2, err := tpm.DecodeEvidence(r2.Evidence); err != nil || ev2.Response == nil || len(ev2.Response.Quote) == 0 || len(ev2.Response.PCRs) != len(ev.Attestation.PCRs) {
			t.Errorf("CSR #2 carries no fresh quote of the %d PCRs (%v)", len(ev.Attestation.PCRs), err)
		}
	})

	t.Run("a machine booted without Secure Boot is denied", func(t *testing.T) {
		n := node("boot-nosb", noSBSock, noSBLog)
		r := n.Credential(ctx)
		if r.Err == nil {
			t.Fatal("a machine booted without Secure Boot got a certificate under requireSecureBoot")
		}
		if !strings.Contains(lastLine(r.Stderr), tpm.ReasonSecureBootDisabled) {
			t.Errorf("the node's last line does not name the reason: %q", lastLine(r.Stderr))
		}
		csrs := nodeCSRs(t, env, n.Name)
		if len(csrs) != 1 {
			t.Fatalf("%d CSRs, want the one attestation", len(csrs))
		}
		c := wantDenied(t, env, csrs[0].Name, tpm.ReasonSecureBootDisabled)
		// Every violated rule is listed at once.
		msg := strings.Join(conditions(c), "\n")
		for _, want := range []string{tpm.ReasonSecureBootDisabled, tpm.ReasonKernelNotAllowed, tpm.ReasonBootLoaderNotAllowed} {
			if !strings.Contains(msg, want) {
				t.Errorf("the denial does not list %s: %s", want, msg)
			}
		}
		wantEvent(t, env, "machine-"+n.Name, corev1.EventTypeWarning, tpm.ReasonSecureBootDisabled, "denied")
	})

	t.Run("renewal re-attests: a kernel the policy no longer allows cannot renew, and status says why", func(t *testing.T) {
		// The fleet moves on to another kernel: the policy allows only
		// that one, and the machine that still boots the old kernel
		// reaches its renewal point.
		next := strings.Replace(string(golden), kernel, strings.Repeat("ab", 32), 1)
		if next == string(golden) {
			t.Fatalf("the golden policy does not name kernel %s", kernel)
		}
		// The running controller takes the new policy: it replaces the
		// Cluster's CSR controller (the old one stopped first).
		started := strings.Count(env.ControllerLog(), "Started the CSR controller")
		env.AnnotateCluster(t, annotationTPMPolicy, next)
		harness.WaitFor(t, time.Minute, func() (bool, error) {
			log := env.ControllerLog()
			if strings.Contains(log, "CSR controller is still stopping") {
				return false, fmt.Errorf("the old CSR controller did not stop in time:\n%s", harness.LastLines(log, 20))
			}
			return strings.Count(log, "Started the CSR controller") > started, nil
		})

		// The node's certificate is past its renewal point (issued a day
		// ago, half an hour left): the agent renews at once, with fresh
		// evidence from the TPM.
		cached, err := (cache.Dir{Path: sb.CacheDir}).Load()
		if err != nil {
			t.Fatal(err)
		}
		due, err := env.Workload.CA.Sign(harness.CertSpec{CommonName: attestor.NodeUserPrefix + sb.Name, Organization: []string{attestor.NodesGroup},
			NotAfter: time.Now().Add(30 * time.Minute)}, cached.Key.Public())
		if err != nil {
			t.Fatal(err)
		}
		if err := (cache.Dir{Path: sb.CacheDir}).Store(due, cached.KeyPEM); err != nil {
			t.Fatal(err)
		}
		before := map[string]bool{}
		for _, c := range nodeCSRs(t, env, sb.Name) {
			before[c.Name] = true
		}
		agent := harness.StartProcess(t, "agent-"+sb.Name, filepath.Join(env.Dir, "agent-"+sb.Name+".log"),
			filepath.Join(env.BinDir, "kubelet-authenticator"), "agent", "--config="+sb.ConfigPath, "--metrics-bind-address=0", "-v=2")
		defer agent.Stop(10 * time.Second)

		// The renewal is denied with the kernel's digest, and status says so.
		// Its exit status is 3: a usable certificate whose renewal fails.
		var text string
		harness.WaitFor(t, 3*time.Minute, func() (bool, error) {
			out, err := exec.Command(filepath.Join(env.BinDir, "kubelet-authenticator"), "status", "--config="+sb.ConfigPath).Output()
			var exit *exec.ExitError
			if err != nil && !errors.As(err, &exit) {
				return false, err
			}
			text = string(out)
			failed := strings.Contains(text, "Last renewal:") && strings.Contains(text, "FAILED") && strings.Contains(text, tpm.ReasonKernelNotAllowed)
			if failed && (exit == nil || exit.ExitCode() != 3) {
				return false, fmt.Errorf("status exited %w with a failing renewal, want 3", err)
			}
			return failed, nil
		})
		for _, want := range []string{kernel, "Goes dark:"} {
			if !strings.Contains(text, want) {
				t.Errorf("status does not say %q:\n%s", want, text)
			}
		}
		var filed []string
		for _, c := range nodeCSRs(t, env, sb.Name) {
			if !before[c.Name] {
				filed = append(filed, c.Name)
			}
		}
		if len(filed) == 0 {
			t.Fatal("the agent filed no renewal")
		}
		c := wantDenied(t, env, filed[0], tpm.ReasonKernelNotAllowed)
		if msg := strings.Join(conditions(c), "\n"); !strings.Contains(msg, kernel) {
			t.Errorf("the denial does not name the kernel's digest %s: %s", kernel, msg)
		}
		wantEvent(t, env, "machine-"+sb.Name, corev1.EventTypeWarning, tpm.ReasonKernelNotAllowed, kernel)
		// A failed renewal keeps the certificate the node has.
		kept, err := (cache.Dir{Path: sb.CacheDir}).Load()
		if err != nil || !bytes.Equal(kept.CertPEM, due) {
			t.Errorf("the failed renewal replaced the node's certificate (%v)", err)
		}
	})
}

// realEventLog returns the path and bytes of one of go-tpm-tools' real
// event logs in the module cache.
func realEventLog(t *testing.T, name string) (string, []byte) {
	t.Helper()
	path, err := tpmtest.RealEventLogPath(name)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("real event log missing: %v", err)
	}
	return path, raw
}

// goldenPolicy builds and runs the golden-values tool on an event log and
// returns the policy it prints.
func goldenPolicy(t *testing.T, log string) []byte {
	t.Helper()
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "tpm-boot-policy")
	build := exec.Command("go", "build", "-o", bin, "./cmd/tpm-boot-policy")
	build.Dir = root
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("unable to build tpm-boot-policy: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "--event-log", log).Output()
	if err != nil {
		t.Fatalf("tpm-boot-policy: %v", err)
	}
	return out
}

// wantEvent waits for the controller's Event on the named Machine of the
// given type, with reason (any when empty) and a message containing text.
func wantEvent(t *testing.T, env *scenario.Env, machine, typ, reason, text string) {
	t.Helper()
	harness.WaitFor(t, time.Minute, func() (bool, error) {
		list, err := env.Mgmt.ControlPlane.Client.CoreV1().Events(env.Namespace).List(context.Background(), metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("involvedObject.name", machine).String(),
		})
		if err != nil {
			return false, err
		}
		var seen []string
		for _, e := range list.Items {
			seen = append(seen, e.Type+"/"+e.Reason+": "+e.Message)
			if e.InvolvedObject.Kind == "Machine" && e.Type == typ && (reason == "" || e.Reason == reason) && strings.Contains(e.Message, text) {
				return true, nil
			}
		}
		return false, fmt.Errorf("no %s Event %q mentioning %q on Machine %s; its Events: %q", typ, reason, text, machine, seen)
	})
}
