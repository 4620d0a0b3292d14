package harness

import (
	"context"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
)

// What a HostileAPIServer does to the controller.
const (
	// HostileOversize answers the first request after opt-in (a
	// SelfSubjectAccessReview) with a 48 MiB object.
	HostileOversize = "oversize"
	// HostileDrip answers lists of CSRs a byte at a time, forever.
	HostileDrip = "drip"
	// HostileFlood streams, on every watch of CSRs, an endless run of
	// 8 MiB events.
	HostileFlood = "flood"
	// HostileHoard streams, on every watch of CSRs, an endless run of
	// distinct pending CSRs with 512 KiB requests (each within any per-event bound): only a
	// budget of what is cached stops it.
	HostileHoard = "hoard"
)

// HostileAPIServer is a tenant's own HTTPS server posing as its workload
// API server: it speaks just enough of the Kubernetes API to be reached
// (/readyz, SelfSubjectAccessReview, lists and watches of CSRs) and does
// its Mode to whoever connects. It streams what it sends from one small
// buffer, so that what it costs the test process is not counted as the
// controller's.
type HostileAPIServer struct {
	Mode string
	Srv  *httptest.Server

	stopOnce sync.Once
	stop     chan struct{}
	mu       sync.Mutex
	requests map[string]int
}

// StartHostileAPIServer starts a HostileAPIServer on 127.0.0.1 (httptest's
// own self-signed CA) until the test ends.
func StartHostileAPIServer(tb testing.TB, mode string) *HostileAPIServer {
	tb.Helper()
	h := &HostileAPIServer{Mode: mode, stop: make(chan struct{}), requests: map[string]int{}}
	h.Srv = httptest.NewUnstartedServer(h)
	h.Srv.StartTLS()
	tb.Cleanup(func() {
		h.Stop()
		h.Srv.CloseClientConnections()
		h.Srv.Close()
	})
	return h
}

// Stop makes every answer under way end, and every later one empty.
func (h *HostileAPIServer) Stop() { h.stopOnce.Do(func() { close(h.stop) }) }

// Requests returns how many requests of each kind ("ssar", "list",
// "watch", "readyz", "other") the server has answered.
func (h *HostileAPIServer) Requests() map[string]int {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := map[string]int{}
	for k, v := range h.requests {
		out[k] = v
	}
	return out
}

// Kubeconfig is an inline kubeconfig of the server.
func (h *HostileAPIServer) Kubeconfig(tb testing.TB) []byte {
	tb.Helper()
	kc := clientcmdapi.NewConfig()
	kc.Clusters["hostile"] = &clientcmdapi.Cluster{Server: h.Srv.URL,
		CertificateAuthorityData: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: h.Srv.Certificate().Raw})}
	kc.AuthInfos["admin"] = &clientcmdapi.AuthInfo{Token: "tenant-token"}
	kc.Contexts["admin@hostile"] = &clientcmdapi.Context{Cluster: "hostile", AuthInfo: "admin"}
	kc.CurrentContext = "admin@hostile"
	b, err := clientcmd.Write(*kc)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

var pad = strings.Repeat("x", 64<<10)

func (h *HostileAPIServer) count(kind string) {
	h.mu.Lock()
	h.requests[kind]++
	h.mu.Unlock()
}

// write writes s, then n bytes of padding, then suffix, flushing; it
// reports whether the client is still there.
func (h *HostileAPIServer) write(w http.ResponseWriter, prefix string, n int, suffix string) bool {
	if _, err := io.WriteString(w, prefix); err != nil {
		return false
	}
	for n > 0 {
		select {
		case <-h.stop:
			return false
		default:
		}
		c := min(n, len(pad))
		if _, err := io.WriteString(w, pad[:c]); err != nil {
			return false
		}
		n -= c
	}
	if _, err := io.WriteString(w, suffix); err != nil {
		return false
	}
	w.(http.Flusher).Flush()
	return true
}

