package e2e

import (
	"context"
	"crypto"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert/podattest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// TestPodCertificateVolume: kubelet's own pod certificate path. kubemark's
// hollow kubelet (a real kubelet: its pod certificate manager and the
// projected volume plugin, with a fake container runtime), authenticated
// with the client certificate the controller issued after attestation and
// with the PodCertificateRequest gate on, runs a pod whose projected volume
// asks the controller's pod signer for its certificate and projects the
// pod CA bundle: the pod reaches Running once the controller issued the
// certificate, and the key, the certificate and the bundle are on disk
// in the pod's volume as the request's status says. Then kubelet refreshes
// it: once the beginRefreshAt the signer set has passed, kubelet asks again
// with a new key, the signer decides that request through every check
// again, and the new certificate replaces the old one in the pod's volume
// before the old one expires.
//
// kube-apiserver accepts no beginRefreshAt earlier than ten minutes after
// notBefore, nor a notBefore more than five minutes before its time, and
// kubelet adds up to five minutes of jitter and refreshes on a pass every
// one to two minutes: the controller runs with the test-only timing
// (podcert.Timing, test builds only) that puts notBefore 4m30s back and
// beginRefreshAt ten minutes after it, and the refresh comes 5 to 13
// minutes after the first certificate was issued.
func TestPodCertificateVolume(t *testing.T) {
	hollow := hollowKubeletTLS(t)
	timing := podcert.Timing{Backdate: 4*time.Minute + 30*time.Second, RefreshAfter: podcert.RefreshMargin}
	env := scenario.Start(t, scenario.Options{ControllerArgs: []string{
		"--test-pod-certificate-backdate=" + timing.Backdate.String(), "--test-pod-certificate-refresh-after=" + timing.RefreshAfter.String()}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	env.Workload.RestartAPIServer(t, "--feature-gates=PodCertificateRequest=true",
		"--runtime-config=certificates.k8s.io/v1beta1/podcertificaterequests=true")

	const ns, sa = "payments", "api"
	att := &unstructured.Unstructured{}
	att.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
	att.SetNamespace(env.Namespace)
	att.SetName(env.Cluster)
	harness.WaitFor(t, time.Minute, func() (bool, error) {
		return env.Mgmt.Client.Patch(ctx, att, client.RawPatch(types.MergePatchType, []byte(
			`{"spec":{"authorizedAttestors":["insecure"],"podCertificates":{"trustDomain":"wl.example","allowed":[{"namespace":"`+ns+`","serviceAccounts":["`+sa+`"]}]}}}`))) == nil, nil
	})
	wl := env.Workload.Client
	if _, err := wl.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := wl.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	n := env.NewNode(t, "pods-1", "test:///fleet/pods-1", "insecure")
	env.Machine(t, n)
	rootDir := filepath.Join(n.Dir, "kubelet-root")
	harness.StartProcess(t, "hollow-kubelet", filepath.Join(n.Dir, "kubelet.log"), hollow,
		"--kubeconfig="+n.Kubeconfig, "--name="+n.Name, "--kubelet-port="+strconv.Itoa(harness.FreePort(t)),
		"--feature-gates=PodCertificateRequest=true,ClusterTrustBundle=true,ClusterTrustBundleProjection=true", "--root-dir="+rootDir, "--v=2")
	harness.WaitFor(t, 3*time.Minute, func() (bool, error) {
		node, err := wl.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
				return true, nil
			}
		}
		return false, nil
	})

	// The pod CA is published and the admission policy that stamps the
	// requests' creator is in force.
	var bundlePEM string
	harness.WaitFor(t, 2*time.Minute, func() (bool, error) {
		list, err := wl.CertificatesV1beta1().ClusterTrustBundles().List(ctx, metav1.ListOptions{LabelSelector: capi.LabelPodCA + "=true"})
		if err != nil || len(list.Items) == 0 {
			return false, nil
		}
		bundlePEM = list.Items[0].Spec.TrustBundle
		return true, nil
	})
	var since time.Time
	harness.WaitFor(t, time.Minute, func() (bool, error) {
		b, err := wl.AdmissionregistrationV1().MutatingAdmissionPolicyBindings().Get(ctx, podcert.AdmissionPolicyName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		since = b.CreationTimestamp.Add(podcert.AdmissionSettle + time.Second)
		return true, nil
	})
	time.Sleep(time.Until(since))

	start := time.Now()
	pod, err := wl.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "api-0"},
		Spec: corev1.PodSpec{
			ServiceAccountName: sa, NodeName: n.Name, AutomountServiceAccountToken: ptr.To(false),
			Containers: []corev1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10",
				VolumeMounts: []corev1.VolumeMount{{Name: "identity", MountPath: "/var/run/identity"}}}},
			Volumes: []corev1.Volume{{Name: "identity", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
				Sources: []corev1.VolumeProjection{
					{PodCertificate: &corev1.PodCertificateProjection{SignerName: podcert.DefaultSignerName, KeyType: "ED25519",
						CredentialBundlePath: "credentialbundle.pem"}},
					{ClusterTrustBundle: &corev1.ClusterTrustBundleProjection{SignerName: ptr.To(podcert.DefaultSignerName),
						LabelSelector: &metav1.LabelSelector{}, Path: "ca.pem"}},
				},
			}}}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 3*time.Minute, func() (bool, error) {
		p, err := wl.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = p
		return p.Status.Phase == corev1.PodRunning, nil
	})
	t.Logf("pod %s/%s Running %s after it was created", ns, pod.Name, time.Since(start).Round(time.Millisecond))

	// kubelet asked the controller's signer, which issued.
	pcrs := podRequests(ctx, t, wl, pod)
	if len(pcrs) != 1 {
		t.Fatalf("%d PodCertificateRequests for pod %s, want 1", len(pcrs), pod.UID)
	}
	pcr := &pcrs[0]
	cert := issuedBy(t, pcr, n, env.Namespace)
	// The test timing, as kube-apiserver accepted it.
	if nb := pcr.Status.NotBefore.Time; !pcr.Status.BeginRefreshAt.Time.Equal(nb.Add(timing.RefreshAfter)) || nb.After(time.Now().Add(-timing.Backdate)) {
		t.Fatalf("request %s: notBefore %s, beginRefreshAt %s; want %s back and beginRefreshAt %s after it", pcr.Name,
			nb, pcr.Status.BeginRefreshAt, timing.Backdate, timing.RefreshAfter)
	}
	t.Logf("request %s issued %s for node %s, refresh at %s", pcr.Name, cert.URIs[0], n.Name, pcr.Status.BeginRefreshAt.Format(time.RFC3339))

	// On disk, in the pod's volume: the private key of the certificate
	// and the certificate as issued, and the pod CA bundle that verifies
	// it.
	vol := filepath.Join(rootDir, "pods", string(pod.UID), "volumes", "kubernetes.io~projected", "identity")
	key, onDisk, err := readCredentialBundle(filepath.Join(vol, "credentialbundle.pem"))
	if err != nil {
		t.Fatal(err)
	}
	if key == nil || onDisk == nil || !onDisk.Equal(cert) {
		t.Fatalf("%s: key %t, certificate the issued one %t", filepath.Join(vol, "credentialbundle.pem"), key != nil, onDisk != nil && onDisk.Equal(cert))
	}
	if pub, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool }); !ok || !pub.Equal(cert.PublicKey) {
		t.Fatal("the key on disk is not the certificate's")
	}
	caPEM, err := os.ReadFile(filepath.Join(vol, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) || string(caPEM) != bundlePEM {
		t.Fatalf("projected bundle %q, want the published pod CA", caPEM)
	}
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		t.Fatalf("the pod's certificate does not verify with its projected bundle: %v", err)
	}

	// The refresh: a new key and a new certificate in the pod's volume,
	// long before the first one's notAfter.
	issued := pcr.Status.NotBefore.Add(timing.Backdate)
	var newKey crypto.Signer
	var refreshed *x509.Certificate
	harness.WaitFor(t, 16*time.Minute, func() (bool, error) {
		var err error
		newKey, refreshed, err = readCredentialBundle(filepath.Join(vol, "credentialbundle.pem"))
		return err == nil && newKey != nil && refreshed != nil && !refreshed.Equal(cert), err
	})
	onDiskAt := time.Now()
	if !onDiskAt.Before(cert.NotAfter) {
		t.Fatalf("refreshed at %s, after the first certificate's notAfter %s", onDiskAt, cert.NotAfter)
	}
	if refreshed.SerialNumber.Cmp(cert.SerialNumber) == 0 || !refreshed.NotBefore.After(cert.NotBefore) {
		t.Errorf("refreshed certificate serial %s notBefore %s; first serial %s notBefore %s", refreshed.SerialNumber, refreshed.NotBefore,
			cert.SerialNumber, cert.NotBefore)
	}
	if pub, ok := newKey.Public().(interface{ Equal(crypto.PublicKey) bool }); !ok || !pub.Equal(refreshed.PublicKey) || pub.Equal(cert.PublicKey) {
		t.Error("the key on disk after the refresh is not the refreshed certificate's, or is the first one's")
	}
	if _, err := refreshed.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		t.Errorf("the refreshed certificate does not verify with the projected bundle: %v", err)
	}
	// kubelet filed a second request once beginRefreshAt had passed, and
	// the controller's signer issued it after its checks, with the
	// attestation extension.
	pcrs = podRequests(ctx, t, wl, pod)
	if len(pcrs) != 2 {
		t.Fatalf("%d PodCertificateRequests for pod %s after the refresh, want 2", len(pcrs), pod.UID)
	}
	second := &pcrs[0]
	if second.Name == pcr.Name {
		second = &pcrs[1]
	}
	if second.CreationTimestamp.Before(&metav1.Time{Time: pcr.Status.BeginRefreshAt.Truncate(time.Second)}) {
		t.Errorf("refresh request %s created %s, before the first certificate's beginRefreshAt %s", second.Name, second.CreationTimestamp,
			pcr.Status.BeginRefreshAt)
	}
	if c := issuedBy(t, second, n, env.Namespace); !c.Equal(refreshed) {
		t.Errorf("the certificate on disk is not the one request %s issued", second.Name)
	}
	t.Logf("refresh request %s created %s after the first certificate was issued (%s after its beginRefreshAt); new certificate on disk %s after it, %s before the first one's notAfter",
		second.Name, second.CreationTimestamp.Sub(issued).Round(time.Second), second.CreationTimestamp.Sub(pcr.Status.BeginRefreshAt.Time).Round(time.Second),
		onDiskAt.Sub(issued).Round(time.Second), cert.NotAfter.Sub(onDiskAt).Round(time.Minute))
}

