package harness

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
)

// ClusterAPIBinariesEnv names the environment variable holding the directory
// test/tools/install-capi.sh prints: capi-manager, cabpk-manager, clusterctl
// and their config trees (config/core, config/bootstrap).
const ClusterAPIBinariesEnv = "KA_CAPI_BIN"

// managerReadyTimeout bounds the wait for a Cluster API manager to answer
// /readyz (its webhook server included) on a loaded machine.
const managerReadyTimeout = 3 * time.Minute

// ClusterAPIBinaries returns the directory named by KA_CAPI_BIN, or "" when
// it is unset (callers skip). It fails the test when the directory lacks a
// manager or a config tree.
func ClusterAPIBinaries(tb testing.TB) string {
	tb.Helper()
	dir := os.Getenv(ClusterAPIBinariesEnv)
	if dir == "" {
		return ""
	}
	var missing []string
	for _, p := range []string{"capi-manager", "cabpk-manager", "config/core/crd/bases", "config/core/webhook/manifests.yaml",
		"config/bootstrap/crd/bases", "config/bootstrap/webhook/manifests.yaml"} {
		if _, err := os.Stat(filepath.Join(dir, p)); err != nil {
			missing = append(missing, p)
		}
	}
	if len(missing) > 0 {
		tb.Fatalf("%s=%s lacks %s (run test/tools/install-capi.sh)", ClusterAPIBinariesEnv, dir, strings.Join(missing, ", "))
	}
	return dir
}

// ClusterAPI is the real Cluster API core manager and the kubeadm bootstrap
// provider (CABPK) running against a management cluster, with their
// conversion, defaulting and validating webhooks served on 127.0.0.1.
type ClusterAPI struct {
	// Core and Bootstrap are the two manager processes.
	Core, Bootstrap *Process
}

// clusterAPIProvider is one manager and its config tree.
type clusterAPIProvider struct {
	name, binary, config string
	args                 []string
	webhookPort          int
	healthPort           int
}

// StartClusterAPI runs the core manager and CABPK from dir (see
// ClusterAPIBinaries) against m, as admin, without leader election or
// metrics. It installs CABPK's CRDs, labels both providers' CRDs with their
// contract versions and points the ones they convert at the manager serving
// them, as their config/*/crd kustomizations do, starts both
// managers with a serving certificate of a CA made here, waits until both are
// ready, and then installs their validating and mutating webhook
// configurations with the services rewritten to https://127.0.0.1:<port>.
// extraCABPKArgs are added to CABPK's flags (e.g. --bootstrap-token-ttl).
// Both managers are stopped before m's kube-apiserver, by m.Stop and by the
// test's cleanup; their logs are cluster-api/<manager>.log in m.Dir.
func (m *Management) StartClusterAPI(tb testing.TB, dir string, extraCABPKArgs ...string) *ClusterAPI {
	tb.Helper()
	ctx := context.Background()
	work := filepath.Join(m.Dir, "cluster-api")
	if err := os.MkdirAll(work, 0o700); err != nil {
		tb.Fatal(err)
	}
	ca, err := NewCA("cluster-api-webhooks")
	if err != nil {
		tb.Fatal(err)
	}
	certPEM, keyPEM, err := ca.Issue(CertSpec{CommonName: "127.0.0.1", IPs: []net.IP{net.ParseIP("127.0.0.1")}, Server: true})
	if err != nil {
		tb.Fatal(err)
	}
	certDir := filepath.Join(work, "serving-certs")
	if err := os.MkdirAll(certDir, 0o700); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(certDir, "tls.crt"), certPEM, 0o600); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(certDir, "tls.key"), keyPEM, 0o600); err != nil {
		tb.Fatal(err)
	}

	providers := []*clusterAPIProvider{
		{name: "capi-manager", binary: "capi-manager", config: "core"},
		{name: "cabpk-manager", binary: "cabpk-manager", config: "bootstrap", args: extraCABPKArgs},
	}
	for _, p := range providers {
		p.webhookPort = FreePort(tb)
		p.healthPort = FreePort(tb)
	}

	// CABPK's CRDs; the core ones StartManagement installed.
	bootstrapCRDs, err := readCRDs(filepath.Join(dir, "config", "bootstrap", "crd", "bases"))
	if err != nil {
		tb.Fatal(err)
	}
	if err := installCRDs(m.ControlPlane, bootstrapCRDs); err != nil {
		tb.Fatalf("control plane %s: %v", m.Name, err)
	}
	for _, p := range providers {
		if err := kustomizeCRDs(ctx, m.ControlPlane, filepath.Join(dir, "config", p.config, "crd"), p.webhookPort, ca.CertPEM); err != nil {
			tb.Fatalf("%s: %v", p.name, err)
		}
	}

	procs := make([]*Process, len(providers))
	for i, p := range providers {
		args := append([]string{
			"--kubeconfig=" + m.AdminKubeconfig,
			"--leader-elect=false",
			fmt.Sprintf("--webhook-port=%d", p.webhookPort),
			"--webhook-cert-dir=" + certDir,
			fmt.Sprintf("--health-addr=127.0.0.1:%d", p.healthPort),
			"--diagnostics-address=0",
			"--v=2",
		}, p.args...)
		procs[i] = StartProcess(tb, p.name, filepath.Join(work, p.name+".log"), filepath.Join(dir, p.binary), args...)
		m.mu.Lock()
		m.others = append(m.others, procs[i])
		m.mu.Unlock()
	}
	for i, p := range providers {
		if err := waitReady(ctx, procs[i], p.healthPort); err != nil {
			tb.Fatalf("%s: %v", p.name, err)
		}
	}
	for _, p := range providers {
		if err := installWebhooks(ctx, m.ControlPlane, filepath.Join(dir, "config", p.config, "webhook", "manifests.yaml"), p.name, p.webhookPort,
			ca.CertPEM); err != nil {
			tb.Fatalf("%s: %v", p.name, err)
		}
	}
	return &ClusterAPI{Core: procs[0], Bootstrap: procs[1]}
}

