package capi

import (
	"strings"
	"testing"

	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
)

func TestRestoreHeld(t *testing.T) {
	authorized := ClusterPolicy{ClusterAttestationSpec: v1alpha1.ClusterAttestationSpec{AuthorizedAttestors: []string{"tpm"}}}
	locked := authorized
	locked.Lockdown = true
	for _, tc := range []struct {
		name   string
		paused bool
		annot  bool
		policy ClusterPolicy
		want   string
	}{
		{"lifted by its policy", false, false, authorized, ""},
		{"spec.paused", true, false, authorized, "paused"},
		{"paused annotation", false, true, authorized, "paused"},
		{"asks for lockdown again", false, false, locked, "asks for lockdown"},
		{"no policy", false, false, ClusterPolicy{}, "authorizes no attestor"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &clusterv1.Cluster{}
			c.Spec.Paused = &tc.paused
			if tc.annot {
				c.Annotations = map[string]string{clusterv1.PausedAnnotation: ""}
			}
			got := restoreHeld(c, tc.policy)
			if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
				t.Errorf("restoreHeld = %q, want %q", got, tc.want)
			}
		})
	}
}
