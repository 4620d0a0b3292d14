package bench

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/textlogger"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// Sizes of the signer benchmarks.
const (
	// signerPendingCSRs is how many CSRs wait for the controller when it
	// starts (one per Machine).
	signerPendingCSRs = 500
	// signerFleetMachines is how many Machines the management cluster
	// holds when the controller's memory is measured.
	signerFleetMachines = 10000
	// signerCreateWorkers create objects concurrently.
	signerCreateWorkers = 32
	signerNamespace     = "bench"
	signerClusterName   = "wl"
)

// BenchmarkSignerThroughput measures how many attested CSRs one controller
// verifies, approves and signs per second: signerPendingCSRs insecure-
// attested CSRs of as many Machines wait in a workload cluster, the
// controller starts, and the clock runs until the last one is issued.
//
//   - node-attestation-controller: the release binary's code as a process with
//     its default flags (app.DefaultWorkersPerCluster workers, the workload
//     client at app.DefaultWorkloadClientQPS: each CSR costs three requests,
//     approval, a fresh read and the certificate);
//   - node-attestation-controller-unthrottled: the same controller in
//     process, with the workload client's rate limit lifted, to show what
//     verification and signing themselves cost;
//   - kcm-csrsigning: the baseline, kube-controller-manager's csrsigning
//     signing as many CSRs already approved (kubernetes.io/kube-apiserver-client,
//     one write each, default --kube-api-qps 50) on the same API server.
//
// It reports CSRs per second from start to the last certificate (csrs/s,
// startup and cache sync included) and from the first certificate to the
// last (csrs/s-steady).
func BenchmarkSignerThroughput(b *testing.B) {
	bin := scenario.Binaries(b)
	mgmt := harness.StartManagement(b)
	wl := harness.StartControlPlane(b, "workload")
	mgmt.AddWorkloadCluster(b, signerNamespace, signerClusterName, wl, map[string]string{
		scenario.AnnotationEnabled:   "true",
		scenario.AnnotationAttestors: "insecure",
	})
	start := time.Now()
	signerCreateMachines(b, mgmt, signerPendingCSRs)
	infra := make([]string, signerPendingCSRs)
	for i := range infra {
		infra[i] = signerMachineName(i)
	}
	mgmt.ServeInfrastructure(b, signerNamespace, infra...)
	b.Logf("%d Machines and their DockerMachines created in %s", signerPendingCSRs, time.Since(start).Round(time.Millisecond))
	bootstrap := signerBootstrapClient(b, wl)
	ctx := context.Background()

	b.Run("node-attestation-controller", func(b *testing.B) {
		for b.Loop() {
			names := signerFileCSRs(b, bootstrap, "bin", signerPendingCSRs)
			dir := b.TempDir()
			t0 := time.Now()
			p := harness.StartProcess(b, "node-attestation-controller", filepath.Join(dir, "controller.log"),
				filepath.Join(bin, "node-attestation-controller"), signerControllerArgs(mgmt, "0")...)
			first, last := signerWaitIssued(b, wl.Client, names)
			signerReport(b, len(names), t0, first, last)
			p.Stop(10 * time.Second)
			signerDeleteCSRs(b, wl.Client)
		}
	})

	b.Run("node-attestation-controller-unthrottled", func(b *testing.B) {
		for b.Loop() {
			names := signerFileCSRs(b, bootstrap, "inproc", signerPendingCSRs)
			logFile, err := os.Create(filepath.Join(b.TempDir(), "controller.log"))
			if err != nil {
				b.Fatal(err)
			}
			o := app.NewOptions()
			o.RESTConfig = rest.CopyConfig(mgmt.AdminConfig)
			// Complete applies the management client's limit from these.
			o.KubeAPIQPS, o.KubeAPIBurst = 1000, 2000
			o.LeaderElect = false
			o.LeaderElectionNamespace = metav1.NamespaceDefault
			o.MetricsBindAddress, o.HealthProbeBindAddress = "0", "0"
			o.SkipControllerNameValidation = true
			o.WorkloadRESTConfig = func(c *rest.Config) { c.QPS, c.Burst = 1000, 2000 }
			if err := o.Complete(); err != nil {
				b.Fatal(err)
			}
			if err := o.Validate(); err != nil {
				b.Fatal(err)
			}
			// The workload controllers log through klog's global logger
			// (the manager's context does not carry this one).
			logger := textlogger.NewLogger(textlogger.NewConfig(textlogger.Output(logFile)))
			klog.SetLogger(logger)
			rctx, cancel := context.WithCancel(klog.NewContext(ctx, logger))
			done := make(chan error, 1)
			t0 := time.Now()
			go func() { done <- o.Run(rctx) }()
			first, last := signerWaitIssued(b, wl.Client, names)
			signerReport(b, len(names), t0, first, last)
			cancel()
			if err := <-done; err != nil {
				b.Errorf("controller: %v", err)
			}
			klog.ClearLogger()
			logFile.Close()
			signerDeleteCSRs(b, wl.Client)
		}
	})

	b.Run("kcm-csrsigning", func(b *testing.B) {
		for b.Loop() {
			names := signerFileApprovedCSRs(b, wl.Client)
			t0 := time.Now()
			p := wl.StartControllerManager(b, "csrsigning")
			first, last := signerWaitIssued(b, wl.Client, names)
			signerReport(b, len(names), t0, first, last)
			p.Stop(10 * time.Second)
			signerDeleteCSRs(b, wl.Client)
		}
	})
}

