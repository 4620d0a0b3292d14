package app

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"sigs.k8s.io/kubelet-authenticator/attestor/aws"
	"sigs.k8s.io/kubelet-authenticator/attestor/azure"
	"sigs.k8s.io/kubelet-authenticator/attestor/gcp"
	awsemu "sigs.k8s.io/kubelet-authenticator/test/emulators/aws"
	azureemu "sigs.k8s.io/kubelet-authenticator/test/emulators/azure"
	gcpemu "sigs.k8s.io/kubelet-authenticator/test/emulators/gcp"
)

func writeFile(t *testing.T, dir, name, data string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestAttestorConfigValidateReportsEverything(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, yaml string
		want       []string
	}{
		{"empty", "kind: AttestorConfig\n", []string{"configures no attestor"}},
		{"unknown field", "aws:\n  acounts: [\"111122223333\"]\n", []string{"unknown field"}},
		{"every section", `apiVersion: v2
kind: NodeConfig
aws:
  sts:
    tls:
      securityProfile: {type: Paranoid}
azure: {}
gcp:
  jwks:
    tls:
      trustedCA: {}
`, []string{
			`apiVersion "v2"`, `kind "NodeConfig"`,
			"aws.accounts", "aws.sts.tls: securityProfile.type",
			"azure.subscriptions", "aws.allowedRoles",
			"gcp.projects", "gcp.jwks.tls: trustedCA",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := &cloudOptions{AttestorConfigFile: writeFile(t, dir, tc.name+".yaml", tc.yaml)}
			errs := o.validate()
			msg := ""
			for _, e := range errs {
				msg += e.Error() + "\n"
			}
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("errors do not report %q:\n%s", w, msg)
				}
			}
			if !strings.Contains(msg, "--attestor-config") {
				t.Errorf("errors do not name the flag:\n%s", msg)
			}
		})
	}
}

func TestCloudVerifiersFromFile(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	a := awsemu.New(t, awsemu.Instance{})
	z := azureemu.New(t, azureemu.VM{})
	g := gcpemu.New(t, gcpemu.Instance{})
	certs := filepath.Join(dir, "certs")
	if err := os.MkdirAll(certs, 0o700); err != nil {
		t.Fatal(err)
	}
	writeFile(t, certs, a.Instance.Region+".pem", string(a.RegionCertPEM))
	cfg := `apiVersion: kubelet-authenticator.x-k8s.io/v1alpha1
kind: AttestorConfig
aws:
  accounts: ["111122223333"]
  allowedRoles: ["` + a.Instance.Role + `"]
  certificatesDir: ` + certs + `
  sts:
    tls:
      trustedCA:
        configMap: {name: sts-ca}
azure:
  roots: [` + writeFile(t, dir, "root.pem", string(z.Root.PEM)) + `]
  subscriptions: ["` + z.VM.SubscriptionID + `"]
gcp:
  projects: [test-project]
  jwks:
    url: ` + g.JWKSURL + `
    tls:
      trustedCA:
        configMap: {name: jwks-ca, namespace: other}
`
	o := NewOptions()
	o.LeaderElectionNamespace = "capi-system"
	o.AttestorConfigFile = writeFile(t, dir, "attestors.yaml", cfg)
	if errs := o.cloudOptions.validate(); len(errs) > 0 {
		t.Fatal(errs)
	}
	cm := func(ns, name string, pem []byte) *corev1.ConfigMap {
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Data: map[string]string{"ca-bundle.crt": string(pem)}}
	}

	// A missing ConfigMap stops the start, naming where it was looked for.
	sections, err := o.attestorConfigSections()
	if err != nil {
		t.Fatal(err)
	}
	_, _, err = o.verifiersFrom(ctx, fake.NewClientBuilder().WithObjects(cm("other", "jwks-ca", g.JWKSCAPEM)).Build(), sections)
	if err == nil || !strings.Contains(err.Error(), "aws attestor: sts.tls") || !strings.Contains(err.Error(), "capi-system/sts-ca") {
		t.Fatalf("missing ConfigMap: %v", err)
	}

	c := fake.NewClientBuilder().WithObjects(cm("capi-system", "sts-ca", a.STSCAPEM), cm("other", "jwks-ca", g.JWKSCAPEM)).Build()
	table, live, err := o.verifiersFrom(ctx, c, sections)
	if err != nil {
		t.Fatal(err)
	}
	// Every upstream a verifier reaches is one the reload finds in the
	// file (upstreams.go), under the same name.
	if got, want := slices.Sorted(maps.Keys(live.live)), slices.Sorted(maps.Keys(o.attestorConfig.tlsFields())); !slices.Equal(got, want) {
		t.Errorf("live upstreams %v, tls blocks of the file %v", got, want)
	}
	if _, ok := table[aws.Name].(*aws.Verifier); !ok {
		t.Error("no aws verifier")
	}
	if _, ok := table[azure.Name].(*azure.Verifier); !ok {
		t.Error("no azure verifier")
	}
	if _, ok := table[gcp.Name].(*gcp.Verifier); !ok {
		t.Error("no gcp verifier")
	}

	// Without the file, no cloud attestor is served.
	o.AttestorConfigFile = ""
	if errs := o.cloudOptions.validate(); len(errs) > 0 {
		t.Fatal(errs)
	}
	if sections, err = o.attestorConfigSections(); err != nil {
		t.Fatal(err)
	}
	table, _, err = o.verifiersFrom(ctx, c, sections)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{aws.Name, azure.Name, gcp.Name} {
		if _, ok := table[name]; ok {
			t.Errorf("no file: %s is served", name)
		}
	}
}
