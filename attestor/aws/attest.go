package aws

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/attestor/internal/metadata"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// DefaultIMDSEndpoint is the instance metadata service.
const DefaultIMDSEndpoint = "http://169.254.169.254"

// AttestorConfig configures the node half.
type AttestorConfig struct {
	// IMDSEndpoint is the base URL of the instance metadata service;
	// DefaultIMDSEndpoint when empty.
	IMDSEndpoint string `json:"imdsEndpoint,omitempty"`
	// STSEndpoint is the base URL the presigned request is made for; when
	// empty, the regional endpoint https://sts.<region>.amazonaws.com of the
	// instance's region. The verifier must allow its host.
	STSEndpoint string `json:"stsEndpoint,omitempty"`
	// STSRegion is the SigV4 signing region; the instance's region when
	// empty (use us-east-1 with the global endpoint sts.amazonaws.com).
	STSRegion string `json:"stsRegion,omitempty"`
	// PresignExpiry is X-Amz-Expires in seconds, at most MaxPresignExpiry;
	// MaxPresignExpiry when zero.
	PresignExpiry int `json:"presignExpiry,omitempty"`
}

// Attestor is the node half.
type Attestor struct {
	imds, sts     string
	stsRegion     string
	presignExpiry int
	client        *http.Client
	clock         clock.PassiveClock
}

