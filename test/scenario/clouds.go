package scenario

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/test/emulators/aws"
	"sigs.k8s.io/kubelet-authenticator/test/emulators/azure"
	"sigs.k8s.io/kubelet-authenticator/test/emulators/gcp"
)

// Clouds are one machine at each cloud provider, emulated on 127.0.0.1
// (test/emulators), and the controller's --attestor-config file trusting
// them: the setup of the demo and the benchmarks. The end-to-end tests, with
// their rogue and foreign machines, set up their own.
type Clouds struct {
	AWS   *aws.Emulator
	Azure *azure.Emulator
	GCP   *gcp.Emulator
	// AttestorConfig is the path of the controller's --attestor-config.
	AttestorConfig string
}

// AzureResourceGroup is the resource group of the Azure VMs of CloudNode.
const AzureResourceGroup = "rg-fleet"

// StartClouds starts the emulators and writes the attestor configuration.
// A GCE instance's name is its node's name, so gcpNode names the node that
// will attest with gcp. Everything stops when the test ends.
func StartClouds(tb testing.TB, gcpNode string) *Clouds {
	tb.Helper()
	c := &Clouds{
		AWS:   aws.New(tb, aws.Instance{}),
		Azure: azure.New(tb, azure.VM{}),
		GCP:   gcp.New(tb, gcp.Instance{InstanceName: gcpNode}),
	}
	dir := tb.TempDir()
	write := func(name string, data []byte) string {
		tb.Helper()
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			tb.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o600); err != nil {
			tb.Fatal(err)
		}
		return p
	}
	write("aws-certs/"+c.AWS.Instance.Region+".pem", c.AWS.RegionCertPEM)
	cfg := fmt.Sprintf(`apiVersion: kubelet-authenticator.x-k8s.io/v1alpha1
kind: AttestorConfig
aws:
  accounts: [%q]
  allowedRoles: [%q]
  certificatesDir: %s
  sts:
    hosts: [%q]
    tls:
      trustedCA:
        file: %s
azure:
  roots: [%s]
  intermediates: [%s]
  subscriptions: [%q]
gcp:
  projects: [%q]
  jwks:
    url: %s
    tls:
      trustedCA:
        file: %s
`, c.AWS.Instance.AccountID, c.AWS.Instance.Role, filepath.Join(dir, "aws-certs"), c.AWS.STSHost, write("sts-ca.pem", c.AWS.STSCAPEM),
		write("azure-root.pem", c.Azure.Root.PEM), write("azure-issuing.pem", c.Azure.Issuing.PEM), c.Azure.VM.SubscriptionID,
		c.GCP.Instance.ProjectID, c.GCP.JWKSURL, write("jwks-ca.pem", c.GCP.JWKSCAPEM))
	c.AttestorConfig = write("attestors.yaml", []byte(cfg))
	return c
}

// CloudNode writes the node name attesting with provider ("aws", "azure" or
// "gcp") against its emulator (NewNode with extraConfig appended). The
// node's config claims no provider ID where the node derives it from the
// metadata service (aws, gcp); the returned Node's ProviderID is the one its
// Machine carries either way, so Machine creates the right Machine.
func (e *Env) CloudNode(tb testing.TB, c *Clouds, name, provider string, extraConfig ...string) *Node {
	tb.Helper()
	var claimed, machine, cfg string
	switch provider {
	case "aws":
		machine = "aws:///" + c.AWS.Instance.AvailabilityZone + "/" + c.AWS.Instance.InstanceID
		cfg = fmt.Sprintf("aws:\n  imdsEndpoint: %s\n  stsEndpoint: %s\n", c.AWS.IMDSURL, c.AWS.STSURL)
	case "azure":
		claimed = "azure:///subscriptions/" + c.Azure.VM.SubscriptionID + "/resourceGroups/" + AzureResourceGroup +
			"/providers/Microsoft.Compute/virtualMachines/" + name
		machine = claimed
		cfg = fmt.Sprintf("azure:\n  imdsEndpoint: %s\n", c.Azure.URL)
	case "gcp":
		if name != c.GCP.Instance.InstanceName {
			tb.Fatalf("gcp node %s: the emulated instance is %s", name, c.GCP.Instance.InstanceName)
		}
		machine = "gce://" + c.GCP.Instance.ProjectID + "/" + c.GCP.Instance.Zone + "/" + name
		cfg = fmt.Sprintf("gcp:\n  metadataEndpoint: %s\n", c.GCP.MetadataURL)
	default:
		tb.Fatalf("no emulator for attestor %q", provider)
	}
	n := e.NewNode(tb, name, claimed, provider, append([]string{cfg}, extraConfig...)...)
	n.ProviderID = machine
	return n
}
