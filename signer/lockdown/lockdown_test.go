package lockdown

import (
	"context"
	"slices"
	"strings"
	"testing"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

func binding(name, role string, subjects ...rbacv1.Subject) *rbacv1.ClusterRoleBinding {
	return &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
		Subjects:   subjects,
	}
}

func group(n string) rbacv1.Subject { return rbacv1.Subject{Kind: rbacv1.GroupKind, Name: n} }

func subjectsOf(t *testing.T, c *fake.Clientset) map[string][]rbacv1.Subject {
	t.Helper()
	list, err := c.RbacV1().ClusterRoleBindings().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]rbacv1.Subject{}
	for _, b := range list.Items {
		out[b.Name] = b.Subjects
	}
	return out
}

func TestEnforceAndRestore(t *testing.T) {
	ctx := context.Background()
	bootstrappers := group("system:bootstrappers:kubeadm:default-node-token")
	client := fake.NewClientset(
		binding(KubeadmAutoApproveBootstrap, NodeClientRole, bootstrappers),
		binding(KubeadmAutoApproveRotation, SelfNodeClientRole, group(attestor.NodesGroup)),
		binding("custom-autoapprove", NodeClientRole, group(attestor.BootstrappersGroup)),
		binding("anyone-autoapprove", NodeClientRole, group("system:authenticated")),
		binding("node-user-renewal", SelfNodeClientRole, rbacv1.Subject{Kind: rbacv1.UserKind, Name: "system:node:worker-0"}),
		binding("kubeadm:kubelet-bootstrap", "system:node-bootstrapper", bootstrappers),
		binding("approver-for-ops", NodeClientRole, rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: "approver", Namespace: "ops"}),
	)
	before := subjectsOf(t, client)
	disarmed, err := Enforce(ctx, client)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(disarmed)
	want := []string{"anyone-autoapprove", "custom-autoapprove", KubeadmAutoApproveBootstrap}
	if !slices.Equal(disarmed, want) {
		t.Fatalf("disarmed %v, want %v", disarmed, want)
	}
	after := subjectsOf(t, client)
	for name, subjects := range before {
		if slices.Contains(want, name) {
			if len(after[name]) != 0 {
				t.Errorf("%s still has subjects %v", name, after[name])
			}
			continue
		}
		// Renewal (selfnodeclient), the right to file a CSR at all, and
		// unrelated approvers stay.
		if !slices.Equal(after[name], subjects) {
			t.Errorf("%s: subjects %v, want them kept: %v", name, after[name], subjects)
		}
	}
	if again, err := Enforce(ctx, client); err != nil || len(again) != 0 {
		t.Fatalf("second run disarmed %v, %v", again, err)
	}

	restored, err := Restore(ctx, client)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(restored)
	if !slices.Equal(restored, want) {
		t.Errorf("restored %v, want %v", restored, want)
	}
	final := subjectsOf(t, client)
	for name, subjects := range before {
		if !slices.Equal(final[name], subjects) {
			t.Errorf("%s after restore: %v, want %v", name, final[name], subjects)
		}
	}
	b, err := client.RbacV1().ClusterRoleBindings().Get(ctx, KubeadmAutoApproveBootstrap, metav1.GetOptions{})
	if err != nil || b.Annotations[AnnotationSubjects] != "" {
		t.Errorf("annotation left after restore: %v %v", b.Annotations, err)
	}
}

// TestRestoreOnlyWhatEnforceDisarms: a subjects annotation planted on a
// binding to another role is not acted on, and one binding whose annotation
// does not parse does not stop the others from being restored.
func TestRestoreOnlyWhatEnforceDisarms(t *testing.T) {
	ctx := context.Background()
	planted := binding("planted", "cluster-admin")
	planted.Annotations = map[string]string{AnnotationSubjects: `[{"kind":"Group","name":attestor.BootstrappersGroup}]`}
	broken := binding("a-broken", NodeClientRole)
	broken.Annotations = map[string]string{AnnotationSubjects: `not json`}
	client := fake.NewClientset(planted, broken, binding(KubeadmAutoApproveBootstrap, NodeClientRole, group("system:bootstrappers:kubeadm:default-node-token")))
	if _, err := Enforce(ctx, client); err != nil {
		t.Fatal(err)
	}
	restored, err := Restore(ctx, client)
	if err == nil || !strings.Contains(err.Error(), "a-broken") {
		t.Errorf("Restore error = %v, want one naming the broken binding", err)
	}
	if !slices.Equal(restored, []string{KubeadmAutoApproveBootstrap}) {
		t.Errorf("restored %v, want only %s", restored, KubeadmAutoApproveBootstrap)
	}
	if s := subjectsOf(t, client)["planted"]; len(s) != 0 {
		t.Errorf("a planted annotation gave cluster-admin subjects %v", s)
	}
}