// podRequests returns the PodCertificateRequests of pod.
func podRequests(ctx context.Context, t *testing.T, wl kubernetes.Interface, pod *corev1.Pod) []certificatesv1beta1.PodCertificateRequest {
	t.Helper()
	list, err := wl.CertificatesV1beta1().PodCertificateRequests(pod.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []certificatesv1beta1.PodCertificateRequest
	for _, r := range list.Items {
		if r.Spec.PodUID == pod.UID {
			out = append(out, r)
		}
	}
	return out
}

// issuedBy returns the certificate pcr was issued, after checking that the
// controller's pod signer issued it for node n, with the attestation
// extension of n's Machine in namespace ns, to the creator the admission
// policy stamped.
func issuedBy(t *testing.T, pcr *certificatesv1beta1.PodCertificateRequest, n *scenario.Node, ns string) *x509.Certificate {
	t.Helper()
	if pcr.Spec.SignerName != podcert.DefaultSignerName || string(pcr.Spec.NodeName) != n.Name ||
		len(pcr.Status.Conditions) != 1 || pcr.Status.Conditions[0].Type != certificatesv1beta1.PodCertificateRequestConditionTypeIssued ||
		pcr.Status.Conditions[0].Reason != podcert.ReasonIssued {
		t.Fatalf("request %s: signer %s node %s conditions %+v; want Issued by %s for node %s", pcr.Name, pcr.Spec.SignerName, pcr.Spec.NodeName,
			pcr.Status.Conditions, podcert.DefaultSignerName, n.Name)
	}
	if !strings.HasPrefix(pcr.Annotations[podcert.AnnotationCreatorCredential], podcert.CredentialIDPrefix) {
		t.Errorf("request %s: creator %q, want the node's client certificate", pcr.Name, pcr.Annotations[podcert.AnnotationCreatorCredential])
	}
	blk, _ := pem.Decode([]byte(pcr.Status.CertificateChain))
	if blk == nil {
		t.Fatalf("no certificate in the status of request %s", pcr.Name)
	}
	cert, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	a, err := podattest.FromCertificate(cert)
	if err != nil {
		t.Fatal(err)
	}
	if a.NodeName != n.Name || a.MachineName != "machine-"+n.Name || a.MachineNamespace != ns || a.Attestor != "insecure" || a.ProviderID != n.ProviderID {
		t.Errorf("request %s: attestation extension %+v; want node %s, Machine %s/machine-%s, attestor insecure", pcr.Name, a, n.Name, ns, n.Name)
	}
	return cert
}

// readCredentialBundle reads the private key and the first certificate of
// a pod's credential bundle; nil for what is not there.
func readCredentialBundle(path string) (crypto.Signer, *x509.Certificate, error) {
	bundle, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	var key crypto.Signer
	var cert *x509.Certificate
	for rest := bundle; ; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			break
		}
		switch b.Type {
		case "PRIVATE KEY":
			k, err := x509.ParsePKCS8PrivateKey(b.Bytes)
			if err != nil {
				return nil, nil, fmt.Errorf("%s: %w", path, err)
			}
			key, _ = k.(crypto.Signer)
		case "CERTIFICATE":
			if cert == nil {
				if cert, err = x509.ParseCertificate(b.Bytes); err != nil {
					return nil, nil, fmt.Errorf("%s: %w", path, err)
				}
			}
		}
	}
	return key, cert, nil
}
