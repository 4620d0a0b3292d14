package capi

import (
	"errors"
	"fmt"
	"net/url"
	"strings"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// RefusedKubeconfigError is a workload kubeconfig the controller will not
// use. The `<cluster>-kubeconfig` Secret is in the Cluster's namespace, so
// it is tenant input: anything in it that reads a file (the controller's
// own service-account token, say), runs a program, or skips TLS
// verification would make the controller hand its own credentials, or run
// code, on a tenant's behalf. Only inline credentials are accepted.
type RefusedKubeconfigError struct {
	// Fields are the kubeconfig fields refused, as kubeconfig spells them
	// ("users[admin].tokenFile").
	Fields []string
	// Problems say what is wrong with each (or with the kubeconfig as a
	// whole), one line each.
	Problems []string
}

func (e *RefusedKubeconfigError) Error() string {
	return "workload kubeconfig refused (only inline credentials are accepted: server, certificate-authority-data, " +
		"client-certificate-data with client-key-data, or token): " + strings.Join(e.Problems, "; ")
}

func (e *RefusedKubeconfigError) refuse(field, why string) {
	if field != "" {
		e.Fields = append(e.Fields, field)
	}
	e.Problems = append(e.Problems, why)
}

// WorkloadRESTConfig returns the client configuration of a workload
// kubeconfig (its current context) when it uses only inline credentials:
// an https server, certificate-authority-data or the system roots,
// tls-server-name, and client-certificate-data with client-key-data, or a
// token. Anything else in the context's cluster or user (a file path, an
// exec or auth-provider plugin, insecure-skip-tls-verify, a proxy, basic
// auth, impersonation) is a *RefusedKubeconfigError naming every such
// field. Nothing is read or connected to.
func WorkloadRESTConfig(kubeconfig []byte) (*rest.Config, error) {
	cfg, err := clientcmd.Load(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("unable to parse the workload cluster's kubeconfig: %w", err)
	}
	refused := &RefusedKubeconfigError{}
	ctxName := cfg.CurrentContext
	kctx := cfg.Contexts[ctxName]
	if kctx == nil {
		refused.refuse("current-context", fmt.Sprintf("current-context %q names no context", ctxName))
		return nil, refused
	}
	cluster, user := cfg.Clusters[kctx.Cluster], cfg.AuthInfos[kctx.AuthInfo]
	if cluster == nil {
		refused.refuse(fmt.Sprintf("contexts[%s].cluster", ctxName), fmt.Sprintf("context %q names no cluster", ctxName))
	} else {
		checkCluster(refused, fmt.Sprintf("clusters[%s]", kctx.Cluster), cluster)
	}
	if user == nil {
		refused.refuse(fmt.Sprintf("contexts[%s].user", ctxName), fmt.Sprintf("context %q names no user", ctxName))
	} else {
		checkUser(refused, fmt.Sprintf("users[%s]", kctx.AuthInfo), user)
	}
	if len(refused.Problems) > 0 {
		return nil, refused
	}
	// Only the context's cluster and user, and only the fields checked
	// above: the rest of the file cannot reach the client.
	clean := clientcmdapi.NewConfig()
	clean.Clusters["c"] = &clientcmdapi.Cluster{
		Server:                   cluster.Server,
		TLSServerName:            cluster.TLSServerName,
		CertificateAuthorityData: cluster.CertificateAuthorityData,
		DisableCompression:       cluster.DisableCompression,
	}
	clean.AuthInfos["u"] = &clientcmdapi.AuthInfo{
		ClientCertificateData: user.ClientCertificateData,
		ClientKeyData:         user.ClientKeyData,
		Token:                 user.Token,
	}
	clean.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "u"}
	clean.CurrentContext = "c"
	rc, err := clientcmd.NewDefaultClientConfig(*clean, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("unable to load the workload cluster's kubeconfig: %w", err)
	}
	return rc, nil
}

func checkCluster(r *RefusedKubeconfigError, at string, c *clientcmdapi.Cluster) {
	u, err := url.Parse(c.Server)
	switch {
	case c.Server == "":
		r.refuse(at+".server", at+".server is empty")
	case err != nil || u.Scheme != "https" || u.Host == "":
		r.refuse(at+".server", fmt.Sprintf("%s.server %q is not an https URL", at, c.Server))
	}
	if c.CertificateAuthority != "" {
		r.refuse(at+".certificate-authority", at+".certificate-authority names a file; give certificate-authority-data")
	}
	if c.InsecureSkipTLSVerify {
		r.refuse(at+".insecure-skip-tls-verify", at+".insecure-skip-tls-verify skips verifying the server")
	}
	if c.ProxyURL != "" {
		r.refuse(at+".proxy-url", at+".proxy-url sends the connection through another host")
	}
}

func checkUser(r *RefusedKubeconfigError, at string, u *clientcmdapi.AuthInfo) {
	for _, f := range []struct {
		set        bool
		field, why string
	}{
		{u.TokenFile != "", "tokenFile", "names a file; give token"},
		{u.ClientCertificate != "", "client-certificate", "names a file; give client-certificate-data"},
		{u.ClientKey != "", "client-key", "names a file; give client-key-data"},
		{u.Exec != nil, "exec", "runs a program"},
		{u.AuthProvider != nil, "auth-provider", "runs an authentication plugin"},
		{u.Username != "" || u.Password != "", "username/password", "is basic authentication, which Kubernetes does not serve"},
		{u.Impersonate != "" || u.ImpersonateUID != "" || len(u.ImpersonateGroups) > 0 || len(u.ImpersonateUserExtra) > 0, "as", "impersonates another user"},
	} {
		if f.set {
			r.refuse(at+"."+f.field, at+"."+f.field+" "+f.why)
		}
	}
	certs, keys := len(u.ClientCertificateData) > 0, len(u.ClientKeyData) > 0
	switch {
	case certs != keys:
		r.refuse(at+".client-certificate-data", at+" has only one of client-certificate-data and client-key-data")
	case !certs && u.Token == "" && len(r.Problems) == 0:
		r.refuse(at, at+" has no inline credentials (client-certificate-data and client-key-data, or token)")
	}
}

// refusedFields returns the fields err refuses, if it is a
// *RefusedKubeconfigError.
func refusedFields(err error) ([]string, bool) {
	var r *RefusedKubeconfigError
	if errors.As(err, &r) {
		return r.Fields, true
	}
	return nil, false
}
