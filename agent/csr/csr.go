// Package csr builds attested kubelet certificate signing requests (client
// and serving) as the wire contract lays them out, files them under a deterministic name so
// that a retry finds the same object, and waits for the signer's answer.
package csr

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http/httptrace"
	"sync"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"

	"sigs.k8s.io/kubelet-authenticator/agent/kube"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// NamePrefix starts the name of every CSR this project files.
const NamePrefix = "kubelet-authenticator-"

// ClientUsages are the usages of a kubelet client certificate.
var ClientUsages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}

// ServingUsages are the usages of a kubelet serving certificate (ECDSA
// keys: no key encipherment).
var ServingUsages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth}

// GenerateKey returns a new ECDSA P-256 key, the only key type the contract
// uses for kubelet client certificates.
func GenerateKey() (*ecdsa.PrivateKey, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

// SPKI returns the DER SubjectPublicKeyInfo of key's public half.
func SPKI(key *ecdsa.PrivateKey) ([]byte, error) {
	return x509.MarshalPKIXPublicKey(&key.PublicKey)
}

// Binding returns the binding evidence for key must commit to.
func Binding(key *ecdsa.PrivateKey) ([]byte, error) {
	spki, err := SPKI(key)
	if err != nil {
		return nil, err
	}
	return attestor.Binding(spki), nil
}

// PKCS10 returns the DER client certificate request for nodeName, carrying
// providerID in the provider-ID extension, signed by key. It has no SANs.
func PKCS10(key *ecdsa.PrivateKey, nodeName, providerID string) ([]byte, error) {
	return request(key, nodeName, providerID, nil, nil)
}

// ServingPKCS10 returns the DER serving certificate request for nodeName:
// the same subject and provider-ID extension as PKCS10, and the node's
// addresses as DNS and IP SANs (the signer accepts only the Machine's own).
func ServingPKCS10(key *ecdsa.PrivateKey, nodeName, providerID string, dnsNames []string, ips []net.IP) ([]byte, error) {
	if len(dnsNames)+len(ips) == 0 {
		return nil, errors.New("a serving certificate request needs at least one DNS name or IP address")
	}
	return request(key, nodeName, providerID, dnsNames, ips)
}

func request(key *ecdsa.PrivateKey, nodeName, providerID string, dnsNames []string, ips []net.IP) ([]byte, error) {
	ext, err := attestor.ProviderIDExtension(providerID)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.CertificateRequest{
		Subject: pkix.Name{
			CommonName:   attestor.NodeUserPrefix + nodeName,
			Organization: []string{attestor.NodesGroup},
		},
		DNSNames:        dnsNames,
		IPAddresses:     ips,
		ExtraExtensions: []pkix.Extension{ext},
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		return nil, fmt.Errorf("unable to create certificate request: %w", err)
	}
	return der, nil
}

// Name returns the deterministic name of the CSR that key files for
// nodeName to signerName with evidence of the given version and round: the
// same inputs give the same name, so a retry finds the CSR it filed before.
func Name(signerName, nodeName string, key *ecdsa.PrivateKey, version, round string) (string, error) {
	spki, err := SPKI(key)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	for _, s := range [][]byte{[]byte(signerName), []byte(nodeName), spki, []byte(version), []byte(round)} {
		h.Write(s)
		h.Write([]byte{0})
	}
	return NamePrefix + hex.EncodeToString(h.Sum(nil)[:16]), nil
}

// Object returns the client CertificateSigningRequest object to file.
func Object(name, signerName string, request []byte, expirationSeconds *int32, annotations map[string]string) *certificatesv1.CertificateSigningRequest {
	return ObjectWithUsages(name, signerName, ClientUsages, request, expirationSeconds, annotations)
}

// ObjectWithUsages returns the CertificateSigningRequest object to file
// for a certificate with the given usages (ClientUsages, ServingUsages).
func ObjectWithUsages(name, signerName string, usages []certificatesv1.KeyUsage, request []byte, expirationSeconds *int32,
	annotations map[string]string) *certificatesv1.CertificateSigningRequest {
	return &certificatesv1.CertificateSigningRequest{
		TypeMeta:   metav1.TypeMeta{APIVersion: "certificates.k8s.io/v1", Kind: "CertificateSigningRequest"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: annotations},
		Spec: certificatesv1.CertificateSigningRequestSpec{
			Request:           request,
			SignerName:        signerName,
			Usages:            usages,
			ExpirationSeconds: expirationSeconds,
		},
	}
}

// DeniedError is returned when the signer denied (or failed) a CSR.
type DeniedError struct {
	Name    string
	Type    certificatesv1.RequestConditionType
	Reason  string
	Message string
}

func (e *DeniedError) Error() string {
	verb := "denied"
	if e.Type == certificatesv1.CertificateFailed {
		verb = "failed"
	}
	return fmt.Sprintf("certificate signing request %s was %s: %s: %s", e.Name, verb, e.Reason, e.Message)
}

// Client files and watches CertificateSigningRequests.
type Client struct {
	rc     *rest.RESTClient
	scheme *runtime.Scheme
}

// NewClient returns a Client using cfg.
func NewClient(cfg *rest.Config) (*Client, error) {
	rc, scheme, err := kube.CertificatesClient(cfg)
	if err != nil {
		return nil, err
	}
	return &Client{rc: rc, scheme: scheme}, nil
}

const resource = "certificatesigningrequests"

// Create files obj. If a CSR of that name exists already and carries the
// same PKCS#10 request (a retry of ours), it is returned instead; a
// different one with that name is an error.
func (c *Client) Create(ctx context.Context, obj *certificatesv1.CertificateSigningRequest) (*certificatesv1.CertificateSigningRequest, error) {
	out := &certificatesv1.CertificateSigningRequest{}
	err := c.rc.Post().Resource(resource).Body(obj).Do(ctx).Into(out)
	if err == nil {
		return out, nil
	}
	if !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("unable to create certificate signing request %s: %w", obj.Name, err)
	}
	existing, gerr := c.Get(ctx, obj.Name)
	if gerr != nil {
		return nil, gerr
	}
	if !samePKCS10(existing.Spec.Request, obj.Spec.Request) {
		return nil, fmt.Errorf("certificate signing request %s exists with a different request", obj.Name)
	}
	return existing, nil
}