// NewAttestor returns the node half.
func NewAttestor(cfg AttestorConfig) (*Attestor, error) {
	a := &Attestor{
		imds:          strings.TrimSuffix(cfg.IMDSEndpoint, "/"),
		sts:           strings.TrimSuffix(cfg.STSEndpoint, "/"),
		stsRegion:     cfg.STSRegion,
		presignExpiry: cfg.PresignExpiry,
		client:        &http.Client{Timeout: 10 * time.Second},
		clock:         clock.RealClock{},
	}
	if a.imds == "" {
		a.imds = DefaultIMDSEndpoint
	}
	var errs []error
	if _, err := url.Parse(a.imds); err != nil {
		errs = append(errs, fmt.Errorf("imdsEndpoint: %w", err))
	}
	if a.sts != "" {
		if u, err := url.Parse(a.sts); err != nil || u.Host == "" {
			errs = append(errs, fmt.Errorf("stsEndpoint %q is not an absolute URL", a.sts))
		}
	}
	switch {
	case a.presignExpiry == 0:
		a.presignExpiry = MaxPresignExpiry
	case a.presignExpiry < 0 || a.presignExpiry > MaxPresignExpiry:
		errs = append(errs, fmt.Errorf("presignExpiry must be between 1 and %d seconds", MaxPresignExpiry))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return a, nil
}

// Versions implements attestor.Attestor.
func (a *Attestor) Versions() []string { return []string{VersionV2, VersionV1} }

// Attest implements attestor.Attestor.
func (a *Attestor) Attest(ctx context.Context, req *attestor.Request) (*attestor.Attestation, error) {
	version := req.Newest(VersionV2, VersionV1)
	switch version {
	case VersionV1, VersionV2:
	default:
		return nil, fmt.Errorf("aws attestor cannot produce evidence version %q", req.Version)
	}
	binding, err := req.BindingFor(clusterBound(version))
	if err != nil {
		return nil, fmt.Errorf("aws attestor cannot produce evidence version %s: %w", version, err)
	}
	token, err := a.imdsToken(ctx)
	if err != nil {
		return nil, err
	}
	doc, err := a.imdsGet(ctx, token, "/latest/dynamic/instance-identity/document")
	if err != nil {
		return nil, err
	}
	var iid InstanceIdentityDocument
	if err := attestor.DecodeDocument(doc, &iid, "the instance identity document"); err != nil {
		return nil, fmt.Errorf("IMDS returned an identity document the signer would refuse: %w", err)
	}
	sigB64, err := a.imdsGet(ctx, token, "/latest/dynamic/instance-identity/rsa2048")
	if err != nil {
		return nil, err
	}
	p7, err := base64.StdEncoding.DecodeString(string(bytes.Join(bytes.Fields(sigB64), nil)))
	if err != nil {
		return nil, fmt.Errorf("unable to decode the rsa2048 signature: %w", err)
	}
	creds, err := a.roleCredentials(ctx, token)
	if err != nil {
		return nil, err
	}
	presigned, err := a.presign(iid.Region, creds, binding)
	if err != nil {
		return nil, err
	}
	return attestor.Encode(version, Evidence{Version: version, Document: doc, RSA2048: p7, STS: *presigned})
}

func (a *Attestor) presign(region string, creds credentials, binding []byte) (*PresignedRequest, error) {
	endpoint, signRegion := a.sts, a.stsRegion
	if endpoint == "" {
		if region == "" {
			return nil, errors.New("the instance identity document names no region")
		}
		endpoint = "https://sts." + region + ".amazonaws.com"
	}
	if signRegion == "" {
		signRegion = region
	}
	u, err := url.Parse(endpoint + "/")
	if err != nil {
		return nil, fmt.Errorf("invalid STS endpoint: %w", err)
	}
	u.RawQuery = url.Values{"Action": {"GetCallerIdentity"}, "Version": {"2011-06-15"}}.Encode()
	headers := map[string]string{BindingHeader: bindingHex(binding)}
	signed := presignURL(u, headers, creds, signRegion, stsService, a.clock.Now(), a.presignExpiry, emptyBodySHA256)
	return &PresignedRequest{URL: signed, Headers: headers}, nil
}

func (a *Attestor) imdsToken(ctx context.Context) (string, error) {
	body, err := metadata.Get(ctx, a.client, http.MethodPut, a.imds+"/latest/api/token",
		map[string]string{"X-aws-ec2-metadata-token-ttl-seconds": "60"}, 1<<10)
	if err != nil {
		return "", fmt.Errorf("unable to get an IMDSv2 session token: %w", err)
	}
	return strings.TrimSpace(string(body)), nil
}

func (a *Attestor) imdsGet(ctx context.Context, token, path string) ([]byte, error) {
	body, err := metadata.Get(ctx, a.client, http.MethodGet, a.imds+path,
		map[string]string{"X-aws-ec2-metadata-token": token}, 1<<20)
	if err != nil {
		return nil, fmt.Errorf("unable to read %s from IMDS: %w", path, err)
	}
	return body, nil
}

func (a *Attestor) roleCredentials(ctx context.Context, token string) (credentials, error) {
	const base = "/latest/meta-data/iam/security-credentials/"
	list, err := a.imdsGet(ctx, token, base)
	if err != nil {
		return credentials{}, fmt.Errorf("the instance has no instance profile role: %w", err)
	}
	sc := bufio.NewScanner(bytes.NewReader(list))
	role := ""
	if sc.Scan() {
		role = strings.TrimSpace(sc.Text())
	}
	if role == "" || strings.ContainsAny(role, "/?#") {
		return credentials{}, fmt.Errorf("IMDS returned no usable instance profile role name (%q)", role)
	}
	body, err := a.imdsGet(ctx, token, base+role)
	if err != nil {
		return credentials{}, err
	}
	var c struct {
		Code            string
		AccessKeyID     string `json:"AccessKeyId"`
		SecretAccessKey string
		Token           string
	}
	if err := json.Unmarshal(body, &c); err != nil {
		return credentials{}, fmt.Errorf("unable to parse role credentials: %w", err)
	}
	if c.Code != "" && c.Code != "Success" {
		return credentials{}, fmt.Errorf("IMDS role credentials not available: %s", c.Code)
	}
	if c.AccessKeyID == "" || c.SecretAccessKey == "" {
		return credentials{}, errors.New("IMDS returned empty role credentials")
	}
	return credentials{AccessKeyID: c.AccessKeyID, SecretAccessKey: c.SecretAccessKey, SessionToken: c.Token}, nil
}
