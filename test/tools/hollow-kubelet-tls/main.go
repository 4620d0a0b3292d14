//go:build ignore

// hollow-kubelet-tls runs kubemark's hollow kubelet (k8s.io/kubernetes
// pkg/kubemark: a real kubelet with a fake container runtime, cAdvisor and
// container manager) with kubelet's serving TLS options set, which kubemark
// itself never sets (it passes TLSOptions nil, so its kubelet server speaks
// plain HTTP). With --tls-cert-file and --tls-private-key-file, the server
// takes its certificate exactly as kubelet does with tlsCertFile and
// tlsPrivateKeyFile: through kubelet's file-based certificate manager, which
// reloads the files when they change (ReloadKubeletServerCertificateFile).
// Without them it serves plain HTTP, as kubemark does.
//
// --feature-gates sets kubelet's feature gates in this process (for example
// PodCertificateRequest=true, which starts kubelet's pod certificate manager
// behind the podCertificate projected volume): the hollow kubelet never
// reads the feature gates of its configuration, which a real kubelet
// applies at startup. --root-dir sets kubelet's root directory (pods'
// volumes are written under <root-dir>/pods/<uid>/volumes), a new
// temporary directory when empty.
//
// It is built outside the project's module, against the same Kubernetes
// release as the other test binaries, by test/tools/install-hollow-kubelet-tls.sh.
package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/trace/noop"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	clientset "k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	remote "k8s.io/cri-client/pkg"
	fakeremote "k8s.io/cri-client/pkg/fake"
	"k8s.io/klog/v2"
	cadvisortest "k8s.io/kubernetes/pkg/kubelet/cadvisor/testing"
	"k8s.io/kubernetes/pkg/kubelet/cm"
	"k8s.io/kubernetes/pkg/kubelet/server"
	"k8s.io/kubernetes/pkg/kubemark"
)

type options struct {
	kubeconfig, name, certFile, keyFile, featureGates, rootDir string
	port, readOnlyPort                                         int
}

func main() {
	var o options
	klog.InitFlags(nil)
	flag.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig of the node")
	flag.StringVar(&o.name, "name", "", "node name")
	flag.IntVar(&o.port, "kubelet-port", 10250, "port of the kubelet server (HTTPS with --tls-cert-file)")
	flag.IntVar(&o.readOnlyPort, "kubelet-read-only-port", 0, "read-only HTTP port (0: none)")
	flag.StringVar(&o.certFile, "tls-cert-file", "", "kubelet tlsCertFile (none: plain HTTP)")
	flag.StringVar(&o.keyFile, "tls-private-key-file", "", "kubelet tlsPrivateKeyFile (with --tls-cert-file)")
	flag.StringVar(&o.featureGates, "feature-gates", "", "kubelet feature gates, key=value pairs separated by commas")
	flag.StringVar(&o.rootDir, "root-dir", "", "kubelet root directory (none: a new temporary directory)")
	flag.Parse()
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "hollow-kubelet-tls:", err)
		os.Exit(1)
	}
}

func run(o options) error {
	kubeconfig, name, certFile, keyFile := o.kubeconfig, o.name, o.certFile, o.keyFile
	if kubeconfig == "" || name == "" || (certFile == "") != (keyFile == "") {
		return fmt.Errorf("--kubeconfig and --name are required, --tls-cert-file and --tls-private-key-file go together")
	}
	// What a real kubelet does with its configuration's featureGates, before
	// anything reads a gate.
	if err := utilfeature.DefaultMutableFeatureGate.Set(o.featureGates); err != nil {
		return fmt.Errorf("--feature-gates: %w", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	restCfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	restCfg.UserAgent = "hollow-kubelet-tls"
	client, err := clientset.NewForConfig(restCfg)
	if err != nil {
		return err
	}
	flags, cfg := kubemark.GetHollowKubeletConfig(&kubemark.HollowKubeletOptions{
		NodeName: name, KubeletPort: o.port, KubeletReadOnlyPort: o.readOnlyPort, MaxPods: 110,
	})
	cfg.TLSCertFile, cfg.TLSPrivateKeyFile = certFile, keyFile
	if o.rootDir != "" {
		flags.RootDirectory = o.rootDir
	}
	hb := *restCfg
	hb.Timeout = cfg.NodeStatusUpdateFrequency.Duration
	hb.QPS = -1
	heartbeat, err := clientset.NewForConfig(&hb)
	if err != nil {
		return err
	}

	endpoint, err := fakeremote.GenerateEndpoint()
	if err != nil {
		return err
	}
	runtime := fakeremote.NewFakeRemoteRuntime()
	if err := runtime.Start(endpoint); err != nil {
		return err
	}
	defer runtime.Stop()
	runtimeService, err := remote.NewRemoteRuntimeService(ctx, endpoint, 15*time.Second, noop.NewTracerProvider(), false)
	if err != nil {
		return err
	}

	hk := kubemark.NewHollowKubelet(flags, cfg, client, heartbeat, &cadvisortest.Fake{NodeName: name},
		runtime.ImageService, runtimeService, cm.NewStubContainerManager())
	// What kubelet's InitializeTLS makes of tlsCertFile and
	// tlsPrivateKeyFile; kubemark leaves it nil.
	if certFile != "" {
		hk.KubeletDeps.TLSOptions = &server.TLSOptions{MinVersion: tls.VersionTLS12, CertFile: certFile, KeyFile: keyFile}
	}
	go hk.Run(ctx)
	<-ctx.Done()
	return nil
}
