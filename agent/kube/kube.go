// Package kube holds the node's Kubernetes clients. It builds REST clients
// for exactly the API groups the node uses, with a scheme of its own, rather
// than client-go's full clientset: the exec plugin runs for every credential
// refresh of kubelet, and registering every API type at start-up would cost
// it more than the rest of its cached path.
package kube

import (
	"errors"
	"fmt"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/rest"
)

// CertificatesClient returns a REST client for certificates.k8s.io/v1
// that talks protobuf, as kubelet does: an attested request carries its
// evidence (with a TPM's measured-boot log, tens of KiB) in spec.request,
// which JSON would carry as base64 of base64 for the API server to decode
// on the create and encode again for each event of the node's watch. The
// objects stored are the same either way.
func CertificatesClient(cfg *rest.Config) (*rest.RESTClient, *runtime.Scheme, error) {
	scheme := runtime.NewScheme()
	if err := certificatesv1.AddToScheme(scheme); err != nil {
		return nil, nil, err
	}
	gv := certificatesv1.SchemeGroupVersion
	metav1.AddToGroupVersion(scheme, schema.GroupVersion{Version: "v1"})
	c, err := restClientFor(cfg, scheme, gv, runtime.ContentTypeProtobuf)
	return c, scheme, err
}

// ErrInsecureSkipTLSVerify is wrapped by every refusal of a client
// configuration that does not verify the API server's certificate.
var ErrInsecureSkipTLSVerify = errors.New("insecure-skip-tls-verify is not allowed for the node's own connections")

// RequireVerified refuses a client configuration that skips verifying the
// API server (a kubeconfig's insecure-skip-tls-verify). The node sends its
// bootstrap token and client certificate over these connections and writes
// what it reads from them (ClusterTrustBundles) into host trust paths:
// whoever sits between the node and its API server must not be able to
// answer. source names where the setting came from, for the person who
// has to change it.
func RequireVerified(cfg *rest.Config, source string) error {
	if cfg.Insecure {
		return fmt.Errorf("%s: %w: remove insecure-skip-tls-verify and set certificate-authority-data (or certificate-authority) to the cluster CA", source,
			ErrInsecureSkipTLSVerify)
	}
	return nil
}

// RESTClientFor returns a JSON REST client for gv whose objects are decoded
// with scheme (which must know gv's types and metav1's). A configuration
// that skips TLS verification is refused (RequireVerified).
func RESTClientFor(cfg *rest.Config, scheme *runtime.Scheme, gv schema.GroupVersion) (*rest.RESTClient, error) {
	return restClientFor(cfg, scheme, gv, runtime.ContentTypeJSON)
}

// restClientFor is RESTClientFor sending contentType (JSON, or protobuf
// for types that have it) and asking for it, JSON accepted too.
func restClientFor(cfg *rest.Config, scheme *runtime.Scheme, gv schema.GroupVersion, contentType string) (*rest.RESTClient, error) {
	if err := RequireVerified(cfg, "client for "+cfg.Host); err != nil {
		return nil, err
	}
	c := rest.CopyConfig(cfg)
	c.GroupVersion = &gv
	c.APIPath = "/apis"
	if gv.Group == "" {
		c.APIPath = "/api"
	}
	c.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	c.ContentType = contentType
	c.AcceptContentTypes = contentType
	if contentType != runtime.ContentTypeJSON {
		c.AcceptContentTypes += "," + runtime.ContentTypeJSON
	}
	if c.UserAgent == "" {
		c.UserAgent = "kubelet-authenticator"
	}
	rc, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("unable to build a client for %s: %w", gv, err)
	}
	return rc, nil
}
