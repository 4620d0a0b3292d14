package bench

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	certinformers "k8s.io/client-go/informers/certificates/v1beta1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// Shape of BenchmarkPodCertificates.
const (
	// podBenchDefaultRequests is how many pod certificates each signer
	// issues (POD_BENCH_REQUESTS overrides it).
	podBenchDefaultRequests = 1000
	// podBenchNodes attested nodes share the pods.
	podBenchNodes = 20
	// podBenchInFlight requests are outstanding at once.
	podBenchInFlight = 50
	// podBenchBatches is how many batches each signer's requests are cut
	// into; the two signers' batches alternate.
	podBenchBatches = 4
	// podBenchNamespace holds the pods, of ServiceAccount podBenchSA.
	podBenchNamespace = "pods"
	podBenchSA        = "api"
	// podBenchHermeticSigner is the upstream test signer's signer name.
	podBenchHermeticSigner = "bench.example.com/hermetic"
)

// BenchmarkPodCertificates measures how fast pod certificates are issued
// to pods of attested nodes, by this project's pod signer (the controller
// binary, default flags, pod certificates on for the Cluster) and by the
// upstream test signer k8s.io/kubernetes/test/utils/hermeticpodcertificatesigner
// (test/tools/hermetic-pod-signer: it issues whatever is asked, checking
// nothing, from one worker, which is its design; its client's rate limit
// is lifted), on the same API servers in the same run.
//
// podBenchNodes nodes join through the controller (insecure attestor) and
// write their Node; POD_BENCH_REQUESTS (1,000) pods are bound to them, and
// for each pod and each signer the pod's node creates a
// PodCertificateRequest as kubelet 1.36 does (a new Ed25519 key, the stub
// PKCS#10 request it signs, generateName req-, owned by the pod) with its
// attested client certificate. podBenchInFlight requests are outstanding
// at once; each signer's requests are cut into podBenchBatches batches and
// the batches alternate between the signers (ours first, then the
// hermetic one first, and so on). A request's latency runs from the start
// of its create call to the moment a watch of the requests shows its
// certificate chain.
//
// It reports, for each signer, certificates per second (requests over the
// time its batches took), the p50 and p99 latency and the CPU time per
// certificate of the signer process and of the API servers and etcd of
// both clusters, and the ratios ours/hermetic.
func BenchmarkPodCertificates(b *testing.B) {
	n := podBenchDefaultRequests
	if v := os.Getenv("POD_BENCH_REQUESTS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < podBenchBatches {
			b.Fatalf("POD_BENCH_REQUESTS=%q: want a number, at least %d", v, podBenchBatches)
		}
	}
	bin := scenario.Binaries(b)
	hermeticBin := podBenchHermeticBinary(b)
	mgmt := harness.StartManagement(b)
	wl := harness.StartControlPlane(b, "workload", harness.WithPodCertificates())
	mgmt.AddWorkloadCluster(b, signerNamespace, signerClusterName, wl, map[string]string{
		scenario.AnnotationEnabled:   "true",
		scenario.AnnotationAttestors: "insecure",
	})
	signerCreateMachines(b, mgmt, podBenchNodes)
	infra := make([]string, podBenchNodes)
	for i := range infra {
		infra[i] = signerMachineName(i)
	}
	mgmt.ServeInfrastructure(b, signerNamespace, infra...)
	dir := b.TempDir()
	ours := harness.StartProcess(b, "node-attestation-controller", filepath.Join(dir, "controller.log"),
		filepath.Join(bin, "node-attestation-controller"), signerControllerArgs(mgmt, "0")...)
	hermetic := harness.StartProcess(b, "hermetic-pod-signer", filepath.Join(dir, "hermetic.log"), hermeticBin,
		"--kubeconfig="+wl.AdminKubeconfig, "--signer-name="+podBenchHermeticSigner)
	podBenchEnable(b, mgmt, wl)
	nodes := podBenchJoin(b, wl)
	pods := podBenchPods(b, wl, nodes, n)
	// Requests are trusted once the admission policy that stamps their
	// creator is in force.
	binding, err := wl.Client.AdmissionregistrationV1().MutatingAdmissionPolicyBindings().Get(context.Background(), podcert.AdmissionPolicyName, metav1.GetOptions{})
	if err != nil {
		b.Fatal(err)
	}
	time.Sleep(time.Until(binding.CreationTimestamp.Add(podcert.AdmissionSettle + time.Second)))

	w := podBenchWatch(b, wl.Client)
	env := &scenario.Env{Mgmt: mgmt, Workload: wl}
	signers := []*podBenchSigner{
		{name: "ours", signerName: podcert.DefaultSignerName, proc: ours},
		{name: "hermetic", signerName: podBenchHermeticSigner, proc: hermetic},
	}
	// One request each first: both signers have synced and serve.
	for _, s := range signers {
		if _, err := podBenchRequest(context.Background(), w, pods[0], s.signerName); err != nil {
			b.Fatalf("%s: first request: %v", s.name, err)
		}
	}
	for b.Loop() {
		for _, s := range signers {
			s.reset()
		}
		size := n / podBenchBatches
		for k := range podBenchBatches {
			lo, hi := k*size, (k+1)*size
			if k == podBenchBatches-1 {
				hi = n
			}
			order := signers
			if k%2 == 1 {
				order = []*podBenchSigner{signers[1], signers[0]}
			}
			for _, s := range order {
				s.batch(b, env, w, pods[lo:hi])
			}
		}
		for _, s := range signers {
			s.report(b)
		}
		o, h := signers[0], signers[1]
		b.ReportMetric(o.rate()/h.rate(), "ratio-pods/s")
		b.ReportMetric(float64(o.quantile(0.50))/float64(h.quantile(0.50)), "ratio-p50")
		b.ReportMetric(float64(o.quantile(0.99))/float64(h.quantile(0.99)), "ratio-p99")
	}
}

