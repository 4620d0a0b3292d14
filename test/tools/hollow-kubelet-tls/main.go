//go:build ignore

// hollow-kubelet-tls runs kubemark's hollow kubelet (k8s.io/kubernetes
// pkg/kubemark: a real kubelet with a fake container runtime, cAdvisor and
// container manager) with kubelet's serving TLS options set, which kubemark
// itself never sets (it passes TLSOptions nil, so its kubelet server speaks
// plain HTTP). With --tls-cert-file and --tls-private-key-file, the server
// takes its certificate exactly as kubelet does with tlsCertFile and
// tlsPrivateKeyFile: through kubelet's file-based certificate manager, which
// reloads the files when they change (ReloadKubeletServerCertificateFile).
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

func main() {
	var (
		kubeconfig, name, certFile, keyFile string
		port, readOnlyPort                  int
	)
	klog.InitFlags(nil)
	flag.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig of the node")
	flag.StringVar(&name, "name", "", "node name")
	flag.IntVar(&port, "kubelet-port", 10250, "HTTPS port of the kubelet server")
	flag.IntVar(&readOnlyPort, "kubelet-read-only-port", 0, "read-only HTTP port (0: none)")
	flag.StringVar(&certFile, "tls-cert-file", "", "kubelet tlsCertFile (required)")
	flag.StringVar(&keyFile, "tls-private-key-file", "", "kubelet tlsPrivateKeyFile (required)")
	flag.Parse()
	if err := run(kubeconfig, name, certFile, keyFile, port, readOnlyPort); err != nil {
		fmt.Fprintln(os.Stderr, "hollow-kubelet-tls:", err)
		os.Exit(1)
	}
}

func run(kubeconfig, name, certFile, keyFile string, port, readOnlyPort int) error {
	if kubeconfig == "" || name == "" || certFile == "" || keyFile == "" {
		return fmt.Errorf("--kubeconfig, --name, --tls-cert-file and --tls-private-key-file are required")
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
		NodeName: name, KubeletPort: port, KubeletReadOnlyPort: readOnlyPort, MaxPods: 110,
	})
	cfg.TLSCertFile, cfg.TLSPrivateKeyFile = certFile, keyFile
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
	hk.KubeletDeps.TLSOptions = &server.TLSOptions{MinVersion: tls.VersionTLS12, CertFile: certFile, KeyFile: keyFile}
	go hk.Run(ctx)
	<-ctx.Done()
	return nil
}
