package e2e

import (
	"context"
	"crypto"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
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
// in the pod's volume as the request's status says.
func TestPodCertificateVolume(t *testing.T) {
	hollow := hollowKubeletTLS(t)
	env := scenario.Start(t, scenario.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
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
	list, err := wl.CertificatesV1beta1().PodCertificateRequests(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var pcr *certificatesv1beta1.PodCertificateRequest
	for i := range list.Items {
		if list.Items[i].Spec.PodUID == pod.UID {
			pcr = &list.Items[i]
		}
	}
	if pcr == nil {
		t.Fatalf("no PodCertificateRequest for pod %s among %d", pod.UID, len(list.Items))
	}
	if pcr.Spec.SignerName != podcert.DefaultSignerName || string(pcr.Spec.NodeName) != n.Name ||
		len(pcr.Status.Conditions) != 1 || pcr.Status.Conditions[0].Type != certificatesv1beta1.PodCertificateRequestConditionTypeIssued ||
		pcr.Status.Conditions[0].Reason != podcert.ReasonIssued {
		t.Fatalf("request %s: signer %s node %s conditions %+v; want Issued by %s for node %s", pcr.Name, pcr.Spec.SignerName, pcr.Spec.NodeName,
			pcr.Status.Conditions, podcert.DefaultSignerName, n.Name)
	}
	blk, _ := pem.Decode([]byte(pcr.Status.CertificateChain))
	if blk == nil {
		t.Fatal("no certificate in the request's status")
	}
	cert, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	a, err := podattest.FromCertificate(cert)
	if err != nil {
		t.Fatal(err)
	}
	if a.NodeName != n.Name || a.MachineName != "machine-"+n.Name || a.MachineNamespace != env.Namespace || a.Attestor != "insecure" || a.ProviderID != n.ProviderID {
		t.Errorf("attestation extension %+v; want node %s, Machine %s/machine-%s, attestor insecure", a, n.Name, env.Namespace, n.Name)
	}
	t.Logf("request %s issued %s for node %s, refresh at %s", pcr.Name, cert.URIs[0], a.NodeName, pcr.Status.BeginRefreshAt.Format(time.RFC3339))

	// On disk, in the pod's volume: the private key of the certificate
	// and the certificate as issued, and the pod CA bundle that verifies
	// it.
	vol := filepath.Join(rootDir, "pods", string(pod.UID), "volumes", "kubernetes.io~projected", "identity")
	bundle, err := os.ReadFile(filepath.Join(vol, "credentialbundle.pem"))
	if err != nil {
		t.Fatal(err)
	}
	var key crypto.Signer
	var onDisk *x509.Certificate
	for rest := bundle; ; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			break
		}
		switch b.Type {
		case "PRIVATE KEY":
			k, err := x509.ParsePKCS8PrivateKey(b.Bytes)
			if err != nil {
				t.Fatal(err)
			}
			key = k.(crypto.Signer)
		case "CERTIFICATE":
			if onDisk == nil {
				if onDisk, err = x509.ParseCertificate(b.Bytes); err != nil {
					t.Fatal(err)
				}
			}
		}
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
}
