// Package lockdown removes, from a workload cluster, the RBAC bindings that
// let kube-controller-manager auto-approve kubelet client certificates for
// bootstrap tokens and renewing nodes (kubeadm's
// kubeadm:node-autoapprove-bootstrap and
// kubeadm:node-autoapprove-certificate-rotation, and any other binding of
// the same ClusterRoles to bootstrap or node identities). With them gone, a
// node that cannot attest cannot register through kube-controller-manager;
// attested nodes get their certificates from this project's signer.
//
// Enforce is idempotent; run it periodically to keep the bindings removed.
package lockdown

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// Names of what lockdown removes.
const (
	// KubeadmAutoApproveBootstrap lets bootstrap tokens' CSRs be
	// auto-approved.
	KubeadmAutoApproveBootstrap = "kubeadm:node-autoapprove-bootstrap"
	// KubeadmAutoApproveRotation lets nodes' renewal CSRs be auto-approved.
	KubeadmAutoApproveRotation = "kubeadm:node-autoapprove-certificate-rotation"
	// NodeClientRole and SelfNodeClientRole are the ClusterRoles
	// kube-controller-manager's csrapproving controller checks.
	NodeClientRole     = "system:certificates.k8s.io:certificatesigningrequests:nodeclient"
	SelfNodeClientRole = "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient"
)

// Offending reports whether a ClusterRoleBinding lets bootstrap tokens or
// nodes have their client CSRs auto-approved.
func Offending(b *rbacv1.ClusterRoleBinding) bool {
	if b.Name == KubeadmAutoApproveBootstrap || b.Name == KubeadmAutoApproveRotation {
		return true
	}
	if b.RoleRef.Kind != "ClusterRole" || (b.RoleRef.Name != NodeClientRole && b.RoleRef.Name != SelfNodeClientRole) {
		return false
	}
	return slices.ContainsFunc(b.Subjects, func(s rbacv1.Subject) bool {
		switch s.Kind {
		case rbacv1.GroupKind:
			return s.Name == "system:nodes" || s.Name == "system:bootstrappers" || strings.HasPrefix(s.Name, "system:bootstrappers:") ||
				s.Name == "system:authenticated"
		case rbacv1.UserKind:
			return strings.HasPrefix(s.Name, "system:node:") || strings.HasPrefix(s.Name, "system:bootstrap:")
		}
		return false
	})
}

// Enforce deletes every offending ClusterRoleBinding and returns the names
// it deleted.
func Enforce(ctx context.Context, client kubernetes.Interface) ([]string, error) {
	list, err := client.RbacV1().ClusterRoleBindings().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("unable to list ClusterRoleBindings: %w", err)
	}
	var removed []string
	for i := range list.Items {
		b := &list.Items[i]
		if !Offending(b) {
			continue
		}
		uid := b.UID
		err := client.RbacV1().ClusterRoleBindings().Delete(ctx, b.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return removed, fmt.Errorf("unable to delete ClusterRoleBinding %s: %w", b.Name, err)
		}
		if err == nil {
			removed = append(removed, b.Name)
		}
	}
	return removed, nil
}

// Run calls Enforce every period until ctx is done, and reports each
// result to report (which may be nil).
func Run(ctx context.Context, client kubernetes.Interface, period time.Duration, report func(removed []string, err error)) {
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		removed, err := Enforce(ctx, client)
		if report != nil {
			report(removed, err)
		}
	}, period)
}
