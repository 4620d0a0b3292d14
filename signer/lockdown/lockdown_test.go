package lockdown

import (
	"context"
	"slices"
	"testing"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func binding(name, role string, subjects ...rbacv1.Subject) *rbacv1.ClusterRoleBinding {
	return &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
		Subjects:   subjects,
	}
}

func group(n string) rbacv1.Subject { return rbacv1.Subject{Kind: rbacv1.GroupKind, Name: n} }

func TestEnforce(t *testing.T) {
	client := fake.NewClientset(
		binding(KubeadmAutoApproveBootstrap, NodeClientRole, group("system:bootstrappers:kubeadm:default-node-token")),
		binding(KubeadmAutoApproveRotation, SelfNodeClientRole, group("system:nodes")),
		binding("custom-autoapprove", NodeClientRole, group("system:bootstrappers")),
		binding("node-user-autoapprove", SelfNodeClientRole, rbacv1.Subject{Kind: rbacv1.UserKind, Name: "system:node:worker-0"}),
		binding("kubeadm:kubelet-bootstrap", "system:node-bootstrapper", group("system:bootstrappers:kubeadm:default-node-token")),
		binding("approver-for-ops", NodeClientRole, rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: "approver", Namespace: "ops"}),
	)
	removed, err := Enforce(context.Background(), client)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(removed)
	want := []string{"custom-autoapprove", KubeadmAutoApproveBootstrap, KubeadmAutoApproveRotation, "node-user-autoapprove"}
	slices.Sort(want)
	if !slices.Equal(removed, want) {
		t.Fatalf("removed %v, want %v", removed, want)
	}
	left, err := client.RbacV1().ClusterRoleBindings().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, b := range left.Items {
		names = append(names, b.Name)
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"approver-for-ops", "kubeadm:kubelet-bootstrap"}) {
		t.Fatalf("left %v: the bootstrap binding and unrelated approvers must stay", names)
	}
	if again, err := Enforce(context.Background(), client); err != nil || len(again) != 0 {
		t.Fatalf("second run removed %v, %v", again, err)
	}
}
