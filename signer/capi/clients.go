package capi

import (
	"fmt"

	admissionregistrationv1client "k8s.io/client-go/kubernetes/typed/admissionregistration/v1"
	certificatesv1client "k8s.io/client-go/kubernetes/typed/certificates/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	rbacv1client "k8s.io/client-go/kubernetes/typed/rbac/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"
)

// workloadClient is what a Cluster's controller keeps of its workload
// cluster's API for the Cluster's life: the CSRs (the CSR controller),
// ConfigMaps and admission policies (revocation), ClusterRoleBindings
// (lockdown), and the readiness probe (any group's REST client). A
// kubernetes.Interface is one.
type workloadClient interface {
	CertificatesV1() certificatesv1client.CertificatesV1Interface
	CoreV1() corev1client.CoreV1Interface
	AdmissionregistrationV1() admissionregistrationv1client.AdmissionregistrationV1Interface
	RbacV1() rbacv1client.RbacV1Interface
}

// groupClients is a workloadClient with a REST client for only those
// four groups: kubernetes.NewForConfig builds one for each of about fifty,
// which a fleet of opted-in Clusters holds once per Cluster.
type groupClients struct {
	certificates *certificatesv1client.CertificatesV1Client
	core         *corev1client.CoreV1Client
	admission    *admissionregistrationv1client.AdmissionregistrationV1Client
	rbac         *rbacv1client.RbacV1Client
}

// newWorkloadClient builds a workloadClient as kubernetes.NewForConfig
// builds its clients: one HTTP client and one rate limiter (cfg's QPS and
// burst) shared by every group.
func newWorkloadClient(cfg *rest.Config) (*groupClients, error) {
	cfg = rest.CopyConfig(cfg)
	if cfg.UserAgent == "" {
		cfg.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	if cfg.RateLimiter == nil && cfg.QPS > 0 {
		if cfg.Burst <= 0 {
			return nil, fmt.Errorf("client QPS %v needs a burst above 0, not %d", cfg.QPS, cfg.Burst)
		}
		cfg.RateLimiter = flowcontrol.NewTokenBucketRateLimiter(cfg.QPS, cfg.Burst)
	}
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, err
	}
	c := &groupClients{}
	if c.certificates, err = certificatesv1client.NewForConfigAndClient(cfg, hc); err != nil {
		return nil, err
	}
	if c.core, err = corev1client.NewForConfigAndClient(cfg, hc); err != nil {
		return nil, err
	}
	if c.admission, err = admissionregistrationv1client.NewForConfigAndClient(cfg, hc); err != nil {
		return nil, err
	}
	if c.rbac, err = rbacv1client.NewForConfigAndClient(cfg, hc); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *groupClients) CertificatesV1() certificatesv1client.CertificatesV1Interface {
	return c.certificates
}

func (c *groupClients) CoreV1() corev1client.CoreV1Interface { return c.core }

func (c *groupClients) AdmissionregistrationV1() admissionregistrationv1client.AdmissionregistrationV1Interface {
	return c.admission
}

func (c *groupClients) RbacV1() rbacv1client.RbacV1Interface { return c.rbac }
