package csr

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// decided is the wait condition of the node: the signer has answered.
func decided(o *certificatesv1.CertificateSigningRequest) (bool, error) {
	cert, err := Outcome(o)
	return err != nil || cert != nil, err
}

// TestWaitAhead: a watch opened before the CSR is filed sees the signer's
// answer whether it comes after the watch opened or before (the API server
// sends the CSR as it is when the watch starts), and a watch on another name
// (a request filed under a name not known in advance) falls back to
// watching the filed CSR.
func TestWaitAhead(t *testing.T) {
	cp := harness.StartControlPlane(t, "csr-ahead")
	c, err := NewClient(cp.AdminConfig)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	object := func(name string) *certificatesv1.CertificateSigningRequest {
		t.Helper()
		key, err := GenerateKey()
		if err != nil {
			t.Fatal(err)
		}
		der, err := PKCS10(key, "n1", "test:///n1")
		if err != nil {
			t.Fatal(err)
		}
		request, err := attestor.EncodeRequest(der, "test", []byte(`{"version":"v1"}`))
		if err != nil {
			t.Fatal(err)
		}
		return Object(name, "cluster.x-k8s.io/kube-apiserver-client-kubelet-test", request, nil, nil)
	}
	file := func(name string) *certificatesv1.CertificateSigningRequest {
		t.Helper()
		obj, err := c.Create(ctx, object(name))
		if err != nil {
			t.Fatal(err)
		}
		return obj
	}
	deny := func(obj *certificatesv1.CertificateSigningRequest, reason string) error {
		obj = obj.DeepCopy()
		obj.Status.Conditions = append(obj.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
			Type: certificatesv1.CertificateDenied, Status: corev1.ConditionTrue, Reason: reason, Message: "test",
		})
		_, err := cp.Client.CertificatesV1().CertificateSigningRequests().UpdateApproval(ctx, obj.Name, obj, metav1.UpdateOptions{})
		return err
	}
	// denyLater denies obj while the test waits; the test then waits for it.
	denyLater := func(t *testing.T, obj *certificatesv1.CertificateSigningRequest, reason string) {
		errc := make(chan error, 1)
		go func() { errc <- deny(obj, reason) }()
		t.Cleanup(func() {
			if err := <-errc; err != nil {
				t.Error(err)
			}
		})
	}
	wantDenied := func(err error, reason string) {
		t.Helper()
		var denied *DeniedError
		if !errors.As(err, &denied) || denied.Reason != reason {
			t.Fatalf("wait ended with %v, want the denial %s", err, reason)
		}
	}

	t.Run("answer after the watch opened", func(t *testing.T) {
		a := c.WatchAhead(ctx, "ahead-after")
		defer a.Stop()
		<-a.ready
		if a.err != nil {
			t.Fatal(a.err)
		}
		obj := file("ahead-after")
		denyLater(t, obj, "After")
		_, err := c.WaitAhead(ctx, a, obj, decided)
		wantDenied(err, "After")
	})
	t.Run("answer before the watch opened", func(t *testing.T) {
		obj := file("ahead-before")
		if err := deny(obj, "Before"); err != nil {
			t.Fatal(err)
		}
		a := c.WatchAhead(ctx, "ahead-before")
		defer a.Stop()
		_, err := c.WaitAhead(ctx, a, obj, decided)
		wantDenied(err, "Before")
	})
	t.Run("watch on another name", func(t *testing.T) {
		a := c.WatchAhead(ctx, "ahead-predicted")
		defer a.Stop()
		obj := file("ahead-filed")
		denyLater(t, obj, "Other")
		_, err := c.WaitAhead(ctx, a, obj, decided)
		wantDenied(err, "Other")
	})
	t.Run("one connection", func(t *testing.T) {
		// A node's client starts with no connection to the API server:
		// the create, sent once the watch is connected, goes over the
		// watch's connection instead of dialling one of its own.
		cfg := rest.CopyConfig(cp.AdminConfig)
		var dials atomic.Int32
		var d net.Dialer
		cfg.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
			dials.Add(1)
			return d.DialContext(ctx, network, addr)
		}
		node, err := NewClient(cfg)
		if err != nil {
			t.Fatal(err)
		}
		a := node.WatchAhead(ctx, "ahead-one-connection")
		defer a.Stop()
		a.Connected(ctx)
		obj, err := node.Create(ctx, object("ahead-one-connection"))
		if err != nil {
			t.Fatal(err)
		}
		denyLater(t, obj, "OneConnection")
		_, err = node.WaitAhead(ctx, a, obj, decided)
		wantDenied(err, "OneConnection")
		if n := dials.Load(); n != 1 {
			t.Errorf("the watch and the create dialled the API server %d times, want once", n)
		}
	})
	t.Run("stopped watch", func(t *testing.T) {
		a := c.WatchAhead(ctx, "ahead-stopped")
		obj := file("ahead-stopped")
		a.Stop()
		denyLater(t, obj, "Stopped")
		_, err := c.WaitAhead(ctx, a, obj, decided)
		wantDenied(err, "Stopped")
	})
}