// BenchmarkSignerMemory measures the controller process's resident memory
// with no Machine and with signerFleetMachines Machines in the management
// cluster (all of one opted-in Cluster, bootstrapped, with an address), once
// its caches have synced and it serves the workload cluster. It reports the
// resident set (VmRSS) and its peak (VmHWM) of each run, and the growth per
// Machine.
func BenchmarkSignerMemory(b *testing.B) {
	bin := scenario.Binaries(b)
	mgmt := harness.StartManagement(b)
	wl := harness.StartControlPlane(b, "workload")
	mgmt.AddWorkloadCluster(b, signerNamespace, signerClusterName, wl, map[string]string{
		scenario.AnnotationEnabled:   "true",
		scenario.AnnotationAttestors: "insecure",
	})
	bootstrap := signerBootstrapClient(b, wl)
	for b.Loop() {
		empty := signerMeasureRSS(b, mgmt, bin, nil)
		start := time.Now()
		signerCreateMachines(b, mgmt, signerFleetMachines)
		infra := make([]string, signerFleetMachines)
		for i := range infra {
			infra[i] = signerMachineName(i)
		}
		mgmt.ServeInfrastructure(b, signerNamespace, infra...)
		took := time.Since(start)
		b.Logf("%d Machines and their DockerMachines created in %s (%.0f/s)", signerFleetMachines, took.Round(time.Millisecond), signerFleetMachines/took.Seconds())
		// One decision starts the cache of the infrastructure objects'
		// metadata, which then holds all of them.
		full := signerMeasureRSS(b, mgmt, bin, func() {
			signerWaitIssued(b, wl.Client, signerFileCSRs(b, bootstrap, "mem", 1))
		})
		b.ReportMetric(float64(empty.rss)/1024, "MiB/rss-0-machines")
		b.ReportMetric(float64(empty.hwm)/1024, "MiB/hwm-0-machines")
		b.ReportMetric(float64(full.rss)/1024, "MiB/rss-10k-machines")
		b.ReportMetric(float64(full.hwm)/1024, "MiB/hwm-10k-machines")
		b.ReportMetric(float64(full.rss-empty.rss)/signerFleetMachines, "KiB/machine")
		b.ReportMetric(empty.ready.Seconds(), "s/ready-0-machines")
		b.ReportMetric(full.ready.Seconds(), "s/ready-10k-machines")
	}
}