// InstallCRDs installs the CRDs in the YAML files of dir (for example a
// test's own infrastructure provider) and returns once they are served.
func (m *Management) InstallCRDs(tb testing.TB, dir string) {
	tb.Helper()
	crds, err := readCRDs(dir)
	if err != nil {
		tb.Fatal(err)
	}
	if err := installCRDs(m.ControlPlane, crds); err != nil {
		tb.Fatalf("control plane %s: %v", m.Name, err)
	}
}

// readCRDs decodes every CRD in the YAML files of dir.
func readCRDs(dir string) ([]*apiextensionsv1.CustomResourceDefinition, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		return nil, fmt.Errorf("no CRDs in %s (%w)", dir, err)
	}
	return readCRDFiles(files)
}

// readCRDFiles decodes every CRD in files.
func readCRDFiles(files []string) ([]*apiextensionsv1.CustomResourceDefinition, error) {
	var crds []*apiextensionsv1.CustomResourceDefinition
	for _, file := range files {
		docs, err := yamlDocuments(file)
		if err != nil {
			return nil, err
		}
		for _, doc := range docs {
			crd := &apiextensionsv1.CustomResourceDefinition{}
			if err := yaml.UnmarshalStrict(doc, crd); err != nil {
				return nil, fmt.Errorf("unable to decode CRD in %s: %w", file, err)
			}
			if crd.Name == "" { // a document of comments only
				continue
			}
			crds = append(crds, crd)
		}
	}
	return crds, nil
}

// yamlDocuments splits a multi-document YAML file, dropping empty documents.
func yamlDocuments(file string) ([][]byte, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("unable to read %s: %w", file, err)
	}
	var docs [][]byte
	for _, doc := range bytes.Split(b, []byte("\n---")) {
		doc = bytes.TrimPrefix(bytes.TrimSpace(doc), []byte("---"))
		if len(bytes.TrimSpace(doc)) > 0 {
			docs = append(docs, doc)
		}
	}
	return docs, nil
}

// kustomizeCRDs does to the provider's installed CRDs what its
// config/<provider>/crd/kustomization.yaml does: adds the labels of its
// "labels" pairs (Cluster API reads each provider's contract versions from
// them, e.g. cluster.x-k8s.io/v1beta2: v1beta2) and, for every CRD with a
// patch "webhook_in_<plural>.yaml" in crd/patches, sets the conversion
// webhook, here https://127.0.0.1:port/convert trusting caPEM.
func kustomizeCRDs(ctx context.Context, cp *ControlPlane, crdDir string, port int, caPEM []byte) error {
	c, err := apiextensionsclient.NewForConfig(cp.AdminConfig)
	if err != nil {
		return fmt.Errorf("unable to create apiextensions client: %w", err)
	}
	b, err := os.ReadFile(filepath.Join(crdDir, "kustomization.yaml"))
	if err != nil {
		return fmt.Errorf("unable to read the CRDs' kustomization: %w", err)
	}
	var kustomization struct {
		Labels []struct {
			Pairs map[string]string `json:"pairs"`
		} `json:"labels"`
	}
	if err := yaml.Unmarshal(b, &kustomization); err != nil {
		return fmt.Errorf("unable to decode %s/kustomization.yaml: %w", crdDir, err)
	}
	crds, err := readCRDs(filepath.Join(crdDir, "bases"))
	if err != nil {
		return err
	}
	url := fmt.Sprintf("https://127.0.0.1:%d/convert", port)
	for _, base := range crds {
		crd, err := c.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, base.Name, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("unable to get CRD %s: %w", base.Name, err)
		}
		if crd.Labels == nil {
			crd.Labels = map[string]string{}
		}
		for _, l := range kustomization.Labels {
			for k, v := range l.Pairs {
				crd.Labels[k] = v
			}
		}
		patch := filepath.Join(crdDir, "patches", "webhook_in_"+crd.Spec.Names.Plural+".yaml")
		if _, err := os.Stat(patch); err == nil {
			crd.Spec.Conversion = &apiextensionsv1.CustomResourceConversion{
				Strategy: apiextensionsv1.WebhookConverter,
				Webhook: &apiextensionsv1.WebhookConversion{
					ConversionReviewVersions: []string{"v1"},
					ClientConfig:             &apiextensionsv1.WebhookClientConfig{URL: &url, CABundle: caPEM},
				},
			}
		}
		if _, err := c.ApiextensionsV1().CustomResourceDefinitions().Update(ctx, crd, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("unable to update CRD %s: %w", crd.Name, err)
		}
	}
	return nil
}

