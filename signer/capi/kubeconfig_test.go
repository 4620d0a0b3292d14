package capi

import (
	"slices"
	"testing"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

func kubeconfigOf(t *testing.T, cluster clientcmdapi.Cluster, user clientcmdapi.AuthInfo) []byte {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["wl"] = &cluster
	cfg.AuthInfos["admin"] = &user
	cfg.Contexts["admin@wl"] = &clientcmdapi.Context{Cluster: "wl", AuthInfo: "admin"}
	cfg.CurrentContext = "admin@wl"
	b, err := clientcmd.Write(*cfg)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestWorkloadRESTConfig(t *testing.T) {
	ca := []byte("-----BEGIN CERTIFICATE-----\nMA==\n-----END CERTIFICATE-----\n")
	good := clientcmdapi.Cluster{Server: "https://wl.example:6443", CertificateAuthorityData: ca}
	certs := clientcmdapi.AuthInfo{ClientCertificateData: []byte("cert"), ClientKeyData: []byte("key")}
	for _, tc := range []struct {
		name    string
		cluster clientcmdapi.Cluster
		user    clientcmdapi.AuthInfo
		refused []string // nil: accepted
	}{
		{name: "client certificate data", cluster: good, user: certs},
		{name: "token", cluster: good, user: clientcmdapi.AuthInfo{Token: "t"}},
		{name: "system roots", cluster: clientcmdapi.Cluster{Server: "https://wl.example"}, user: clientcmdapi.AuthInfo{Token: "t"}},
		{name: "tokenFile", cluster: good, user: clientcmdapi.AuthInfo{TokenFile: "/var/run/secrets/kubernetes.io/serviceaccount/token"},
			refused: []string{"users[admin].tokenFile"}},
		{name: "token and tokenFile", cluster: good, user: clientcmdapi.AuthInfo{Token: "t", TokenFile: "/token"}, refused: []string{"users[admin].tokenFile"}},
		{name: "exec", cluster: good, user: clientcmdapi.AuthInfo{Exec: &clientcmdapi.ExecConfig{Command: "sh", APIVersion: "client.authentication.k8s.io/v1"}},
			refused: []string{"users[admin].exec"}},
		{name: "auth-provider", cluster: good, user: clientcmdapi.AuthInfo{AuthProvider: &clientcmdapi.AuthProviderConfig{Name: "oidc"}},
			refused: []string{"users[admin].auth-provider"}},
		{name: "client certificate and key paths", cluster: good, user: clientcmdapi.AuthInfo{ClientCertificate: "/c", ClientKey: "/k"},
			refused: []string{"users[admin].client-certificate", "users[admin].client-key"}},
		{name: "certificate data, key path", cluster: good, user: clientcmdapi.AuthInfo{ClientCertificateData: []byte("c"), ClientKey: "/k"},
			refused: []string{"users[admin].client-key", "users[admin].client-certificate-data"}},
		{name: "certificate-authority path", cluster: clientcmdapi.Cluster{Server: good.Server, CertificateAuthority: "/ca.crt"}, user: certs,
			refused: []string{"clusters[wl].certificate-authority"}},
		{name: "insecure-skip-tls-verify", cluster: clientcmdapi.Cluster{Server: good.Server, InsecureSkipTLSVerify: true}, user: certs,
			refused: []string{"clusters[wl].insecure-skip-tls-verify"}},
		{name: "proxy-url", cluster: clientcmdapi.Cluster{Server: good.Server, CertificateAuthorityData: ca, ProxyURL: "http://proxy:3128"}, user: certs,
			refused: []string{"clusters[wl].proxy-url"}},
		{name: "plain http", cluster: clientcmdapi.Cluster{Server: "http://wl.example"}, user: clientcmdapi.AuthInfo{Token: "t"},
			refused: []string{"clusters[wl].server"}},
		{name: "impersonation", cluster: good, user: clientcmdapi.AuthInfo{Token: "t", Impersonate: "system:admin"}, refused: []string{"users[admin].as"}},
		{name: "basic auth", cluster: good, user: clientcmdapi.AuthInfo{Username: "u", Password: "p"}, refused: []string{"users[admin].username/password"}},
		{name: "no credentials", cluster: good, refused: []string{"users[admin]"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := WorkloadRESTConfig(kubeconfigOf(t, tc.cluster, tc.user))
			fields, refused := refusedFields(err)
			if tc.refused == nil {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				if cfg.Host != tc.cluster.Server || cfg.BearerTokenFile != "" || cfg.ExecProvider != nil || cfg.AuthProvider != nil || cfg.Insecure {
					t.Errorf("config %+v", cfg)
				}
				return
			}
			if !refused {
				t.Fatalf("got %v, want the fields %v refused", err, tc.refused)
			}
			slices.Sort(fields)
			want := slices.Sorted(slices.Values(tc.refused))
			if !slices.Equal(fields, want) {
				t.Errorf("refused fields %v, want %v (%v)", fields, want, err)
			}
		})
	}
}

func TestWorkloadRESTConfigUnknownContext(t *testing.T) {
	b := kubeconfigOf(t, clientcmdapi.Cluster{Server: "https://wl"}, clientcmdapi.AuthInfo{Token: "t"})
	cfg, err := clientcmd.Load(b)
	if err != nil {
		t.Fatal(err)
	}
	cfg.CurrentContext = "elsewhere"
	b, err = clientcmd.Write(*cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := WorkloadRESTConfig(b); err == nil {
		t.Fatal("a kubeconfig whose current context does not exist was accepted")
	}
}
