// Package lockdown closes, in a workload cluster, kube-controller-manager's
// auto-approval of kubelet TLS bootstrap: the ClusterRoleBindings that let
// bootstrap tokens (or anyone authenticated) have their client CSRs
// approved without attestation (kubeadm's kubeadm:node-autoapprove-bootstrap,
// and any other binding of the nodeclient ClusterRole to bootstrap or
// authenticated identities). With them disarmed, a node that cannot attest
// cannot register; attested nodes get their certificates from this
// project's signer.
//
// Renewal stays open: bindings of the selfnodeclient ClusterRole (kubeadm's
// kubeadm:node-autoapprove-certificate-rotation) are left alone. Through
// them kube-controller-manager approves a CSR only when its requester is
// the very node the certificate names, authenticated by that node's current
// certificate: it renews an existing node and never registers a new one.
// Nodes that do not run the agent (control-plane nodes kubeadm joined, say)
// keep renewing that way.
//
// Lockdown is reversible. A binding is not deleted: its subjects are
// emptied and kept, as JSON, in the annotation AnnotationSubjects on the
// binding itself; Restore puts them back. Enforce and Restore are
// idempotent; run Enforce periodically to keep the bindings disarmed
// (kubeadm upgrade writes them anew).
package lockdown

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	rbacv1client "k8s.io/client-go/kubernetes/typed/rbac/v1"

	"sigs.k8s.io/kubelet-authenticator/signer/periodic"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Names of what lockdown disarms and keeps.
const (
	// KubeadmAutoApproveBootstrap lets bootstrap tokens' CSRs be
	// auto-approved: disarmed.
	KubeadmAutoApproveBootstrap = "kubeadm:node-autoapprove-bootstrap"
	// KubeadmAutoApproveRotation lets nodes' renewal CSRs be auto-approved:
	// kept.
	KubeadmAutoApproveRotation = "kubeadm:node-autoapprove-certificate-rotation"
	// NodeClientRole and SelfNodeClientRole are the ClusterRoles
	// kube-controller-manager's csrapproving controller checks: the first
	// for a new node's CSR, the second for a node's renewal of its own.
	NodeClientRole     = "system:certificates.k8s.io:certificatesigningrequests:nodeclient"
	SelfNodeClientRole = "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient"
	// AnnotationSubjects, on a disarmed binding, holds its subjects (JSON)
	// for Restore.
	AnnotationSubjects = "kubelet-authenticator.x-k8s.io/lockdown-subjects"
)

// Offending reports whether a ClusterRoleBinding lets bootstrap tokens (or
// anyone who can authenticate) have kubelet client CSRs auto-approved.
func Offending(b *rbacv1.ClusterRoleBinding) bool {
	if len(b.Subjects) == 0 || b.RoleRef.Kind != "ClusterRole" {
		return false
	}
	if b.Name == KubeadmAutoApproveBootstrap && b.RoleRef.Name == NodeClientRole {
		return true
	}
	if b.RoleRef.Name != NodeClientRole {
		return false // selfnodeclient renews a node's own certificate only
	}
	return slices.ContainsFunc(b.Subjects, func(s rbacv1.Subject) bool {
		switch s.Kind {
		case rbacv1.GroupKind:
			return s.Name == attestor.NodesGroup || s.Name == attestor.BootstrappersGroup || strings.HasPrefix(s.Name, "system:bootstrappers:") ||
				s.Name == "system:authenticated" || s.Name == "system:unauthenticated"
		case rbacv1.UserKind:
			return strings.HasPrefix(s.Name, attestor.NodeUserPrefix) || strings.HasPrefix(s.Name, attestor.BootstrapUserPrefix)
		}
		return false
	})
}

// Client is what lockdown uses of a cluster's API: its ClusterRoleBindings.
type Client interface {
	RbacV1() rbacv1client.RbacV1Interface
}

// Enforce disarms every offending ClusterRoleBinding (its subjects moved
// into AnnotationSubjects) and returns the names it disarmed.
func Enforce(ctx context.Context, client Client) ([]string, error) {
	list, err := client.RbacV1().ClusterRoleBindings().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("unable to list ClusterRoleBindings: %w", err)
	}
	var disarmed []string
	for i := range list.Items {
		b := list.Items[i].DeepCopy()
		if !Offending(b) {
			continue
		}
		kept, err := json.Marshal(b.Subjects)
		if err != nil {
			return disarmed, err
		}
		if b.Annotations == nil {
			b.Annotations = map[string]string{}
		}
		b.Annotations[AnnotationSubjects] = string(kept)
		b.Subjects = nil
		// Conditional on the resourceVersion listed: a concurrent change is
		// looked at again next time.
		_, err = client.RbacV1().ClusterRoleBindings().Update(ctx, b, metav1.UpdateOptions{})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return disarmed, fmt.Errorf("unable to disarm ClusterRoleBinding %s: %w", b.Name, err)
		}
		if err == nil {
			disarmed = append(disarmed, b.Name)
		}
	}
	return disarmed, nil
}

// Restore gives every binding Enforce disarmed its subjects back and
// returns the names it restored.
func Restore(ctx context.Context, client Client) ([]string, error) {
	list, err := client.RbacV1().ClusterRoleBindings().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("unable to list ClusterRoleBindings: %w", err)
	}
	var restored []string
	var errs []error
	for i := range list.Items {
		b := list.Items[i].DeepCopy()
		kept, ok := b.Annotations[AnnotationSubjects]
		// Only what Enforce disarms is restored: the annotation is
		// writable by anyone who may edit bindings in the workload
		// cluster, and names no role of its own.
		if !ok || b.RoleRef.Kind != "ClusterRole" || b.RoleRef.Name != NodeClientRole {
			continue
		}
		var subjects []rbacv1.Subject
		if err := json.Unmarshal([]byte(kept), &subjects); err != nil {
			errs = append(errs, fmt.Errorf("ClusterRoleBinding %s: annotation %s: %w", b.Name, AnnotationSubjects, err))
			continue
		}
		if len(b.Subjects) == 0 { // not rewritten since (by kubeadm, say)
			b.Subjects = subjects
		}
		delete(b.Annotations, AnnotationSubjects)
		if _, err := client.RbacV1().ClusterRoleBindings().Update(ctx, b, metav1.UpdateOptions{}); err != nil {
			errs = append(errs, fmt.Errorf("unable to restore ClusterRoleBinding %s: %w", b.Name, err))
			continue
		}
		restored = append(restored, b.Name)
	}
	return restored, errors.Join(errs...)
}

// Run calls Enforce every period until ctx is done, and reports each
// result to report (which may be nil). It returns at once, with a channel
// closed once the last call returned; between calls nothing runs
// (package periodic).
func Run(ctx context.Context, client Client, period time.Duration, report func(disarmed []string, err error)) <-chan struct{} {
	return periodic.Every(ctx, period, func(ctx context.Context) bool {
		disarmed, err := Enforce(ctx, client)
		if report != nil {
			report(disarmed, err)
		}
		return true
	})
}