// podBenchHermeticBinary builds (or finds cached) the hermetic signer
// program.
func podBenchHermeticBinary(b *testing.B) string {
	b.Helper()
	root, err := harness.RepoRoot()
	if err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command("bash", filepath.Join(root, "test", "tools", "install-hermetic-pod-signer.sh"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		b.Fatalf("unable to build hermetic-pod-signer: %v\n%s", err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1]
}

// podBenchEnable turns pod certificates on for the benchmark Cluster
// (podBenchSA of podBenchNamespace allowed), creates the namespace and
// ServiceAccount, and waits for the pod CA to be published.
func podBenchEnable(b *testing.B, mgmt *harness.Management, wl *harness.ControlPlane) {
	b.Helper()
	ctx := context.Background()
	obj := &unstructured.Unstructured{}
	obj.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
	obj.SetNamespace(signerNamespace)
	obj.SetName(signerClusterName)
	patch := fmt.Sprintf(`{"spec":{"authorizedAttestors":["insecure"],"podCertificates":{"trustDomain":"wl.example","allowed":[{"namespace":%q,"serviceAccounts":[%q]}]}}}`,
		podBenchNamespace, podBenchSA)
	harness.WaitFor(b, 60*time.Second, func() (bool, error) {
		return mgmt.Client.Patch(ctx, obj, client.RawPatch(types.MergePatchType, []byte(patch))) == nil, nil
	})
	if _, err := wl.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: podBenchNamespace}}, metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
	if _, err := wl.Client.CoreV1().ServiceAccounts(podBenchNamespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: podBenchSA}}, metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
	harness.WaitFor(b, 90*time.Second, func() (bool, error) {
		list, err := wl.Client.CertificatesV1beta1().ClusterTrustBundles().List(ctx, metav1.ListOptions{LabelSelector: capi.LabelPodCA + "=true"})
		return err == nil && len(list.Items) > 0, nil
	})
}

// podBenchNode is an attested node: its Node and a client of its
// controller-issued certificate, limited as kubelet's is by default
// (kubeAPIQPS 50, kubeAPIBurst 100).
type podBenchNode struct {
	node   *corev1.Node
	client kubernetes.Interface
}