// waitReady polls a manager's /readyz (which includes its webhook server)
// until it answers 200, failing early if the process exits.
func waitReady(ctx context.Context, p *Process, port int) error {
	url := fmt.Sprintf("http://127.0.0.1:%d/readyz", port)
	hc := &http.Client{Timeout: 5 * time.Second}
	return poll(ctx, managerReadyTimeout, func() (bool, error) {
		if exited, err := p.Exited(); exited {
			return false, &stopPolling{err: fmt.Errorf("exited before it was ready: %w; log:\n%s", err, tailFile(p.LogPath, logTailLines))}
		}
		resp, err := hc.Get(url)
		if err != nil {
			return false, err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return false, fmt.Errorf("%s answered %s", url, resp.Status)
		}
		return true, nil
	})
}

// installWebhooks creates the provider's mutating and validating webhook
// configurations from its manifests file, renamed after the provider, with
// every service reference replaced by https://127.0.0.1:port<path>.
func installWebhooks(ctx context.Context, cp *ControlPlane, file, provider string, port int, caPEM []byte) error {
	docs, err := yamlDocuments(file)
	if err != nil {
		return err
	}
	clientConfig := func(cc *admissionregistrationv1.WebhookClientConfig) error {
		if cc.Service == nil || cc.Service.Path == nil {
			return errors.New("webhook without a service path")
		}
		cc.URL = ptr.To(fmt.Sprintf("https://127.0.0.1:%d%s", port, *cc.Service.Path))
		cc.Service = nil
		cc.CABundle = caPEM
		return nil
	}
	for _, doc := range docs {
		var meta metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			return fmt.Errorf("unable to read %s: %w", file, err)
		}
		switch meta.Kind {
		case "MutatingWebhookConfiguration":
			w := &admissionregistrationv1.MutatingWebhookConfiguration{}
			if err := yaml.UnmarshalStrict(doc, w); err != nil {
				return fmt.Errorf("unable to decode %s: %w", file, err)
			}
			w.Name = provider + "-" + w.Name
			for i := range w.Webhooks {
				if err := clientConfig(&w.Webhooks[i].ClientConfig); err != nil {
					return fmt.Errorf("%s: %s: %w", file, w.Webhooks[i].Name, err)
				}
			}
			if _, err := cp.Client.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(ctx, w, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("unable to create MutatingWebhookConfiguration %s: %w", w.Name, err)
			}
		case "ValidatingWebhookConfiguration":
			w := &admissionregistrationv1.ValidatingWebhookConfiguration{}
			if err := yaml.UnmarshalStrict(doc, w); err != nil {
				return fmt.Errorf("unable to decode %s: %w", file, err)
			}
			w.Name = provider + "-" + w.Name
			for i := range w.Webhooks {
				if err := clientConfig(&w.Webhooks[i].ClientConfig); err != nil {
					return fmt.Errorf("%s: %s: %w", file, w.Webhooks[i].Name, err)
				}
			}
			if _, err := cp.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(ctx, w, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("unable to create ValidatingWebhookConfiguration %s: %w", w.Name, err)
			}
		default:
			return fmt.Errorf("%s: unexpected kind %q", file, meta.Kind)
		}
	}
	// The API server calls the webhooks over TLS; make sure the serving
	// certificate is the one it will be told to trust.
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	conn, err := tls.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port), &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"})
	if err != nil {
		return fmt.Errorf("webhook server on port %d does not serve the expected certificate: %w", port, err)
	}
	return conn.Close()
}
