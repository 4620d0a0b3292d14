// Package kube holds the node's Kubernetes clients. It builds REST clients
// for exactly the API groups the node uses, with a scheme of its own, rather
// than client-go's full clientset: the exec plugin runs for every credential
// refresh of kubelet, and registering every API type at start-up would cost
// it more than the rest of its cached path.
package kube

import (
	"fmt"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/rest"
)

// CertificatesClient returns a REST client for certificates.k8s.io/v1.
func CertificatesClient(cfg *rest.Config) (*rest.RESTClient, *runtime.Scheme, error) {
	scheme := runtime.NewScheme()
	if err := certificatesv1.AddToScheme(scheme); err != nil {
		return nil, nil, err
	}
	gv := certificatesv1.SchemeGroupVersion
	metav1.AddToGroupVersion(scheme, schema.GroupVersion{Version: "v1"})
	c, err := RESTClientFor(cfg, scheme, gv)
	return c, scheme, err
}

// RESTClientFor returns a JSON REST client for gv whose objects are decoded
// with scheme (which must know gv's types and metav1's).
func RESTClientFor(cfg *rest.Config, scheme *runtime.Scheme, gv schema.GroupVersion) (*rest.RESTClient, error) {
	c := rest.CopyConfig(cfg)
	c.GroupVersion = &gv
	c.APIPath = "/apis"
	if gv.Group == "" {
		c.APIPath = "/api"
	}
	c.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	c.ContentType = runtime.ContentTypeJSON
	c.AcceptContentTypes = runtime.ContentTypeJSON
	if c.UserAgent == "" {
		c.UserAgent = "kubelet-authenticator"
	}
	rc, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("unable to build a client for %s: %w", gv, err)
	}
	return rc, nil
}
