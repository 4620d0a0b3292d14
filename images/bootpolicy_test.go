package images_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
)

// TestRoleRecordsBootPolicy runs the role's golden-values step
// (tasks/boot-policy.yml) the way an image build does, with a real
// machine's measured-boot event log (go-tpm-tools', from the module cache)
// standing for the boot the build VM made: the policy it writes on the
// Ansible host is what tpm-boot-policy prints for that log, and the
// controller reads it from the Cluster's annotation as a valid policy that
// admits exactly that boot.
func TestRoleRecordsBootPolicy(t *testing.T) {
	playbook, err := exec.LookPath("ansible-playbook")
	if err != nil {
		t.Fatal("ansible-playbook not found: run test/tools/setup.sh (Debian packages in test/tools/apt-packages.txt)")
	}
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Fatal("python3 not found")
	}
	repo := repoRoot(t)
	work := t.TempDir()
	log, err := tpmtest.RealEventLogPath("rhel8-uefi.bin")
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}

	// The tool as the build host has it: static, so that it runs on any image.
	tool := filepath.Join(work, "tpm-boot-policy")
	build := exec.Command("go", "build", "-o", tool, "./cmd/tpm-boot-policy")
	build.Dir = repo
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("unable to build tpm-boot-policy: %v\n%s", err, out)
	}

	// The step alone, on this machine as the image (local connection).
	play := filepath.Join(work, "boot-policy.yml")
	writeFile(t, play, `- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: kubelet_authenticator
        tasks_from: boot-policy.yml
`, 0o644)
	inventory := filepath.Join(work, "inventory")
	writeFile(t, inventory, "image ansible_connection=local ansible_python_interpreter="+python+"\n", 0o644)
	scratch := filepath.Join(work, "image-tmp")
	if err := os.Mkdir(scratch, 0o700); err != nil {
		t.Fatal(err)
	}
	dest := filepath.Join(work, "out", "tpm-boot-policy.yaml")
	if err := os.Mkdir(filepath.Dir(dest), 0o755); err != nil {
		t.Fatal(err)
	}
	env := []string{
		"ANSIBLE_ROLES_PATH=" + filepath.Join(repo, "images/ansible/roles"),
		"ANSIBLE_LOCAL_TEMP=" + filepath.Join(work, "ansible-local"),
		"ANSIBLE_REMOTE_TEMP=" + filepath.Join(work, "ansible-remote"),
		"ANSIBLE_HOME=" + filepath.Join(work, "ansible-home"),
		"ANSIBLE_NOCOWS=1",
		"ANSIBLE_RETRY_FILES_ENABLED=0",
		"ANSIBLE_FORCE_COLOR=0",
		"TMPDIR=" + scratch,
	}
	args := []string{"-i", inventory, play,
		"-e", "kubelet_authenticator_boot_policy_tool=" + tool,
		"-e", "kubelet_authenticator_boot_policy_event_log=" + log,
		"-e", "kubelet_authenticator_boot_policy_dest=" + dest,
		"-e", "kubelet_authenticator_boot_policy_pin=4",
	}
	out := run(t, "", env, playbook, args...)
	if !regexp.MustCompile(`image\s+: ok=\d+\s+changed=1\s+unreachable=0\s+failed=0`).MatchString(out) {
		t.Fatalf("unexpected play recap (want one change: the policy file):\n%s", out)
	}
	written, err := os.ReadFile(dest)
	if err != nil {
		t.Fatal(err)
	}

	t.Run("the policy is the tool's for that boot", func(t *testing.T) {
		want, err := exec.Command(tool, "--event-log", log, "--pin", "4").Output()
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(written, want) {
			t.Errorf("the role wrote\n%s\nthe tool prints\n%s", written, want)
		}
	})

	t.Run("the controller reads it from the Cluster as a policy admitting that boot", func(t *testing.T) {
		cluster := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
			capi.AnnotationPolicyPrefix + tpm.Name + capi.AnnotationPolicySuffix: string(written),
		}}}
		policy, _ := capi.ParseClusterPolicy(cluster, nil, nil)
		doc, ok := policy.Documents()[tpm.Name]
		if !ok {
			t.Fatal("the controller finds no tpm policy on the Cluster")
		}
		p, err := tpm.ParsePolicy(doc)
		if err != nil {
			t.Fatalf("the controller refuses the policy: %v\n%s", err, doc)
		}
		golden, st, err := tpm.GoldenPolicy(raw, tpm.GoldenOptions{Pin: []int{4}})
		if err != nil {
			t.Fatal(err)
		}
		if !st.SecureBoot || !p.RequireSecureBoot || !p.RequireBootState {
			t.Errorf("a Secure Boot machine's policy does not require Secure Boot and boot state: %+v", p)
		}
		if fmt.Sprint(p.AllowedKernelDigests) != fmt.Sprint([]string{st.KernelDigest}) ||
			fmt.Sprint(p.AllowedBootLoaderDigests) != fmt.Sprint(golden.AllowedBootLoaderDigests) ||
			len(p.PCRValues) != 1 || p.PCRValues[0].Index != 4 {
			t.Errorf("the policy does not pin the boot the log records (kernel %s):\n%s", st.KernelDigest, written)
		}
	})

	t.Run("the image keeps nothing of the tool, and a second run changes nothing", func(t *testing.T) {
		left, err := os.ReadDir(scratch)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range left {
			t.Errorf("left on the image: %s", filepath.Join(scratch, e.Name()))
		}
		out := run(t, "", env, playbook, args...)
		if !regexp.MustCompile(`image\s+: ok=\d+\s+changed=0\s+unreachable=0\s+failed=0`).MatchString(out) {
			t.Errorf("second run changed something:\n%s", out)
		}
	})

	t.Run("a log that does not parse fails the build", func(t *testing.T) {
		bad := filepath.Join(work, "bad.log")
		writeFile(t, bad, "not an event log", 0o644)
		cmd := exec.Command(playbook, append(args[:len(args):len(args)], "-e", "kubelet_authenticator_boot_policy_event_log="+bad)...)
		cmd.Env = append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		if err == nil {
			t.Fatalf("the play succeeded on a bad event log:\n%s", out)
		}
		if !bytes.Contains(out, []byte("event log")) {
			t.Errorf("the failure does not say what is wrong:\n%s", out)
		}
		if left, _ := os.ReadDir(scratch); len(left) > 0 {
			t.Errorf("the tool stays on the image after a failure: %v", left)
		}
	})
}
