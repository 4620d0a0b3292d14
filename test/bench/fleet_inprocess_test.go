package bench

import (
	"context"
	"crypto/ecdsa"
	"net"
	"sync"
	"testing"

	"k8s.io/client-go/rest"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	nodecredential "sigs.k8s.io/kubelet-authenticator/agent/credential"
	"sigs.k8s.io/kubelet-authenticator/agent/csr"
	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// runInProcessSide runs side through the controller (process signerPID)
// with every node's join in this process, c at a time (inProcessJoin): the
// node side then costs what kubelet's in-process bootstrap costs the
// kube-controller-manager sides, so both signers are measured at a load
// the nodes do not limit.
func runInProcessSide(b *testing.B, env *scenario.Env, signerPID int, side *fleetSide, nodes []*scenario.Node, c int) {
	b.Helper()
	ctx := context.Background()
	joins := make([]func(context.Context) error, len(nodes))
	for i, n := range nodes {
		joins[i] = inProcessJoiner(b, n)
	}
	stop := watchCSRs(b, env, side)
	requests := apiRequests(b, env)
	self, before, shared := selfCPU(b), procCPU(b, signerPID), readSharedCPU(b, env)
	runFleet(b, side, len(nodes), c, func(i int) error { return joins[i](ctx) })
	side.nodeCPU += selfCPU(b) - self
	side.signerCPU += procCPU(b, signerPID) - before
	side.shared.add(shared, readSharedCPU(b, env))
	side.addRequests(requests, apiRequests(b, env))
	stop()
}

// inProcessJoiner returns node n's join through its credential code in
// this process: what `kubelet-authenticator credential` does from an empty
// cache (the node's attestor, a key, the CSR with its evidence, the wait,
// the cache written) through Source.Obtain, with its bootstrap kubeconfig.
// Each join dials a TLS connection of its own and closes it after, as a new
// kubelet does and as kubeletJoin does for the baseline (a config with a
// Dial function is never shared through client-go's transport cache).
func inProcessJoiner(b *testing.B, n *scenario.Node) func(context.Context) error {
	b.Helper()
	cfg, err := config.Load(n.ConfigPath)
	if err != nil {
		b.Fatal(err)
	}
	cfg.Default()
	d, ok := providers.Lookup(cfg.Attestor)
	if !ok {
		b.Fatalf("node %s: no attestor %q", n.Name, cfg.Attestor)
	}
	section, err := cfg.ProviderSection(d)
	if err != nil {
		b.Fatal(err)
	}
	a, err := d.NewAttestor(section, providers.NodeEnv{})
	if err != nil {
		b.Fatal(err)
	}
	src := &nodecredential.Source{Config: cfg, Attestor: a}
	boot := restConfigFromFile(b, cfg.BootstrapKubeconfig)
	dir := cache.Dir{Path: cfg.CacheDir}
	return func(ctx context.Context) error {
		var (
			mu    sync.Mutex
			conns []net.Conn
		)
		restCfg := rest.CopyConfig(boot)
		restCfg.Dial = func(ctx context.Context, network, address string) (net.Conn, error) {
			conn, err := (&net.Dialer{}).DialContext(ctx, network, address)
			if err == nil {
				mu.Lock()
				conns = append(conns, conn)
				mu.Unlock()
			}
			return conn, err
		}
		defer func() {
			mu.Lock()
			defer mu.Unlock()
			for _, c := range conns {
				_ = c.Close()
			}
		}()
		return src.Obtain(ctx, restCfg, &nodecredential.Request{
			SignerName:     cfg.SignerName,
			Usages:         csr.ClientUsages,
			Lifetime:       cfg.CertificateLifetime.Duration,
			PKCS10:         func(key *ecdsa.PrivateKey) ([]byte, error) { return csr.PKCS10(key, cfg.NodeName, cfg.ProviderID) },
			PendingKeyFile: cache.PendingKeyFile,
			Store:          dir.Store,
		})
	}
}