// podBenchJoin joins podBenchNodes nodes (Machines 0..podBenchNodes-1) with
// insecure-attested CSRs the controller signs, and writes each node's Node
// with its new certificate.
func podBenchJoin(b *testing.B, wl *harness.ControlPlane) []podBenchNode {
	b.Helper()
	bootstrap := signerBootstrapClient(b, wl)
	names := make([]string, podBenchNodes)
	keyPEMs := make([][]byte, podBenchNodes)
	for i := range names {
		names[i] = fmt.Sprintf("pod-node-%05d", i)
		req, key := signertest.Request{NodeName: signerMachineName(i), ProviderID: signerProviderID(i)}.Build(b)
		der, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			b.Fatal(err)
		}
		keyPEMs[i] = pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
		csr := signertest.CSR(names[i], req)
		csr.Spec.Username, csr.Spec.Groups = "", nil
		if _, err := bootstrap.CertificatesV1().CertificateSigningRequests().Create(context.Background(), csr, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
	}
	signerWaitIssued(b, wl.Client, names)
	nodes := make([]podBenchNode, podBenchNodes)
	signerParallel(b, podBenchNodes, func(ctx context.Context, i int) error {
		csr, err := wl.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, names[i], metav1.GetOptions{})
		if err != nil {
			return err
		}
		cs, err := kubernetes.NewForConfig(&rest.Config{Host: wl.URL, QPS: 50, Burst: 100,
			TLSClientConfig: rest.TLSClientConfig{CAData: wl.CACertPEM, CertData: csr.Status.Certificate, KeyData: keyPEMs[i]}})
		if err != nil {
			return err
		}
		node, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: signerMachineName(i)}}, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("node %s: unable to write its Node: %w", signerMachineName(i), err)
		}
		nodes[i] = podBenchNode{node: node, client: cs}
		return nil
	})
	return nodes
}

// podBenchPod is a pod bound to node.
type podBenchPod struct {
	pod  *corev1.Pod
	sa   *corev1.ServiceAccount
	node podBenchNode
}

// podBenchPods creates n pods of podBenchSA, pod i bound to node i modulo
// the nodes.
func podBenchPods(b *testing.B, wl *harness.ControlPlane, nodes []podBenchNode, n int) []podBenchPod {
	b.Helper()
	sa, err := wl.Client.CoreV1().ServiceAccounts(podBenchNamespace).Get(context.Background(), podBenchSA, metav1.GetOptions{})
	if err != nil {
		b.Fatal(err)
	}
	pods := make([]podBenchPod, n)
	signerParallel(b, n, func(ctx context.Context, i int) error {
		node := nodes[i%len(nodes)]
		p, err := wl.Client.CoreV1().Pods(podBenchNamespace).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("pod-%05d", i)},
			Spec: corev1.PodSpec{ServiceAccountName: podBenchSA, NodeName: node.node.Name, AutomountServiceAccountToken: ptr.To(false),
				Containers: []corev1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		pods[i] = podBenchPod{pod: p, sa: sa, node: node}
		return nil
	})
	return pods
}

// podBenchWatcher follows every PodCertificateRequest of the namespace
// through an informer (a list, then a watch) and records when each was
// first seen decided.
type podBenchWatcher struct {
	mu      sync.Mutex
	decided map[string]*podBenchDecision
}

// podBenchDecision is closed once its request is seen issued or denied.
type podBenchDecision struct {
	done   chan struct{}
	at     time.Time
	denied string // the condition, when not issued
}

func podBenchWatch(b *testing.B, cs kubernetes.Interface) *podBenchWatcher {
	b.Helper()
	w := &podBenchWatcher{decided: map[string]*podBenchDecision{}}
	inf := certinformers.NewPodCertificateRequestInformer(cs, podBenchNamespace, 0, cache.Indexers{})
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    w.see,
		UpdateFunc: func(_, obj any) { w.see(obj) },
	}); err != nil {
		b.Fatal(err)
	}
	stop := make(chan struct{})
	b.Cleanup(func() { close(stop) })
	go inf.Run(stop)
	if !cache.WaitForCacheSync(stop, inf.HasSynced) {
		b.Fatal("the watch of pod certificate requests did not sync")
	}
	return w
}