func (h *HostileAPIServer) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	watch := req.URL.Query().Get("watch") == "true" || req.URL.Query().Get("watch") == "1"
	switch {
	case req.URL.Path == "/readyz" || req.URL.Path == "/livez":
		h.count("readyz")
		_, _ = io.WriteString(w, "ok")
	case strings.HasSuffix(req.URL.Path, "/selfsubjectaccessreviews") && req.Method == http.MethodPost:
		h.count("ssar")
		const head = `{"apiVersion":"authorization.k8s.io/v1","kind":"SelfSubjectAccessReview","status":{"allowed":false,"reason":"`
		n := 0
		if h.Mode == HostileOversize {
			n = 48 << 20
		}
		h.write(w, head, n, `"}}`)
	case strings.HasSuffix(req.URL.Path, "/certificatesigningrequests") && !watch && req.Method == http.MethodGet:
		h.count("list")
		if h.Mode == HostileDrip {
			if !h.write(w, `{"kind":"CertificateSigningRequestList","apiVersion":"certificates.k8s.io/v1","metadata":{"resourceVersion":"1"},"items":[`, 0, "") {
				return
			}
			t := time.NewTicker(200 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-h.stop:
					return
				case <-req.Context().Done():
					return
				case <-t.C:
				}
				if !h.write(w, " ", 0, "") {
					return
				}
			}
		}
		_, _ = io.WriteString(w, `{"kind":"CertificateSigningRequestList","apiVersion":"certificates.k8s.io/v1","metadata":{"resourceVersion":"1"},"items":[]}`)
	case strings.HasSuffix(req.URL.Path, "/certificatesigningrequests") && watch:
		h.count("watch")
		signer := "cluster.x-k8s.io/kube-apiserver-client-kubelet-insecure"
		if fs := req.URL.Query().Get("fieldSelector"); strings.HasPrefix(fs, "spec.signerName=") {
			signer = strings.TrimPrefix(fs, "spec.signerName=")
		}
		size := 0
		switch h.Mode {
		case HostileFlood:
			size = 8 << 20
		case HostileHoard:
			size = 512 << 10
		}
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		for i := 0; size > 0; i++ {
			head := fmt.Sprintf(`{"type":"ADDED","object":{"kind":"CertificateSigningRequest","apiVersion":"certificates.k8s.io/v1","metadata":{"name":"hostile-%d-%d","resourceVersion":"%d","annotations":{"pad":"`, //nolint:lll // a watch event, as the API server frames it
				time.Now().UnixNano(), i, i+2)
			tail := fmt.Sprintf(`"}},"spec":{"signerName":%q,"usages":["client auth"],"username":"system:bootstrap:abcdef"}}}`+"\n", signer)
			if h.Mode == HostileHoard {
				// The padding is the request itself: the part the signer
				// reads (up to attestor.MaxRequestSize) is what the cache
				// keeps of a pending request, where an annotation it does
				// not read would be dropped before caching.
				head = fmt.Sprintf(`{"type":"ADDED","object":{"kind":"CertificateSigningRequest","apiVersion":"certificates.k8s.io/v1","metadata":{"name":"hostile-%d-%d","resourceVersion":"%d"},"spec":{"signerName":%q,"usages":["client auth"],"username":"system:bootstrap:abcdef","request":"`, //nolint:lll // a watch event, as the API server frames it
					time.Now().UnixNano(), i, i+2, signer)
				tail = `"}}` + "\n"
			}
			if !h.write(w, head, size, tail) {
				return
			}
		}
		select {
		case <-h.stop:
		case <-req.Context().Done():
		}
	default:
		h.count("other")
		w.WriteHeader(http.StatusNotFound)
		_, _ = io.WriteString(w, `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"not found","reason":"NotFound","code":404}`)
	}
}

// AddHostileCluster creates, in namespace ns (creating it), an opted-in
// Cluster name (authorizing insecure) whose <name>-kubeconfig points at h,
// and its <name>-ca Secret (a CA of its own).
func (m *Management) AddHostileCluster(tb testing.TB, ns, name string, h *HostileAPIServer) {
	tb.Helper()
	ctx := context.Background()
	if err := ensureNamespace(ctx, m.ControlPlane.Client, ns); err != nil {
		tb.Fatal(err)
	}
	ca, err := NewCA(name + " CA")
	if err != nil {
		tb.Fatal(err)
	}
	cluster := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Annotations: map[string]string{
		"kubelet-authenticator.x-k8s.io/enabled": "true", "kubelet-authenticator.x-k8s.io/authorized-attestors": "insecure",
	}}, Spec: clusterv1.ClusterSpec{ControlPlaneEndpoint: clusterv1.APIEndpoint{Host: "127.0.0.1", Port: 6443}}}
	if err := m.Client.Create(ctx, cluster); err != nil {
		tb.Fatal(err)
	}
	for secret, data := range map[string]map[string][]byte{
		name + "-kubeconfig": {"value": h.Kubeconfig(tb)},
		name + "-ca":         {corev1.TLSCertKey: ca.CertPEM, corev1.TLSPrivateKeyKey: ca.KeyPEM},
	} {
		if err := m.Client.Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: secret, Labels: map[string]string{clusterv1.ClusterNameLabel: name}},
			Type:       clusterv1.ClusterSecretType,
			Data:       data,
		}); err != nil {
			tb.Fatal(err)
		}
	}
}
