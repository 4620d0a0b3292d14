package app

import (
	"testing"

	"github.com/spf13/pflag"
)

// TestStandaloneFlags: standalone mode takes the controller's own flags and
// its own, but none that configures what only Cluster API mode has.
func TestStandaloneFlags(t *testing.T) {
	fs := NewStandaloneCommand().Flags()
	for _, name := range []string{"kubeconfig", "leader-elect", "max-client-certificate-lifetime", "tpm-challenge-ttl",
		"challenge-key-rotation-interval", "attestor-config", "metrics-bind-address", "ca-secret", "allowlist-configmap", "authorized-attestors"} {
		if fs.Lookup(name) == nil {
			t.Errorf("standalone has no --%s", name)
		}
	}
	fs.VisitAll(func(f *pflag.Flag) {
		if clusterAPIOnly(f.Name) {
			t.Errorf("standalone takes --%s, which only Cluster API mode uses", f.Name)
		}
	})
	if fs.Lookup("workload-client-qps") != nil || fs.Lookup("lockdown-period") != nil {
		t.Error("standalone takes Cluster API mode's flags")
	}
}
