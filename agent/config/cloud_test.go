package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCloudSections(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(path, []byte(`apiVersion: kubelet-authenticator.x-k8s.io/v1alpha1
kind: NodeConfig
nodeName: ip-10-0-0-10.ec2.internal
attestor: aws
cacheDir: /var/lib/ka
aws:
  imdsEndpoint: http://127.0.0.1:8080
  stsEndpoint: https://sts.amazonaws.com
  stsRegion: us-east-1
  presignExpiry: 30
gcp:
  metadataEndpoint: http://127.0.0.1:8081
`), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	c.Default()
	if err := c.Validate(); err != nil {
		t.Fatalf("valid aws config (providerID derived): %v", err)
	}
	if c.AWS.STSRegion != "us-east-1" || c.AWS.PresignExpiry != 30 || c.GCP.MetadataEndpoint != "http://127.0.0.1:8081" {
		t.Fatalf("sections not read: %+v %+v", c.AWS, c.GCP)
	}

	// Every problem at once: the selected provider's, another set
	// section's, and Azure's provider ID, which the node cannot derive.
	c.Attestor = "azure"
	c.AWS.PresignExpiry = 600
	c.AWS.STSEndpoint = "sts.amazonaws.com"
	c.GCP.MetadataEndpoint = "metadata"
	c.Azure.IMDSEndpoint = "169.254.169.254"
	err = c.Validate()
	if err == nil {
		t.Fatal("invalid cloud sections accepted")
	}
	for _, want := range []string{
		"aws: presignExpiry",
		"aws: stsEndpoint",
		"gcp: metadataEndpoint",
		"azure: imdsEndpoint",
		"providerID is required with attestor azure",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not report %q:\n%v", want, err)
		}
	}
}
