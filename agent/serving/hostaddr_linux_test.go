package serving

import (
	"testing"

	utilnet "k8s.io/apimachinery/pkg/util/net"
)

// TestDefaultRouteAddressAgreesWithKubelet: where kubelet's own choice
// (ChooseHostInterface, from /proc/net/route) works, the netlink discovery
// picks the same address, so that the serving certificate names the
// address kubelet reports as InternalIP. The unit's sandbox, where only
// the netlink discovery works, is tested in systemd/.
func TestDefaultRouteAddressAgreesWithKubelet(t *testing.T) {
	want, err := utilnet.ChooseHostInterface()
	if err != nil {
		t.Skipf("kubelet's discovery finds no address on this machine: %v", err)
	}
	got, err := DefaultRouteAddress()
	if err != nil {
		t.Fatal(err)
	}
	if !got.Equal(want) {
		t.Fatalf("discovered %s, kubelet picks %s", got, want)
	}
	t.Logf("discovered %s", got)
}