// get returns name's decision, made if it is new.
func (w *podBenchWatcher) get(name string) *podBenchDecision {
	w.mu.Lock()
	defer w.mu.Unlock()
	d, ok := w.decided[name]
	if !ok {
		d = &podBenchDecision{done: make(chan struct{})}
		w.decided[name] = d
	}
	return d
}

func (w *podBenchWatcher) see(obj any) {
	now := time.Now()
	pcr, ok := obj.(*certificatesv1beta1.PodCertificateRequest)
	if !ok {
		return
	}
	denied := ""
	for _, c := range pcr.Status.Conditions {
		if c.Type != certificatesv1beta1.PodCertificateRequestConditionTypeIssued {
			denied = fmt.Sprintf("%s/%s: %s", c.Type, c.Reason, c.Message)
		}
	}
	if pcr.Status.CertificateChain == "" && denied == "" {
		return
	}
	d := w.get(pcr.Name)
	w.mu.Lock()
	defer w.mu.Unlock()
	if d.at.IsZero() {
		d.at, d.denied = now, denied
		close(d.done)
	}
}

// podBenchRequest creates, as p's node, a PodCertificateRequest for p of
// signerName as kubelet 1.36 does, waits until the watch shows it issued,
// and returns the time from the create call to then.
func podBenchRequest(ctx context.Context, w *podBenchWatcher, p podBenchPod, signerName string) (time.Duration, error) {
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return 0, err
	}
	// kubelet's stubPKCS10Request: empty but for the key, signed by it.
	stub, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
	if err != nil {
		return 0, err
	}
	pcr := &certificatesv1beta1.PodCertificateRequest{
		ObjectMeta: metav1.ObjectMeta{Namespace: p.pod.Namespace, GenerateName: "req-",
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: p.pod.Name, UID: p.pod.UID}}},
		Spec: certificatesv1beta1.PodCertificateRequestSpec{
			SignerName: signerName,
			PodName:    p.pod.Name, PodUID: p.pod.UID,
			ServiceAccountName: p.sa.Name, ServiceAccountUID: p.sa.UID,
			NodeName: types.NodeName(p.node.node.Name), NodeUID: p.node.node.UID,
			MaxExpirationSeconds: ptr.To(int32(86400)),
			StubPKCS10Request:    stub,
		},
	}
	start := time.Now()
	created, err := p.node.client.CertificatesV1beta1().PodCertificateRequests(p.pod.Namespace).Create(ctx, pcr, metav1.CreateOptions{})
	if err != nil {
		return 0, fmt.Errorf("node %s: unable to create the request of pod %s: %w", p.node.node.Name, p.pod.Name, err)
	}
	d := w.get(created.Name)
	select {
	case <-d.done:
	case <-time.After(2 * time.Minute):
		return 0, fmt.Errorf("request %s of pod %s: not issued after 2 minutes", created.Name, p.pod.Name)
	}
	if d.denied != "" {
		return 0, fmt.Errorf("request %s of pod %s: %s", created.Name, p.pod.Name, d.denied)
	}
	return d.at.Sub(start), nil
}

// podBenchSigner is one side of the benchmark and what its batches
// measured.
type podBenchSigner struct {
	name, signerName string
	proc             *harness.Process
	latencies        []time.Duration
	wall, signerCPU  time.Duration
	shared           sharedCPU
	// requests counts the API servers' requests during the batches, by
	// cluster, verb and resource.
	requests map[string]float64
}

func (s *podBenchSigner) reset() {
	s.latencies, s.wall, s.signerCPU, s.shared, s.requests = nil, 0, 0, sharedCPU{}, map[string]float64{}
}