type signerMemory struct {
	rss, hwm int64 // KiB
	ready    time.Duration
}

// signerMeasureRSS starts the controller binary, waits until it serves the
// workload cluster (its caches of Clusters, Secrets and Machines have
// synced, and the cluster's CSRs are listed), lets it settle, and reads its
// VmRSS and VmHWM.
func signerMeasureRSS(b *testing.B, mgmt *harness.Management, bin string, decide func()) signerMemory {
	b.Helper()
	port := harness.FreePort(b)
	t0 := time.Now()
	p := harness.StartProcess(b, "node-attestation-controller", filepath.Join(b.TempDir(), "controller.log"),
		filepath.Join(bin, "node-attestation-controller"), signerControllerArgs(mgmt, fmt.Sprintf("127.0.0.1:%d", port))...)
	defer p.Stop(10 * time.Second)
	synced := fmt.Sprintf(`kubelet_authenticator_signer_workload_cluster_synced{cluster="%s/%s"} 1`, signerNamespace, signerClusterName)
	harness.WaitFor(b, 3*time.Minute, func() (bool, error) {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
		if err != nil {
			return false, nil
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		return err == nil && strings.Contains(string(body), synced), nil
	})
	m := signerMemory{ready: time.Since(t0)}
	if decide != nil {
		decide()
	}
	time.Sleep(5 * time.Second) // let the first GC cycles after the lists run
	m.rss, m.hwm = signerProcStatus(b, p.PID())
	b.Logf("controller ready in %s: VmRSS %d KiB, VmHWM %d KiB", m.ready.Round(time.Millisecond), m.rss, m.hwm)
	return m
}

func signerProcStatus(b *testing.B, pid int) (rss, hwm int64) {
	b.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		k, v, ok := strings.Cut(s.Text(), ":")
		if !ok || (k != "VmRSS" && k != "VmHWM") {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			b.Fatalf("/proc/%d/status %s: %v", pid, k, err)
		}
		if k == "VmRSS" {
			rss = n
		} else {
			hwm = n
		}
	}
	if rss == 0 || hwm == 0 {
		b.Fatalf("no VmRSS or VmHWM in /proc/%d/status", pid)
	}
	return rss, hwm
}

// signerControllerArgs are the controller's flags: defaults but for the
// management kubeconfig, no leader election and the metrics address
// (plain HTTP, read by the benchmark without a token).
func signerControllerArgs(mgmt *harness.Management, metrics string) []string {
	return []string{
		"--kubeconfig=" + mgmt.AdminKubeconfig,
		"--leader-elect=false",
		"--leader-election-namespace=default", // also where the TPM attestor keeps its key
		"--metrics-bind-address=" + metrics,
		"--insecure-diagnostics",
		"--health-probe-bind-address=0",
	}
}

func signerReport(b *testing.B, n int, start, first, last time.Time) {
	b.Helper()
	total, steady := last.Sub(start), last.Sub(first)
	b.ReportMetric(float64(n)/total.Seconds(), "csrs/s")
	if steady > 0 {
		b.ReportMetric(float64(n-1)/steady.Seconds(), "csrs/s-steady")
	}
	b.ReportMetric(first.Sub(start).Seconds(), "s/first-issued")
	b.Logf("%d CSRs issued %s after start (first after %s)", n, total.Round(time.Millisecond), first.Sub(start).Round(time.Millisecond))
}

// signerMachineName and signerProviderID name Machine i.
func signerMachineName(i int) string { return fmt.Sprintf("node-%05d", i) }
func signerProviderID(i int) string  { return fmt.Sprintf("test:///bench/node-%05d", i) }

// signerCreateMachines creates Machines 0..n-1 of the benchmark Cluster.
func signerCreateMachines(b *testing.B, mgmt *harness.Management, n int) {
	b.Helper()
	createMachines(b, mgmt, signerNamespace, signerClusterName, n, signerMachineName, signerProviderID)
}