// Get returns the named CSR.
func (c *Client) Get(ctx context.Context, name string) (*certificatesv1.CertificateSigningRequest, error) {
	out := &certificatesv1.CertificateSigningRequest{}
	if err := c.rc.Get().Resource(resource).Name(name).Do(ctx).Into(out); err != nil {
		return nil, fmt.Errorf("unable to get certificate signing request %s: %w", name, err)
	}
	return out, nil
}

// Wait watches the named CSR until done reports true or returns an error,
// or ctx ends. done sees every version of the object, starting with the
// current one.
func (c *Client) Wait(ctx context.Context, name string,
	done func(*certificatesv1.CertificateSigningRequest) (bool, error)) (*certificatesv1.CertificateSigningRequest, error) {
	ev, err := watchtools.UntilWithSync(ctx, c.listWatch(name), &certificatesv1.CertificateSigningRequest{}, nil, untilDone(name, done))
	if err != nil {
		return nil, waitError(ctx, name, err)
	}
	return ev.Object.(*certificatesv1.CertificateSigningRequest), nil
}

// WaitFrom is Wait for a CSR this node has just filed: obj is what Create
// returned, and the watch starts at its resourceVersion, with no List
// first (a request less on the cold path, and no wait for the API
// server's watch cache to catch up with a fresh List). done sees obj, then
// every later version. Where the API server no longer holds that version
// (the watch expired), it falls back to Wait.
func (c *Client) WaitFrom(ctx context.Context, obj *certificatesv1.CertificateSigningRequest,
	done func(*certificatesv1.CertificateSigningRequest) (bool, error)) (*certificatesv1.CertificateSigningRequest, error) {
	if ok, err := done(obj); ok || err != nil {
		return obj, err
	}
	if obj.ResourceVersion == "" || obj.ResourceVersion == "0" {
		return c.Wait(ctx, obj.Name, done)
	}
	ev, err := watchtools.Until(ctx, obj.ResourceVersion, c.listWatch(obj.Name), untilDone(obj.Name, done))
	if errors.Is(err, watchtools.ErrWatchClosed) && ctx.Err() == nil {
		// The watch ended for good (its version expired): start over
		// from the current object.
		return c.Wait(ctx, obj.Name, done)
	}
	if err != nil {
		return nil, waitError(ctx, obj.Name, err)
	}
	return ev.Object.(*certificatesv1.CertificateSigningRequest), nil
}

// Ahead is a watch on one CSR, opened before the CSR is filed
// (WatchAhead): the connection to the API server is set up and the watch
// registered while the node attests, instead of after the create. With no
// resourceVersion the API server sends the CSR as it is when the watch
// starts (if it exists by then) and every change after, so nothing filed
// in between is missed.
type Ahead struct {
	name   string
	ready  chan struct{}
	conn   chan struct{}
	w      watch.Interface
	err    error
	cancel context.CancelFunc
}

// WatchAhead starts opening a watch on the CSR name is about to be filed
// under. Stop it when done with it.
func (c *Client) WatchAhead(ctx context.Context, name string) *Ahead {
	ctx, cancel := context.WithCancel(ctx)
	a := &Ahead{name: name, ready: make(chan struct{}), conn: make(chan struct{}), cancel: cancel}
	var once sync.Once
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GotConn: func(httptrace.GotConnInfo) { once.Do(func() { close(a.conn) }) },
	})
	go func() {
		defer close(a.ready)
		a.w, a.err = c.listWatch(name).WatchWithContext(ctx, metav1.ListOptions{})
	}()
	return a
}

