package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

// observer implements Metrics, its optional interfaces and Recorder.
type observer struct {
	mu       sync.Mutex
	counts   map[string]int
	verified map[string]int // provider/result
	events   []string
}

func (o *observer) inc(m map[string]int, k string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	m[k]++
}

func (o *observer) Decision(cluster, decision, reason string) {
	o.inc(o.counts, "decision/"+cluster+"/"+decision+"/"+reason)
}
func (o *observer) Seen(cluster, signerName string) { o.inc(o.counts, "seen/"+cluster+"/"+signerName) }
func (o *observer) Signed(cluster, provider string) { o.inc(o.counts, "signed/"+cluster+"/"+provider) }
func (o *observer) Verified(provider, result string, took time.Duration) {
	if took <= 0 {
		result += "(no duration)"
	}
	o.inc(o.verified, provider+"/"+result)
}

func (o *observer) Decided(csr string, m *Machine, decision, reason, message string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	on := "<none>"
	if m != nil {
		on = m.Namespace + "/" + m.Name
	}
	if message == "" {
		reason += "(no message)"
	}
	o.events = append(o.events, fmt.Sprintf("%s %s %s %s", csr, on, decision, reason))
}

func (o *observer) get(m map[string]int, k string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return m[k]
}

// nodeMatcher matches every node to theMachine but "ghost", which no
// Machine accounts for.
type nodeMatcher struct{}

func (nodeMatcher) MatchMachine(_ context.Context, nodeName, _ string) (*Machine, error) {
	if nodeName == "ghost" {
		return nil, &checks.Failure{Reason: "MachineNotFound", Message: "no Machine claims ghost"}
	}
	return theMachine, nil
}

// TestRunObserves checks what an operator sees of each decision: the CSRs
// seen and signed, the verification latency by result, one record (Event)
// per approval and denial naming the Machine when there is one, and log
// lines of every decision that name the cluster, the CSR and the Machine.
func TestRunObserves(t *testing.T) {
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.BufferLogs(true)))
	ctx, cancel := context.WithCancel(klog.NewContext(context.Background(), logger))
	client := fake.NewClientset()
	o := &observer{counts: map[string]int{}, verified: map[string]int{}}
	c, err := New(Config{
		Cluster:    "ns/wl",
		Client:     client,
		Verifiers:  map[string]attestor.Verifier{insecure.Name: insecure.Verifier{}},
		Authorized: []string{insecure.Name},
		Machines:   nodeMatcher{},
		Signer:     newSigner(t),
		Metrics:    o,
		Events:     o,
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()

	otherEvidence, _ := json.Marshal(insecure.Evidence{Version: insecure.VersionV1, ProviderID: "test:///other"})
	good, _ := signertest.Request{NodeName: node, ProviderID: pid}.Build(t)
	bad, _ := signertest.Request{NodeName: node, ProviderID: pid, Evidence: otherEvidence}.Build(t)
	ghost, _ := signertest.Request{NodeName: "ghost", ProviderID: "test:///ghost"}.Build(t)
	for _, csr := range []*certificatesv1.CertificateSigningRequest{signertest.CSR("good", good), signertest.CSR("bad", bad), signertest.CSR("ghost", ghost)} {
		if _, err := client.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		o.mu.Lock()
		n := len(o.events)
		o.mu.Unlock()
		if n >= 3 && o.get(o.counts, "signed/ns/wl/insecure") == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not all decided within 10s: events %v, counts %v", o.events, o.counts)
		}
		time.Sleep(20 * time.Millisecond)
	}

	signer := attestor.ClientSignerName(insecure.Name)
	for key, want := range map[string]int{
		"seen/ns/wl/" + signer:                                 3,
		"signed/ns/wl/insecure":                                1,
		"decision/ns/wl/approved/" + ReasonAttestationVerified: 1,
		"decision/ns/wl/denied/ProviderIDMismatch":             1,
		"decision/ns/wl/denied/MachineNotFound":                1,
	} {
		if got := o.get(o.counts, key); got != want {
			t.Errorf("%s = %d, want %d (all: %v)", key, got, want, o.counts)
		}
	}
	// The ghost is denied before any verifier runs.
	for key, want := range map[string]int{"insecure/" + VerifyResultVerified: 1, "insecure/" + VerifyResultDenied: 1} {
		if got := o.get(o.verified, key); got != want {
			t.Errorf("verifications %s = %d, want %d (all: %v)", key, got, want, o.verified)
		}
	}
	o.mu.Lock()
	events := map[string]bool{}
	for _, e := range o.events {
		events[e] = true
	}
	o.mu.Unlock()
	for _, want := range []string{
		"good ns/worker-0 approved " + ReasonAttestationVerified,
		"bad ns/worker-0 denied ProviderIDMismatch",
		"ghost <none> denied MachineNotFound",
	} {
		if !events[want] {
			t.Errorf("no record %q; have %v", want, events)
		}
	}

	// Every decision's log line names the cluster and the CSR, and the
	// Machine when the request matched one.
	decisions := map[string]bool{}
	for _, e := range logger.GetSink().(ktesting.Underlier).GetBuffer().Data() {
		if e.Message != "Approved" && e.Message != "Denied" && e.Message != "Issued" {
			continue
		}
		kv := map[string]string{}
		all := append(append([]any(nil), e.WithKVList...), e.ParameterKVList...)
		for i := 0; i+1 < len(all); i += 2 {
			kv[fmt.Sprint(all[i])] = fmt.Sprint(all[i+1])
		}
		csr := kv["csr"]
		decisions[e.Message+" "+csr] = true
		if kv["cluster"] != "ns/wl" || csr == "" {
			t.Errorf("%s log line without cluster or CSR: %v", e.Message, kv)
		}
		if m, ok := kv["machine"]; (csr != "ghost") != ok || (ok && m != "ns/worker-0") {
			t.Errorf("%s log line of %s: machine = %q, %v", e.Message, csr, m, ok)
		}
	}
	for _, want := range []string{"Approved good", "Issued good", "Denied bad", "Denied ghost"} {
		if !decisions[want] {
			t.Errorf("no log line %q; have %v", want, decisions)
		}
	}
}