// createMachines creates Machines name(0..n-1) of Cluster ns/cluster
// concurrently, as harness.CreateMachine does (create, then the status:
// bootstrapped, the Machine's name as its one Hostname address), each with
// providerID(i).
func createMachines(b *testing.B, mgmt *harness.Management, ns, cluster string, n int, machineName, providerID func(int) string) {
	b.Helper()
	cfg := rest.CopyConfig(mgmt.AdminConfig)
	cfg.QPS, cfg.Burst = 2000, 4000
	scheme, err := harness.Scheme()
	if err != nil {
		b.Fatal(err)
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		b.Fatal(err)
	}
	signerParallel(b, n, func(ctx context.Context, i int) error {
		name := machineName(i)
		data := name + "-bootstrap"
		m := &clusterv1.Machine{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{clusterv1.ClusterNameLabel: cluster}},
			Spec: clusterv1.MachineSpec{
				ClusterName: cluster,
				ProviderID:  providerID(i),
				Bootstrap:   clusterv1.Bootstrap{DataSecretName: &data},
				InfrastructureRef: clusterv1.ContractVersionedObjectReference{
					APIGroup: clusterv1.GroupVersionInfrastructure.Group, Kind: "DockerMachine", Name: name,
				},
			},
		}
		if err := c.Create(ctx, m); err != nil {
			return fmt.Errorf("unable to create Machine %s: %w", name, err)
		}
		ready := true
		m.Status.Initialization.BootstrapDataSecretCreated = &ready
		m.Status.Conditions = []metav1.Condition{{
			Type: clusterv1.MachineBootstrapConfigReadyCondition, Status: metav1.ConditionTrue,
			Reason: clusterv1.MachineBootstrapDataSecretProvidedReason, LastTransitionTime: metav1.Now(),
		}}
		m.Status.Addresses = []clusterv1.MachineAddress{{Type: clusterv1.MachineHostName, Address: name}}
		if err := c.Status().Update(ctx, m); err != nil {
			return fmt.Errorf("unable to update the status of Machine %s: %w", name, err)
		}
		return nil
	})
}

// signerParallel runs f(0..n-1) on signerCreateWorkers goroutines and fails
// the benchmark with the first error.
func signerParallel(b *testing.B, n int, f func(ctx context.Context, i int) error) {
	b.Helper()
	g, ctx := errgroup.WithContext(context.Background())
	g.SetLimit(signerCreateWorkers)
	for i := range n {
		g.Go(func() error { return f(ctx, i) })
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
}

// signerBootstrapClient returns a client of wl authenticated by a bootstrap
// token, which files the kubelet's CSRs, without a client-side rate limit.
func signerBootstrapClient(b *testing.B, wl *harness.ControlPlane) kubernetes.Interface {
	b.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", wl.BootstrapKubeconfig(b, wl.CreateBootstrapToken(b)))
	if err != nil {
		b.Fatal(err)
	}
	cfg.QPS, cfg.Burst = 2000, 4000
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		b.Fatal(err)
	}
	return c
}

// signerFileCSRs files one insecure-attested kubelet client CSR for each of
// the first n Machines as the bootstrap token, and returns their names.
func signerFileCSRs(b *testing.B, bootstrap kubernetes.Interface, prefix string, n int) []string {
	b.Helper()
	names := make([]string, n)
	reqs := make([][]byte, n)
	for i := range names {
		names[i] = fmt.Sprintf("%s-%05d", prefix, i)
		reqs[i], _ = signertest.Request{NodeName: signerMachineName(i), ProviderID: signerProviderID(i)}.Build(b)
	}
	signerParallel(b, len(names), func(ctx context.Context, i int) error {
		csr := signertest.CSR(names[i], reqs[i])
		csr.Spec.Username, csr.Spec.Groups = "", nil
		_, err := bootstrap.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{})
		return err
	})
	return names
}

// signerFileApprovedCSRs files signerPendingCSRs kubernetes.io/kube-apiserver-client
// CSRs as admin (the harness's client: 200 QPS) and approves them, for
// kube-controller-manager to sign.
func signerFileApprovedCSRs(b *testing.B, admin kubernetes.Interface) []string {
	b.Helper()
	names := make([]string, signerPendingCSRs)
	reqs := make([][]byte, signerPendingCSRs)
	for i := range names {
		names[i] = fmt.Sprintf("kcm-%05d", i)
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			b.Fatal(err)
		}
		der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
			Subject: pkix.Name{CommonName: attestor.NodeUserPrefix + signerMachineName(i), Organization: []string{attestor.NodesGroup}},
		}, key)
		if err != nil {
			b.Fatal(err)
		}
		reqs[i] = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})
	}
	signerParallel(b, len(names), func(ctx context.Context, i int) error {
		csr, err := admin.CertificatesV1().CertificateSigningRequests().Create(ctx, &certificatesv1.CertificateSigningRequest{
			ObjectMeta: metav1.ObjectMeta{Name: names[i]},
			Spec: certificatesv1.CertificateSigningRequestSpec{
				Request:    reqs[i],
				SignerName: certificatesv1.KubeAPIServerClientSignerName,
				Usages:     []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		csr.Status.Conditions = append(csr.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
			Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue, Reason: "Benchmark", LastUpdateTime: metav1.Now(),
		})
		_, err = admin.CertificatesV1().CertificateSigningRequests().UpdateApproval(ctx, csr.Name, csr, metav1.UpdateOptions{})
		return err
	})
	return names
}

// signerWaitIssued watches the workload cluster's CSRs until every one of
// names carries a certificate, and returns when the first and the last
// were seen issued.
func signerWaitIssued(b *testing.B, c kubernetes.Interface, names []string) (first, last time.Time) {
	b.Helper()
	want := make(map[string]bool, len(names))
	for _, n := range names {
		want[n] = true
	}
	issued := map[string]bool{}
	see := func(csr *certificatesv1.CertificateSigningRequest) {
		if want[csr.Name] && !issued[csr.Name] && len(csr.Status.Certificate) > 0 {
			issued[csr.Name] = true
			now := time.Now()
			if first.IsZero() {
				first = now
			}
			last = now
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	for len(issued) < len(want) {
		list, err := c.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{})
		if err != nil {
			b.Fatalf("unable to list CSRs: %v (%d of %d issued)", err, len(issued), len(want))
		}
		for i := range list.Items {
			see(&list.Items[i])
		}
		if len(issued) == len(want) {
			break
		}
		w, err := c.CertificatesV1().CertificateSigningRequests().Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
		if err != nil {
			b.Fatalf("unable to watch CSRs: %v", err)
		}
		for ev := range w.ResultChan() {
			if csr, ok := ev.Object.(*certificatesv1.CertificateSigningRequest); ok {
				see(csr)
			}
			if len(issued) == len(want) {
				break
			}
		}
		w.Stop()
	}
	return first, last
}

// signerDeleteCSRs deletes every CSR of the workload cluster.
func signerDeleteCSRs(b *testing.B, c kubernetes.Interface) {
	b.Helper()
	if err := c.CertificatesV1().CertificateSigningRequests().DeleteCollection(context.Background(), metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		b.Fatal(err)
	}
}

// signerClusters is how many opted-in Clusters BenchmarkSignerClusters
// gives the controller (go test ... -args -signer-clusters=N).
var signerClusters = flag.Int("signer-clusters", 500, "BenchmarkSignerClusters: opted-in Clusters")

// signerProfiles, when set, is where BenchmarkSignerClusters keeps the
// controller's goroutine and heap profiles (--profiler-address) once
// every Cluster is synced: go tool pprof reads them.
var signerProfiles = flag.String("signer-profile-dir", "", "BenchmarkSignerClusters: keep the controller's goroutine (debug=1 text) and heap profiles here")

// BenchmarkSignerClusters measures what each opted-in workload cluster
// costs the controller: it starts the controller binary (default flags)
// with one opted-in Cluster, then with -signer-clusters (500), and reads,
// once every cluster's CSRs are listed, its resident set, goroutines
// (/proc/<pid>/status Threads is not it: go_goroutines from its metrics)
// and open sockets. It reports the growth per cluster.
//
// Every Cluster points at the same workload API server here (this machine
// runs one): the controller keeps one set of informers and one client per
// Cluster, but connections to one server with one CA may be shared, so
// sockets/cluster understates what distinct servers cost (one connection
// each).
func BenchmarkSignerClusters(b *testing.B) {
	bin := scenario.Binaries(b)
	mgmt := harness.StartManagement(b)
	wl := harness.StartControlPlane(b, "workload")
	ann := map[string]string{scenario.AnnotationEnabled: "true", scenario.AnnotationAttestors: "insecure"}
	ca := newServingCA(b)
	mgmt.AddWorkloadCluster(b, signerNamespace, "wl-00000", wl, ann)
	shareServingCA(b, mgmt, signerNamespace, "wl-00000", ca)
	for b.Loop() {
		one := signerMeasureClusters(b, mgmt, bin, 1)
		start := time.Now()
		for i := 1; i < *signerClusters; i++ {
			name := fmt.Sprintf("wl-%05d", i)
			mgmt.AddWorkloadCluster(b, signerNamespace, name, wl, ann)
			shareServingCA(b, mgmt, signerNamespace, name, ca)
		}
		b.Logf("%d Clusters created in %s", *signerClusters-1, time.Since(start).Round(time.Millisecond))
		all := signerMeasureClusters(b, mgmt, bin, *signerClusters)
		d := float64(*signerClusters - 1)
		b.ReportMetric(float64(one.rss)/1024, "MiB/rss-1-cluster")
		b.ReportMetric(float64(all.rss)/1024, "MiB/rss-all-clusters")
		b.ReportMetric(float64(all.rss-one.rss)/d, "KiB/cluster")
		b.ReportMetric(float64(all.goMemory-one.goMemory)/d, "KiB-go/cluster")
		b.ReportMetric(float64(all.goroutines-one.goroutines)/d, "goroutines/cluster")
		b.ReportMetric(float64(all.sockets-one.sockets)/d, "sockets/cluster")
		b.ReportMetric(all.ready.Seconds(), "s/ready-all-clusters")
		fmt.Printf("controller with %d opted-in Clusters: VmRSS %.1f MiB (1 Cluster: %.1f MiB); per Cluster %.1f KiB RSS, %.1f KiB Go heap and stacks, "+
			"%.1f goroutines, %.2f sockets; all synced %s after start\n",
			*signerClusters, float64(all.rss)/1024, float64(one.rss)/1024, float64(all.rss-one.rss)/d, float64(all.goMemory-one.goMemory)/d,
			float64(all.goroutines-one.goroutines)/d, float64(all.sockets-one.sockets)/d, all.ready.Round(time.Millisecond))
	}
}

type signerClusterCost struct {
	rss                 int64 // KiB
	goMemory            int64 // KiB: heap and goroutine stacks in use, after a collection
	goroutines, sockets int
	ready               time.Duration
}

// signerMeasureClusters starts the controller binary, waits until n
// workload clusters report synced, lets it settle and measures it.
func signerMeasureClusters(b *testing.B, mgmt *harness.Management, bin string, n int) signerClusterCost {
	b.Helper()
	port := harness.FreePort(b)
	t0 := time.Now()
	profiler := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(b))
	args := append(signerControllerArgs(mgmt, fmt.Sprintf("127.0.0.1:%d", port)), "--profiler-address="+profiler)
	p := harness.StartProcess(b, "node-attestation-controller", filepath.Join(b.TempDir(), "controller.log"),
		filepath.Join(bin, "node-attestation-controller"), args...)
	defer p.Stop(10 * time.Second)
	metrics := func() string {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
		if err != nil {
			return ""
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return string(body)
	}
	harness.WaitFor(b, 10*time.Minute, func() (bool, error) {
		synced := 0
		for _, l := range strings.Split(metrics(), "\n") {
			if strings.HasPrefix(l, "kubelet_authenticator_signer_workload_cluster_synced{") && strings.HasSuffix(l, " 1") {
				synced++
			}
		}
		return synced >= n, nil
	})
	c := signerClusterCost{ready: time.Since(t0)}
	time.Sleep(10 * time.Second) // let the first GC cycles after the lists run
	c.rss, _ = signerProcStatus(b, p.PID())
	c.goroutines, c.goMemory = signerGoMemory(b, profiler, metrics)
	if *signerProfiles != "" {
		signerSaveProfiles(b, profiler, fmt.Sprintf("clusters-%d", n))
	}
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p.PID()))
	if err != nil {
		b.Fatal(err)
	}
	for _, fd := range fds {
		if target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", p.PID(), fd.Name())); err == nil && strings.HasPrefix(target, "socket:") {
			c.sockets++
		}
	}
	b.Logf("controller with %d Clusters ready in %s: VmRSS %d KiB, Go heap and stacks %d KiB, %d goroutines, %d sockets",
		n, c.ready.Round(time.Millisecond), c.rss, c.goMemory, c.goroutines, c.sockets)
	return c
}

// signerSaveProfiles keeps the goroutine and heap profiles the controller
// serves at addr in -signer-profile-dir, named after what was measured.
func signerSaveProfiles(b *testing.B, addr, name string) {
	b.Helper()
	if err := os.MkdirAll(*signerProfiles, 0o755); err != nil {
		b.Fatal(err)
	}
	for file, path := range map[string]string{name + "-goroutines.txt": "goroutine?debug=1", name + "-heap.pb.gz": "heap?gc=1"} {
		resp, err := http.Get("http://" + addr + "/debug/pprof/" + path)
		if err != nil {
			b.Fatalf("profile %s: %v", path, err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			b.Fatalf("profile %s: %s %v", path, resp.Status, err)
		}
		if err := os.WriteFile(filepath.Join(*signerProfiles, file), body, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	b.Logf("profiles of %s kept in %s", name, *signerProfiles)
}

// signerGoMemory forces a garbage collection in the controller (its heap
// profile with gc=1, from --profiler-address profiler) and returns its
// goroutines and the KiB its heap and goroutine stacks hold then, from
// its metrics: what it keeps, without the collector's headroom or memory
// not yet returned to the system that the resident set also counts.
func signerGoMemory(b *testing.B, profiler string, metrics func() string) (goroutines int, kib int64) {
	b.Helper()
	resp, err := http.Get("http://" + profiler + "/debug/pprof/heap?gc=1")
	if err != nil {
		b.Fatalf("forcing a collection: %v", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	values := map[string]float64{}
	for _, l := range strings.Split(metrics(), "\n") {
		for _, name := range []string{"go_goroutines", "go_memstats_heap_inuse_bytes", "go_memstats_stack_inuse_bytes"} {
			if v, ok := strings.CutPrefix(l, name+" "); ok {
				f, err := strconv.ParseFloat(v, 64)
				if err != nil {
					b.Fatalf("%s %q: %v", name, v, err)
				}
				values[name] = f
			}
		}
	}
	if len(values) != 3 {
		b.Fatalf("the controller's metrics lack goroutines or memory: %v", values)
	}
	return int(values["go_goroutines"]), int64(values["go_memstats_heap_inuse_bytes"]+values["go_memstats_stack_inuse_bytes"]) / 1024
}
