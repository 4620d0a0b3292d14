package harness

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509/pkix"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	certutil "k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/certificate/csr"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/lockdown"
)

// KubeadmAutoApprove creates kubeadm's CSR auto-approve bindings in the
// cluster, as kubeadm init does: bootstrap tokens' kubelet client CSRs and
// nodes' renewals are approved by kube-controller-manager.
func (cp *ControlPlane) KubeadmAutoApprove(tb testing.TB) {
	tb.Helper()
	for _, b := range []*rbacv1.ClusterRoleBinding{
		{
			ObjectMeta: metav1.ObjectMeta{Name: lockdown.KubeadmAutoApproveBootstrap},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: lockdown.NodeClientRole},
			Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: "system:bootstrappers:kubeadm:default-node-token"}},
		},
		{
			ObjectMeta: metav1.ObjectMeta{Name: lockdown.KubeadmAutoApproveRotation},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: lockdown.SelfNodeClientRole},
			Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: attestor.NodesGroup}},
		},
	} {
		if _, err := cp.Client.RbacV1().ClusterRoleBindings().Create(context.Background(), b, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			tb.Fatal(err)
		}
	}
}

// PlainBootstrap files a kubelet client CSR the way kubelet's TLS bootstrap
// does (kubernetes.io/kube-apiserver-client-kubelet, no evidence) for node
// and waits up to wait for its certificate; it returns the CSR's name and
// whether a certificate was issued.
func PlainBootstrap(tb testing.TB, c kubernetes.Interface, node string, wait time.Duration) (string, bool) {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	der, err := certutil.MakeCSR(key, &pkix.Name{CommonName: attestor.NodeUserPrefix + node, Organization: []string{attestor.NodesGroup}}, nil, nil)
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	name, uid, err := csr.RequestCertificateWithContext(ctx, c, der, "", certificatesv1.KubeAPIServerClientKubeletSignerName, nil,
		[]certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}, key)
	if err != nil {
		tb.Fatal(err)
	}
	_, err = csr.WaitForCertificate(ctx, c, name, uid)
	return name, err == nil
}
