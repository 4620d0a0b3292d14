package engine

import (
	"bytes"
	"encoding/base64"
	"strconv"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// TestSealNamesTheCluster: a challenge and its seal copied onto a request
// of another Cluster (same UID and signer name: a tenant's own API server
// chooses UIDs) do not open there; a seal of an earlier release, which
// named no Cluster, closes its request ChallengeExpired so that the node
// files anew on its own.
func TestSealNamesTheCluster(t *testing.T) {
	key := bytes.Repeat([]byte{7}, 32)
	now := time.Unix(1_800_000_000, 0)
	expires := now.Add(time.Minute)
	data := []byte(`{"version":"v1"}`)
	const uid, signer = "csr-uid", "cluster.x-k8s.io/kube-apiserver-client-kubelet-tpm"
	engine := func(clusterUID string) *Engine {
		return &Engine{cfg: Config{ClusterUID: clusterUID, MaxChallengeTTL: time.Hour, Now: func() time.Time { return now }},
			keys: attestor.StaticChallengeKey(key)}
	}
	csr := func(seal string) *certificatesv1.CertificateSigningRequest {
		return &certificatesv1.CertificateSigningRequest{
			ObjectMeta: metav1.ObjectMeta{Name: "first", UID: uid, Annotations: map[string]string{
				attestor.AnnotationChallenge: string(data), attestor.AnnotationChallengeSeal: seal}},
			Spec: certificatesv1.CertificateSigningRequestSpec{SignerName: signer},
		}
	}
	victim := seal(attestor.LegacyChallengeKeyID, key, "cluster-victim", uid, signer, expires, data)
	for _, tc := range []struct {
		name, cluster, seal string
		want                Outcome
		reason              string
	}{
		{"own cluster", "cluster-victim", victim, Wait, ""},
		{"copied into another cluster", "cluster-copier", victim, Deny, attestor.ReasonMalformedChallenge},
		{"earlier release's seal", "cluster-victim", "v1." + sealExp(expires) + "." + b64(legacySealMAC(key, uid, signer, sealExp(expires), data)), Deny, attestor.ReasonChallengeExpired},
		{"earlier release's seal, forged", "cluster-victim", "v1." + sealExp(expires) + ".AAAA", Deny, attestor.ReasonMalformedChallenge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, ok := engine(tc.cluster).challengeGuard(&Decision{}, csr(tc.seal))
			if !ok || d.Outcome != tc.want || d.Reason != tc.reason {
				t.Fatalf("challengeGuard = %v %v %q (%s), want %v %q", ok, d.Outcome, d.Reason, d.Message, tc.want, tc.reason)
			}
		})
	}
}

func sealExp(t time.Time) string { return strconv.FormatInt(t.Unix(), 10) }

func b64(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }
