package integration

import (
	"context"
	"crypto/tls"
	"encoding/pem"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// recorder is an HTTPS server that stands for a tenant's host: it counts
// the connections made to it and records the Authorization header and
// client certificates of every request.
type recorder struct {
	srv *httptest.Server

	mu          sync.Mutex
	connections int
	auth        []string
	clientCerts int
}

func newRecorder(t *testing.T) *recorder {
	t.Helper()
	r := &recorder{}
	r.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		r.auth = append(r.auth, req.Header.Get("Authorization"))
		if req.TLS != nil {
			r.clientCerts += len(req.TLS.PeerCertificates)
		}
		r.mu.Unlock()
		http.Error(w, "recorded", http.StatusForbidden)
	}))
	r.srv.TLS = &tls.Config{ClientAuth: tls.RequestClientCert}
	r.srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			r.mu.Lock()
			r.connections++
			r.mu.Unlock()
		}
	}
	r.srv.StartTLS()
	t.Cleanup(r.srv.Close)
	return r
}

func (r *recorder) caPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: r.srv.Certificate().Raw})
}

func (r *recorder) seen() (connections int, auth []string, clientCerts int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.connections, append([]string(nil), r.auth...), r.clientCerts
}

// TestWorkloadKubeconfigIsTenantInput is issue 14.1: a tenant writes its
// Cluster's <cluster>-kubeconfig Secret pointing at its own HTTPS host, and
// asks the controller to authenticate with a file (tokenFile = the
// controller's own service-account token, a client certificate and key on
// the controller's disk), a program (exec, auth-provider), a CA file, or no
// TLS verification at all. The controller connects to none of them, says
// in an Event on each Cluster which field it refused, and the controller's
// token and certificate never reach the host. A kubeconfig with inline
// credentials pointing at the same kind of host is used (the control: the
// host would have seen a connection).
func TestWorkloadKubeconfigIsTenantInput(t *testing.T) {
	harness.Binaries(t)
	mgmt := harness.StartManagement(t)
	ctx := context.Background()
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	const controllerToken = "the-controllers-own-service-account-token"
	tokenFile := write("token", []byte(controllerToken))
	certPEM, keyPEM := mgmt.IssueClientCert(t, "system:serviceaccount:kubelet-authenticator-system:node-attestation-controller")
	certFile, keyFile := write("tls.crt", certPEM), write("tls.key", keyPEM)
	ran := filepath.Join(dir, "ran")
	ranProgram := []string{"-c", "touch " + ran + "; echo '{\"apiVersion\":\"client.authentication.k8s.io/v1\",\"kind\":\"ExecCredential\",\"status\":{\"token\":\"" + controllerToken + "\"}}'"}

	const ns = "tenant-kubeconfig"
	type tenantCase struct {
		cluster string
		field   string // refused; "" for the control
		user    func(r *recorder) (clientcmdapi.Cluster, clientcmdapi.AuthInfo)
		rec     *recorder
	}
	inlineCA := func(r *recorder) clientcmdapi.Cluster {
		return clientcmdapi.Cluster{Server: r.srv.URL, CertificateAuthorityData: r.caPEM()}
	}
	cases := []*tenantCase{
		{cluster: "inline", user: func(r *recorder) (clientcmdapi.Cluster, clientcmdapi.AuthInfo) {
			return inlineCA(r), clientcmdapi.AuthInfo{Token: "tenant-token"}
		}},
		{cluster: "token-file", field: "tokenFile", user: func(r *recorder) (clientcmdapi.Cluster, clientcmdapi.AuthInfo) {
			return inlineCA(r), clientcmdapi.AuthInfo{TokenFile: tokenFile}
		}},
		{cluster: "exec", field: "exec", user: func(r *recorder) (clientcmdapi.Cluster, clientcmdapi.AuthInfo) {
			return inlineCA(r), clientcmdapi.AuthInfo{Exec: &clientcmdapi.ExecConfig{
				APIVersion: "client.authentication.k8s.io/v1", Command: "/bin/sh", Args: ranProgram, InteractiveMode: clientcmdapi.NeverExecInteractiveMode,
			}}
		}},
		{cluster: "auth-provider", field: "auth-provider", user: func(r *recorder) (clientcmdapi.Cluster, clientcmdapi.AuthInfo) {
			return inlineCA(r), clientcmdapi.AuthInfo{AuthProvider: &clientcmdapi.AuthProviderConfig{Name: "oidc", Config: map[string]string{
				"id-token": controllerToken, "idp-issuer-url": r.srv.URL, "client-id": "x",
			}}}
		}},
		{cluster: "client-cert-path", field: "client-certificate", user: func(r *recorder) (clientcmdapi.Cluster, clientcmdapi.AuthInfo) {
			return inlineCA(r), clientcmdapi.AuthInfo{ClientCertificate: certFile, ClientKey: keyFile}
		}},
		{cluster: "ca-path", field: "certificate-authority", user: func(r *recorder) (clientcmdapi.Cluster, clientcmdapi.AuthInfo) {
			return clientcmdapi.Cluster{Server: r.srv.URL, CertificateAuthority: write("recorder-ca.crt", r.caPEM())}, clientcmdapi.AuthInfo{Token: "tenant-token"}
		}},
		{cluster: "insecure", field: "insecure-skip-tls-verify", user: func(r *recorder) (clientcmdapi.Cluster, clientcmdapi.AuthInfo) {
			return clientcmdapi.Cluster{Server: r.srv.URL, InsecureSkipTLSVerify: true}, clientcmdapi.AuthInfo{Token: "tenant-token"}
		}},
	}
	if err := mgmt.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		t.Fatal(err)
	}
	ca, err := harness.NewCA("tenant workload CA")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range cases {
		tc.rec = newRecorder(t)
		kc := clientcmdapi.NewConfig()
		c, u := tc.user(tc.rec)
		kc.Clusters[tc.cluster], kc.AuthInfos["admin"] = &c, &u
		kc.Contexts["admin@"+tc.cluster] = &clientcmdapi.Context{Cluster: tc.cluster, AuthInfo: "admin"}
		kc.CurrentContext = "admin@" + tc.cluster
		kubeconfig, err := clientcmd.Write(*kc)
		if err != nil {
			t.Fatal(err)
		}
		cluster := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: tc.cluster, Annotations: map[string]string{
			capi.AnnotationEnabled: "true", capi.AnnotationAuthorizedAttestors: "insecure",
		}}, Spec: clusterv1.ClusterSpec{ControlPlaneEndpoint: clusterv1.APIEndpoint{Host: "127.0.0.1", Port: 6443}}}
		if err := mgmt.Client.Create(ctx, cluster); err != nil {
			t.Fatal(err)
		}
		for name, data := range map[string]map[string][]byte{
			tc.cluster + capi.KubeconfigSecretSuffix: {capi.KubeconfigSecretKey: kubeconfig},
			tc.cluster + capi.CASecretSuffix:         {corev1.TLSCertKey: ca.CertPEM, corev1.TLSPrivateKeyKey: ca.KeyPEM},
		} {
			if err := mgmt.Client.Create(ctx, &corev1.Secret{
				ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{clusterv1.ClusterNameLabel: tc.cluster}},
				Type:       clusterv1.ClusterSecretType,
				Data:       data,
			}); err != nil {
				t.Fatal(err)
			}
		}
	}

	runSigner(t, mgmt, nil)

	// The control: inline credentials are used, so the host hears from the
	// controller (with the tenant's token, the only one it was given).
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		_, auth, _ := cases[0].rec.seen()
		return len(auth) > 0, nil
	})
	if _, auth, _ := cases[0].rec.seen(); auth[0] != "Bearer tenant-token" {
		t.Errorf("the control host saw Authorization %q", auth[0])
	}

	refusal := func(cluster string) string {
		var events corev1.EventList
		if err := mgmt.Client.List(ctx, &events, client.InNamespace(ns)); err != nil {
			t.Fatal(err)
		}
		for _, e := range events.Items {
			if e.InvolvedObject.Kind == "Cluster" && e.InvolvedObject.Name == cluster && e.Reason == capi.ReasonKubeconfigRefused {
				return e.Message
			}
		}
		return ""
	}
	for _, tc := range cases[1:] {
		t.Run(tc.field, func(t *testing.T) {
			var msg string
			harness.WaitFor(t, 30*time.Second, func() (bool, error) {
				msg = refusal(tc.cluster)
				return msg != "", nil
			})
			if !strings.Contains(msg, "."+tc.field+" ") {
				t.Errorf("the Event does not name %s: %s", tc.field, msg)
			}
			// The Cluster's ClusterAttestation says so too.
			harness.WaitFor(t, 30*time.Second, func() (bool, error) {
				att := &unstructured.Unstructured{}
				att.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
				if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: tc.cluster}, att); err != nil {
					return false, client.IgnoreNotFound(err)
				}
				conds, _, _ := unstructured.NestedSlice(att.Object, "status", "conditions")
				for _, c := range conds {
					c, _ := c.(map[string]any)
					if c["type"] == capi.ConditionReady && c["status"] == "False" && c["reason"] == capi.ReasonKubeconfigRefused {
						msg, _ := c["message"].(string)
						return strings.Contains(msg, "."+tc.field+" "), nil
					}
				}
				return false, nil
			})
		})
	}
	// Give a controller that did not refuse time to connect, as the
	// control did, then look at what every tenant host saw.
	time.Sleep(3 * time.Second)
	for _, tc := range cases[1:] {
		conns, auth, certs := tc.rec.seen()
		if conns != 0 || len(auth) != 0 || certs != 0 {
			t.Errorf("%s: the tenant's host saw %d connections, %d requests, %d client certificates", tc.field, conns, len(auth), certs)
		}
		for _, a := range auth {
			if strings.Contains(a, controllerToken) {
				t.Errorf("%s: the controller's token reached the tenant's host", tc.field)
				break
			}
		}
	}
	if _, err := os.Stat(ran); err == nil {
		t.Error("the exec plugin of a tenant's kubeconfig ran")
	}
}