// batch requests a certificate of s for each of pods, podBenchInFlight at
// once.
func (s *podBenchSigner) batch(b *testing.B, env *scenario.Env, w *podBenchWatcher, pods []podBenchPod) {
	b.Helper()
	var mu sync.Mutex
	cpu0, shared0, req0 := procCPU(b, s.proc.PID()), readSharedCPU(b, env), podBenchRequestCounts(b, env)
	start := time.Now()
	work := make(chan podBenchPod)
	errs := make(chan error, podBenchInFlight)
	var wg sync.WaitGroup
	for range min(podBenchInFlight, len(pods)) {
		wg.Go(func() {
			for p := range work {
				d, err := podBenchRequest(context.Background(), w, p, s.signerName)
				if err != nil {
					select {
					case errs <- err:
					default: // the first ones are enough
					}
					continue
				}
				mu.Lock()
				s.latencies = append(s.latencies, d)
				mu.Unlock()
			}
		})
	}
	for _, p := range pods {
		work <- p
	}
	close(work)
	wg.Wait()
	took := time.Since(start)
	close(errs)
	for err := range errs {
		b.Fatalf("%s: %v", s.name, err)
	}
	s.wall += took
	s.signerCPU += procCPU(b, s.proc.PID()) - cpu0
	s.shared.add(shared0, readSharedCPU(b, env))
	for k, v := range podBenchRequestCounts(b, env) {
		s.requests[k] += v - req0[k]
	}
	b.Logf("%s: %d certificates in %s", s.name, len(pods), took.Round(time.Millisecond))
}

func (s *podBenchSigner) rate() float64 { return float64(len(s.latencies)) / s.wall.Seconds() }

func (s *podBenchSigner) quantile(q float64) time.Duration {
	l := slices.Clone(s.latencies)
	slices.Sort(l)
	return l[min(len(l)-1, int(q*float64(len(l))))]
}

func (s *podBenchSigner) report(b *testing.B) {
	b.Helper()
	n := float64(len(s.latencies))
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	b.ReportMetric(s.rate(), "pods/s-"+s.name)
	b.ReportMetric(ms(s.quantile(0.50)), "ms/p50-"+s.name)
	b.ReportMetric(ms(s.quantile(0.99)), "ms/p99-"+s.name)
	b.ReportMetric(ms(s.signerCPU)/n, "ms-cpu/cert-signer-"+s.name)
	b.ReportMetric(ms(s.shared.api)/n, "ms-cpu/cert-apiservers-"+s.name)
	fmt.Printf("%s (%s): %d pod certificates, %.1f/s, p50 %s, p99 %s; CPU per certificate: signer %.2f ms, API servers and etcd %.2f ms; machine %.0f%% busy\n",
		s.name, s.signerName, len(s.latencies), s.rate(), s.quantile(0.50).Round(100*time.Microsecond), s.quantile(0.99).Round(100*time.Microsecond),
		ms(s.signerCPU)/n, ms(s.shared.api)/n, 100*s.shared.busyShare())
	var per []string
	for _, k := range slices.Sorted(maps.Keys(s.requests)) {
		if v := s.requests[k] / n; v >= 0.05 {
			per = append(per, fmt.Sprintf("%s %.2f", k, v))
		}
	}
	fmt.Printf("%s: API requests per certificate: %s\n", s.name, strings.Join(per, ", "))
}

// podBenchRequestCounts reads apiserver_request_total of both clusters'
// API servers, summed by cluster, verb and resource (with subresource).
func podBenchRequestCounts(b *testing.B, env *scenario.Env) map[string]float64 {
	b.Helper()
	out := map[string]float64{}
	for _, cp := range []*harness.ControlPlane{env.Workload, env.Mgmt.ControlPlane} {
		raw, err := cp.Client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(context.Background())
		if err != nil {
			b.Fatalf("%s: unable to read the API server's metrics: %v", cp.Name, err)
		}
		for _, line := range strings.Split(string(raw), "\n") {
			rest, ok := strings.CutPrefix(line, "apiserver_request_total{")
			if !ok {
				continue
			}
			labels, value, ok := strings.Cut(rest, "} ")
			if !ok {
				continue
			}
			v, err := strconv.ParseFloat(value, 64)
			if err != nil {
				b.Fatalf("%s: apiserver_request_total: %v", cp.Name, err)
			}
			l := map[string]string{}
			for _, kv := range strings.Split(labels, ",") {
				if k, val, ok := strings.Cut(kv, "="); ok {
					l[k] = strings.Trim(val, `"`)
				}
			}
			res := l["resource"]
			if l["subresource"] != "" {
				res += "/" + l["subresource"]
			}
			out[cp.Name+" "+l["verb"]+" "+res] += v
		}
	}
	return out
}
