// Package azure is the Azure VM attestor, both halves.
//
// The node half (Attestor) asks the instance metadata service for the
// attested document with a nonce derived from the binding. The signer half
// (Verifier) checks the document's PKCS#7 signature, chains the signing
// certificate to configured roots (Microsoft's), requires it to be issued
// to the metadata service (metadata.azure.com by default), and checks the
// nonce, the createdOn/expiresOn window, an allowed subscription, and that
// the provider ID the CSR claims names the document's subscription.
//
// The attested document carries subscriptionId and vmId but neither the
// resource group nor the VM name; the signer's match of the provider ID
// against the Machine, and trust on first use of the vmId, cover those.
package azure

import (
	"encoding/hex"
	"time"
)

// Name is the provider name on the wire.
const Name = "azure"

// Evidence versions: the same document, bound by binding v1 (the CSR key)
// in VersionV1 and by binding v2 (the CSR key and the workload cluster's CA,
// attestor.ClusterBinding) in VersionV2. The node produces VersionV2 and
// VersionV1 for older signers; the signer accepts both.
const (
	VersionV1 = "v1"
	VersionV2 = "v2"
)

// clusterBound reports whether evidence of version commits to the cluster.
func clusterBound(version string) bool { return version == VersionV2 }

// Evidence is the Azure evidence document (version v1).
type Evidence struct {
	Version string `json:"version"`
	// Signature is the "signature" field of the IMDS attested document as
	// IMDS returned it: base64 of a DER PKCS#7 SignedData whose content is
	// the attested data.
	Signature string `json:"signature"`
}

// AttestedData is the signed content of the attested document.
type AttestedData struct {
	LicenseType string `json:"licenseType"`
	Nonce       string `json:"nonce"`
	Plan        struct {
		Name      string `json:"name"`
		Product   string `json:"product"`
		Publisher string `json:"publisher"`
	} `json:"plan"`
	SKU            string `json:"sku"`
	SubscriptionID string `json:"subscriptionId"`
	TimeStamp      struct {
		CreatedOn string `json:"createdOn"`
		ExpiresOn string `json:"expiresOn"`
	} `json:"timeStamp"`
	VMID string `json:"vmId"`
}

// TimeFormat is the layout of timeStamp.createdOn and expiresOn.
const TimeFormat = "01/02/06 15:04:05 -0700"

// Window parses the document's validity window.
func (d *AttestedData) Window() (createdOn, expiresOn time.Time, err error) {
	if createdOn, err = time.Parse(TimeFormat, d.TimeStamp.CreatedOn); err != nil {
		return
	}
	expiresOn, err = time.Parse(TimeFormat, d.TimeStamp.ExpiresOn)
	return
}

// Stable returns the TOFU identity: azure:<vmId>.
func (d *AttestedData) Stable() string { return Name + ":" + d.VMID }

// Nonce derives the IMDS nonce from the binding: the first 16 bytes in
// lower-case hex, 32 alphanumeric characters, the most IMDS accepts.
func Nonce(binding []byte) string {
	if len(binding) > 16 {
		binding = binding[:16]
	}
	return hex.EncodeToString(binding)
}
