//go:build ignore

// hermetic-pod-signer runs the upstream test signer of pod certificates,
// k8s.io/kubernetes test/utils/hermeticpodcertificatesigner, against a
// cluster: it issues a certificate for every PodCertificateRequest of
// --signer-name and checks nothing (no policy, no node, no key type). It is
// the baseline of make bench-signer's pod certificate benchmark.
//
// The signer is used as upstream writes it: New(...).Run with one worker
// (its design), a CA hierarchy of GenerateCAHierarchy without
// intermediates (the shortest chain). Only its client is set here: the
// kubeconfig's client gets --kube-api-qps and --kube-api-burst instead of
// client-go's default 5 QPS, so the rate limit is never what holds it back.
//
// It is built outside the project's module, against the same Kubernetes
// release as the other test binaries, by test/tools/install-hermetic-pod-signer.sh.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/utils/hermeticpodcertificatesigner"
	"k8s.io/utils/clock"
)

func main() {
	klog.InitFlags(nil)
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of an identity allowed to sign for --signer-name")
	signerName := flag.String("signer-name", "", "signer name of the PodCertificateRequests to issue")
	qps := flag.Float64("kube-api-qps", 1000, "client QPS")
	burst := flag.Int("kube-api-burst", 2000, "client burst")
	flag.Parse()
	if err := run(*kubeconfig, *signerName, float32(*qps), *burst); err != nil {
		fmt.Fprintln(os.Stderr, "hermetic-pod-signer:", err)
		os.Exit(1)
	}
}

func run(kubeconfig, signerName string, qps float32, burst int) error {
	if kubeconfig == "" || signerName == "" {
		return fmt.Errorf("--kubeconfig and --signer-name are required")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("unable to read %s: %w", kubeconfig, err)
	}
	cfg.QPS, cfg.Burst = qps, burst
	kc, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	keys, certs, err := hermeticpodcertificatesigner.GenerateCAHierarchy(0)
	if err != nil {
		return fmt.Errorf("unable to make the CA: %w", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	klog.InfoS("Serving pod certificates", "signerName", signerName)
	hermeticpodcertificatesigner.New(clock.RealClock{}, signerName, keys, certs, kc).Run(ctx)
	return nil
}
