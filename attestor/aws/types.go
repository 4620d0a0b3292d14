// Package aws is the AWS EC2 attestor, both halves.
//
// The node half (Attestor) reads, through IMDSv2, the instance identity
// document and its rsa2048 PKCS#7 signature, and presigns an STS
// GetCallerIdentity request with the instance role's credentials whose
// signed headers carry the binding. The signer half (Verifier) checks the
// PKCS#7 against AWS's regional rsa2048 certificates, checks the presigned
// request (host allowlist, expiry of at most 60 seconds, binding header),
// replays it against STS and requires the answering role session to be the
// instance named by the document, in an allowed account.
//
// The identity document alone is the same every time it is read and anyone
// who once saw it can replay it; the presigned request is what makes the
// evidence fresh and bound to the CSR key, and it can only be made with the
// instance role's credentials.
package aws

import "encoding/hex"

// Name is the provider name on the wire.
const Name = "aws"

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

// BindingHeader is the request header, signed into the presigned STS
// request, that carries hex(binding).
const BindingHeader = "x-kubelet-authenticator-binding"

// MaxPresignExpiry is the longest X-Amz-Expires a verifier accepts, in
// seconds.
const MaxPresignExpiry = 60

// Evidence is the AWS evidence document (version v1).
type Evidence struct {
	Version string `json:"version"`
	// Document is the instance identity document, byte for byte as IMDS
	// returned it (base64 in JSON).
	Document []byte `json:"document"`
	// RSA2048 is the DER PKCS#7 SignedData from
	// /latest/dynamic/instance-identity/rsa2048 (base64 in JSON). Its
	// content is the document.
	RSA2048 []byte `json:"rsa2048"`
	// STS is the presigned GetCallerIdentity request.
	STS PresignedRequest `json:"sts"`
}

// PresignedRequest is a SigV4 query-presigned HTTPS GET.
type PresignedRequest struct {
	// URL is the full presigned URL.
	URL string `json:"url"`
	// Headers are the signed headers other than host, lower-case names:
	// exactly BindingHeader.
	Headers map[string]string `json:"headers"`
}

// InstanceIdentityDocument holds the fields of the instance identity
// document the attestor uses.
type InstanceIdentityDocument struct {
	AccountID        string `json:"accountId"`
	AvailabilityZone string `json:"availabilityZone"`
	InstanceID       string `json:"instanceId"`
	Region           string `json:"region"`
	InstanceType     string `json:"instanceType"`
	ImageID          string `json:"imageId"`
	PendingTime      string `json:"pendingTime"`
}

// ProviderID returns the Kubernetes provider ID of the instance:
// aws:///<availability zone>/<instance ID>.
func (d *InstanceIdentityDocument) ProviderID() string {
	return "aws:///" + d.AvailabilityZone + "/" + d.InstanceID
}

// Stable returns the TOFU identity: aws:<account>:<instance ID>.
func (d *InstanceIdentityDocument) Stable() string {
	return Name + ":" + d.AccountID + ":" + d.InstanceID
}

func bindingHex(b []byte) string { return hex.EncodeToString(b) }