// Connected waits until the watch has its connection to the API server
// (or failed to get one). A request sent after it shares that connection:
// one sent while the first is still being dialled dials a second one
// (HTTP/2 pools a connection only once its TLS handshake is done), a TLS
// handshake both the node and the API server pay for and then throw away.
func (a *Ahead) Connected(ctx context.Context) {
	select {
	case <-a.conn:
	case <-a.ready:
	case <-ctx.Done():
	}
}

// Stop ends the watch (or its opening). It may be called more than once.
func (a *Ahead) Stop() {
	a.cancel()
	<-a.ready
	if a.w != nil {
		a.w.Stop()
	}
}

// WaitAhead is WaitFrom through a, a watch opened ahead on obj's name: obj
// is what Create returned, done sees it first and then every later version
// the watch delivers. If a watches another name (the request was filed
// under a name not known in advance), did not open, or ends early, the
// wait goes on as WaitFrom from the newest version seen.
func (c *Client) WaitAhead(ctx context.Context, a *Ahead, obj *certificatesv1.CertificateSigningRequest,
	done func(*certificatesv1.CertificateSigningRequest) (bool, error)) (*certificatesv1.CertificateSigningRequest, error) {
	if ok, err := done(obj); ok || err != nil {
		return obj, err
	}
	if a == nil || a.name != obj.Name {
		return c.WaitFrom(ctx, obj, done)
	}
	select {
	case <-a.ready:
	case <-ctx.Done():
		return nil, waitError(ctx, obj.Name, ctx.Err())
	}
	if a.err != nil {
		return c.WaitFrom(ctx, obj, done)
	}
	ev, err := watchtools.UntilWithoutRetry(ctx, a.w, untilDone(obj.Name, done))
	if errors.Is(err, watchtools.ErrWatchClosed) && ctx.Err() == nil {
		// The watch ended early: go on from the newest version it sent.
		if ev != nil && ev.Type != watch.Deleted {
			if o, ok := ev.Object.(*certificatesv1.CertificateSigningRequest); ok {
				obj = o
			}
		}
		return c.WaitFrom(ctx, obj, done)
	}
	if err != nil {
		return nil, waitError(ctx, obj.Name, err)
	}
	return ev.Object.(*certificatesv1.CertificateSigningRequest), nil
}

func (c *Client) listWatch(name string) *cache.ListWatch {
	return cache.NewListWatchFromClient(c.rc, resource, "", fields.OneTermEqualSelector("metadata.name", name))
}

// untilDone turns done into a watch condition on the named CSR.
func untilDone(name string, done func(*certificatesv1.CertificateSigningRequest) (bool, error)) watchtools.ConditionFunc {
	return func(ev watch.Event) (bool, error) {
		switch ev.Type {
		case watch.Deleted:
			return false, fmt.Errorf("certificate signing request %s was deleted", name)
		case watch.Added, watch.Modified:
			obj, ok := ev.Object.(*certificatesv1.CertificateSigningRequest)
			if !ok {
				return false, nil
			}
			return done(obj)
		}
		return false, nil
	}
}

func waitError(ctx context.Context, name string, err error) error {
	if errors.Is(err, watchtools.ErrWatchClosed) || ctx.Err() != nil {
		return fmt.Errorf("timed out waiting for certificate signing request %s to be signed: %w", name, context.DeadlineExceeded)
	}
	return err
}

// Outcome reports what the signer decided on a CSR: its certificate, a
// *DeniedError, or neither (still pending).
func Outcome(obj *certificatesv1.CertificateSigningRequest) ([]byte, error) {
	for _, c := range obj.Status.Conditions {
		if (c.Type == certificatesv1.CertificateDenied || c.Type == certificatesv1.CertificateFailed) && c.Status != corev1.ConditionFalse {
			return nil, &DeniedError{Name: obj.Name, Type: c.Type, Reason: c.Reason, Message: c.Message}
		}
	}
	if len(obj.Status.Certificate) > 0 {
		return obj.Status.Certificate, nil
	}
	return nil, nil
}

func samePKCS10(a, b []byte) bool {
	ra, errA := attestor.ParseRequest(a)
	rb, errB := attestor.ParseRequest(b)
	if errA != nil || errB != nil {
		return false
	}
	return bytes.Equal(ra.CSR.RawSubjectPublicKeyInfo, rb.CSR.RawSubjectPublicKeyInfo) && ra.CSR.Subject.CommonName == rb.CSR.Subject.CommonName
}
