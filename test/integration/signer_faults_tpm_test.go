package integration

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/credential"
	"sigs.k8s.io/kubelet-authenticator/agent/csr"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/device"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// tpmNode is a node of TestSignerFaults that proves itself with its TPM, a
// swtpm: the node's own credential code (agent/credential, what the exec
// plugin runs) files the first-round request, answers the challenge in a
// second, and is run again, as kubelet runs the exec plugin again after a
// failure, until the node holds a certificate.
type tpmNode struct {
	cluster, name, providerID string
	machineUID                types.UID
	dev                       *harness.Swtpm
	src                       *credential.Source
	// twin is the node of another Cluster's Machine that shares this
	// node's TPM (a device moved between Machines): of the two, one joins
	// and the other is denied IdentityClaimedByOtherMachine.
	twin *tpmNode

	mu      sync.Mutex
	leaf    *x509.Certificate // the certificate it holds, once it joined
	claimed bool              // denied: its twin holds the identity
	refiled []string          // its answers denied ChallengeUsed, after which it filed anew
}

// newTPMSource makes a TPM node named name in cluster, whose Machine has
// uid, on dev, filing with the bootstrap kubeconfig at kubeconfig.
func newTPMSource(t *testing.T, cluster, name, providerID string, uid types.UID, dev *harness.Swtpm, kubeconfig string) *tpmNode {
	t.Helper()
	a, err := tpm.New(device.Opener("unix://"+dev.Sock), tpm.AttestorConfig{NoEventLog: true})
	if err != nil {
		t.Fatal(err)
	}
	cfg := &config.NodeConfig{
		NodeName:            name,
		ProviderID:          providerID,
		Attestor:            tpm.Name,
		SignerName:          attestor.ClientSignerName(tpm.Name),
		BootstrapKubeconfig: kubeconfig,
		CacheDir:            filepath.Join(t.TempDir(), "cache"),
	}
	cfg.RequestTimeout.Duration = 90 * time.Second
	return &tpmNode{cluster: cluster, name: name, providerID: providerID, machineUID: uid, dev: dev, src: &credential.Source{Config: cfg, Attestor: a}}
}

// join runs the node's credential code until it holds a certificate (or,
// for a twin, is denied because its twin holds the identity), returning
// when. A denial of its answer as ChallengeUsed (another answer to its
// challenge was approved first) is run again, as kubelet does: with a new
// key and a new challenge. Any other denial is the test's failure.
func (n *tpmNode) join(within time.Duration) (time.Time, error) {
	ctx, cancel := context.WithTimeout(klog.NewContext(context.Background(), logr.Discard()), within)
	defer cancel()
	for {
		cred, _, err := n.src.Get(ctx)
		var denied *csr.DeniedError
		switch {
		case err == nil:
			n.mu.Lock()
			n.leaf = cred.Leaf
			n.mu.Unlock()
			return time.Now(), nil
		case errors.As(err, &denied) && n.twin != nil && denied.Reason == attestor.ReasonIdentityClaimedByOtherMachine:
			n.mu.Lock()
			n.claimed = true
			n.mu.Unlock()
			return time.Now(), nil
		case errors.As(err, &denied) && denied.Reason == attestor.ReasonChallengeUsed:
			n.mu.Lock()
			n.refiled = append(n.refiled, denied.Name)
			n.mu.Unlock()
		case errors.As(err, &denied):
			return time.Time{}, err
		}
		select {
		case <-ctx.Done():
			return time.Time{}, fmt.Errorf("not joined within %s: %w", within, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// replaySuffix ends the name of an answer's copy.
const replaySuffix = "-replay"

// answerReplayer files, for the first answer to a challenge each TPM node
// of a workload cluster files, a copy under another name with the same
// bootstrap token, as soon as it sees the answer: every bootstrapper can
// read every request, and a second holder of the token may file the same
// bytes again. Of an answer and its copy at most one may be approved: a
// challenge is answered once.
type answerReplayer struct {
	cancel  context.CancelFunc
	stopped sync.Once
	factory informers.SharedInformerFactory
	wg      sync.WaitGroup

	mu     sync.Mutex
	nodes  map[string]bool   // the nodes whose answer was copied
	copies map[string]string // the copy of each answer copied
	errs   []error
}

// replayAnswers starts copying the answers filed to cp, through bootstrap,
// until stop.
func replayAnswers(t *testing.T, cp *harness.ControlPlane, bootstrap kubernetes.Interface) *answerReplayer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &answerReplayer{cancel: cancel, nodes: map[string]bool{}, copies: map[string]string{}}
	signer := attestor.ClientSignerName(tpm.Name)
	r.factory = informers.NewSharedInformerFactoryWithOptions(cp.Client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.signerName", signer).String()
	}))
	inf := r.factory.Certificates().V1().CertificateSigningRequests().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: func(obj any) {
		answer, ok := obj.(*certificatesv1.CertificateSigningRequest)
		if !ok || strings.HasSuffix(answer.Name, replaySuffix) {
			return
		}
		req, ev, err := tpmEvidence(answer)
		if err != nil || ev.Response == nil {
			return
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.nodes[req.CSR.Subject.CommonName] {
			return
		}
		r.nodes[req.CSR.Subject.CommonName] = true
		dup := &certificatesv1.CertificateSigningRequest{
			ObjectMeta: metav1.ObjectMeta{Name: answer.Name + replaySuffix},
			Spec: certificatesv1.CertificateSigningRequestSpec{
				Request: answer.Spec.Request, SignerName: answer.Spec.SignerName,
				Usages: answer.Spec.Usages, ExpirationSeconds: answer.Spec.ExpirationSeconds,
			},
		}
		r.copies[answer.Name] = dup.Name
		r.wg.Go(func() {
			for {
				_, err := bootstrap.CertificatesV1().CertificateSigningRequests().Create(ctx, dup, metav1.CreateOptions{})
				if err == nil || apierrors.IsAlreadyExists(err) || ctx.Err() != nil {
					return
				}
				if !apierrors.IsServiceUnavailable(err) && !apierrors.IsTimeout(err) && !apierrors.IsServerTimeout(err) && !isConnectionError(err) {
					r.mu.Lock()
					r.errs = append(r.errs, fmt.Errorf("copy of %s: %w", answer.Name, err))
					r.mu.Unlock()
					return
				}
				select {
				case <-ctx.Done():
					return
				case <-time.After(200 * time.Millisecond):
				}
			}
		})
	}}); err != nil {
		t.Fatal(err)
	}
	r.factory.Start(ctx.Done())
	t.Cleanup(r.stop)
	return r
}

// isConnectionError reports whether err is the API server being away
// (restarting), not an answer.
func isConnectionError(err error) bool {
	var status apierrors.APIStatus
	return !errors.As(err, &status)
}

// stop stops copying and waits for the copies in flight.
func (r *answerReplayer) stop() {
	r.stopped.Do(func() {
		r.cancel()
		r.wg.Wait()
		r.factory.Shutdown()
	})
}

// tpmRequestsOf returns the requests to the tpm signer of node in cp.
func tpmRequestsOf(t *testing.T, cp *harness.ControlPlane, node string) []certificatesv1.CertificateSigningRequest {
	t.Helper()
	list, err := cp.Client.CertificatesV1().CertificateSigningRequests().List(context.Background(), metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.signerName", attestor.ClientSignerName(tpm.Name)).String(),
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []certificatesv1.CertificateSigningRequest
	for _, r := range list.Items {
		if req, _, err := tpmEvidence(&r); err == nil && req.CSR.Subject.CommonName == attestor.NodeUserPrefix+node {
			out = append(out, r)
		}
	}
	return out
}

// nodeOf returns the node name a request to the tpm signer asks for, ""
// when it is not one.
func nodeOf(r *certificatesv1.CertificateSigningRequest) string {
	req, _, err := tpmEvidence(r)
	if err != nil {
		return ""
	}
	return strings.TrimPrefix(req.CSR.Subject.CommonName, attestor.NodeUserPrefix)
}

// tpmEvidence parses a request to the tpm signer.
func tpmEvidence(c *certificatesv1.CertificateSigningRequest) (*attestor.AttestedRequest, *tpm.Evidence, error) {
	req, err := attestor.ParseRequest(c.Spec.Request)
	if err != nil {
		return nil, nil, err
	}
	ev, err := tpm.DecodeEvidence(req.Evidence)
	if err != nil {
		return nil, nil, err
	}
	return req, ev, nil
}

// leafOf returns the first certificate of a PEM chain, nil if none.
func leafOf(chain []byte) *x509.Certificate {
	b, _ := pem.Decode(chain)
	if b == nil {
		return nil
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		return nil
	}
	return c
}

// tpmJoinStats are what checkTPMJoins counted.
type tpmJoinStats struct {
	challenges, answers, copies, copiesApproved, answeredTwice, refiled, rechallenged int
	twinJoined                                                                        string // which twin joined
}

// checkTPMJoins checks what the TPM nodes of TestSignerFaults did, from
// what the workload API servers hold (each cluster's requests to the tpm
// signer and writes, its audit log read by csrWritesOf) and the
// trust-on-first-use records on the management cluster (the ConfigMaps in
// home, the controller's namespace):
//   - no challenge was answered twice: of the answers to one first-round
//     request (the node's own, and the copy answerReplayer filed), at most
//     one was approved and at most one certificate stored, and the one
//     approved is the one the first-round request was closed for
//     (ChallengeAnswered names it); no first-round request was approved;
//   - every TPM node joined: it holds a certificate, issued to one of its
//     answers and checked in full; of two twins exactly one joined and
//     the other's answer was denied IdentityClaimedByOtherMachine;
//   - trust on first use: every record is whole and named after its
//     identity; each joined node's identity (its EK's, from its
//     first-round request's evidence) is recorded once, for its Machine;
//     no Machine has two records, and no record is of an identity no node
//     joined with (the twin that lost has none).
func checkTPMJoins(t *testing.T, mgmt *harness.Management, home string, envs map[string]*signerEnv, writes map[string]map[string]*csrWrites,
	nodes []*tpmNode, replays map[string]*answerReplayer) tpmJoinStats {
	t.Helper()
	ctx := context.Background()
	var st tpmJoinStats
	identities := map[*tpmNode]string{}
	twins := map[string]bool{}
	for _, n := range nodes {
		if n.twin != nil {
			twins[n.name] = true
		}
	}
	for c, e := range envs {
		// The copies filed last are decided first.
		replays[c].mu.Lock()
		copies := maps.Clone(replays[c].copies)
		replays[c].mu.Unlock()
		for _, dup := range copies {
			if err := pollFor(30*time.Second, func() bool {
				r, err := e.wl.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, dup, metav1.GetOptions{})
				return err == nil && (len(r.Status.Certificate) > 0 || condition(r, certificatesv1.CertificateDenied) != nil)
			}); err != nil {
				t.Errorf("%s: the copy %s not decided: %v", c, dup, err)
			}
		}
		list, err := e.wl.Client.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("spec.signerName", attestor.ClientSignerName(tpm.Name)).String(),
		})
		if err != nil {
			t.Fatal(err)
		}
		byName := map[string]*certificatesv1.CertificateSigningRequest{}
		evidence := map[string]*tpm.Evidence{}
		raw := map[string]attestor.Evidence{}
		answers := map[string][]string{} // first-round request → its answers
		for i := range list.Items {
			r := &list.Items[i]
			req, ev, err := tpmEvidence(r)
			if err != nil {
				t.Errorf("%s: request %s to the tpm signer: %v", c, r.Name, err)
				continue
			}
			byName[r.Name], evidence[r.Name], raw[r.Name] = r, ev, req.Evidence
			if ev.Response != nil {
				answers[ev.Response.CSRName] = append(answers[ev.Response.CSRName], r.Name)
				st.answers++
			}
		}
		for name, ev := range evidence {
			if ev.Attestation == nil {
				continue
			}
			first, w := byName[name], writes[c][name]
			if condition(first, certificatesv1.CertificateApproved) != nil || len(first.Status.Certificate) > 0 || (w != nil && (w.approvals > 0 || len(w.certificates) > 0)) {
				t.Errorf("%s: first-round request %s approved or issued: %+v, writes %v", c, name, first.Status.Conditions, w)
			}
			if w != nil && len(w.challenges) > 1 {
				st.rechallenged++
				t.Logf("%s: first-round request %s challenged %d times (%v)", c, name, len(w.challenges), w.log)
			}
			if first.Annotations[attestor.AnnotationChallenge] != "" {
				st.challenges++
			}
			ans := answers[name]
			slices.Sort(ans)
			if len(ans) > 1 {
				st.answeredTwice++
			}
			var approved, issued []string
			stored := 0
			for _, a := range ans {
				aw := writes[c][a]
				if condition(byName[a], certificatesv1.CertificateApproved) != nil || (aw != nil && aw.approved > 0) {
					approved = append(approved, a)
				}
				if len(byName[a].Status.Certificate) > 0 {
					issued = append(issued, a)
				}
				if aw != nil {
					stored += aw.stored
				}
			}
			if len(approved) > 1 || len(issued) > 1 || stored > 1 {
				t.Errorf("%s: the challenge on %s was accepted more than once: answers %v approved, %v issued, %d certificates stored", c, name, approved, issued, stored)
			}
			if len(approved) == 1 {
				if !engine.ConsumedBy(first, byName[approved[0]]) {
					d := condition(first, certificatesv1.CertificateDenied)
					t.Errorf("%s: answer %s of %s approved, but %s is closed %+v, want %s naming it", c, approved[0], name, name, d, attestor.ReasonChallengeAnswered)
				}
				if strings.HasSuffix(approved[0], replaySuffix) {
					st.copiesApproved++
				}
			}
		}
		for answer, dup := range copies {
			st.copies++
			r := byName[dup]
			if r == nil {
				t.Errorf("%s: the copy %s of %s was not filed", c, dup, answer)
				continue
			}
			// Issued (it was approved first: the node's own answer is then
			// denied ChallengeUsed), or denied as a used challenge; a twin's
			// may be denied as its own answer is.
			d := condition(r, certificatesv1.CertificateDenied)
			switch {
			case len(r.Status.Certificate) > 0:
			case d != nil && d.Reason == attestor.ReasonChallengeUsed:
			case d != nil && d.Reason == attestor.ReasonIdentityClaimedByOtherMachine && twins[nodeOf(r)]:
			default:
				t.Errorf("%s: the copy %s of %s is neither issued nor denied %s: %+v", c, dup, answer, attestor.ReasonChallengeUsed, r.Status.Conditions)
			}
		}

		for _, n := range nodes {
			if n.cluster != c {
				continue
			}
			st.refiled += len(n.refiled)
			if n.claimed {
				continue // checked with its twin, below
			}
			if n.leaf == nil {
				t.Errorf("TPM node %s did not join", n.name)
				continue
			}
			held := ""
			for name, r := range byName {
				if l := leafOf(r.Status.Certificate); l != nil && bytes.Equal(l.Raw, n.leaf.Raw) {
					held = name
				}
			}
			ev := evidence[held]
			if held == "" || ev.Response == nil || evidence[ev.Response.CSRName] == nil || evidence[ev.Response.CSRName].Attestation == nil {
				t.Errorf("TPM node %s holds a certificate no answer to a challenge of %s holds (%q)", n.name, c, held)
				continue
			}
			e.expectIssued(t, held, n.name, n.providerID, 24*time.Hour)
			id, err := ekIdentity(raw[ev.Response.CSRName])
			if err != nil {
				t.Errorf("TPM node %s: %v", n.name, err)
				continue
			}
			identities[n] = id
		}
		// The twin that lost: its answer denied because the other holds
		// the identity; nothing of it issued.
		for _, n := range nodes {
			if n.cluster != c || !n.claimed {
				continue
			}
			denied := false
			for _, r := range byName {
				req, _, err := tpmEvidence(r)
				if err != nil || req.CSR.Subject.CommonName != attestor.NodeUserPrefix+n.name {
					continue
				}
				if len(r.Status.Certificate) > 0 {
					t.Errorf("TPM node %s, denied because its twin holds its TPM's identity, was issued %s", n.name, r.Name)
				}
				if d := condition(r, certificatesv1.CertificateDenied); d != nil && d.Reason == attestor.ReasonIdentityClaimedByOtherMachine {
					denied = true
				}
			}
			if !denied {
				t.Errorf("TPM node %s: no request of it denied %s", n.name, attestor.ReasonIdentityClaimedByOtherMachine)
			}
		}
	}
	// Twins: one TPM, one of them joined.
	for _, n := range nodes {
		if n.twin == nil || n.name > n.twin.name {
			continue
		}
		st.twinJoined = n.name
		if n.twin.leaf != nil {
			st.twinJoined = n.twin.name
		}
		if (n.leaf != nil) == (n.twin.leaf != nil) || n.claimed == n.twin.claimed {
			t.Errorf("twins %s and %s, one TPM: joined %t and %t, denied for the other %t and %t; want exactly one joined",
				n.name, n.twin.name, n.leaf != nil, n.twin.leaf != nil, n.claimed, n.twin.claimed)
		}
	}
	// Distinct TPMs, distinct identities.
	seen := map[string]*tpmNode{}
	for n, id := range identities {
		if o := seen[id]; o != nil && o.dev != n.dev {
			t.Errorf("TPM nodes %s and %s, on two TPMs, proved one identity %s", o.name, n.name, id)
		}
		seen[id] = n
	}

	// Trust on first use, from the records.
	var recs corev1.ConfigMapList
	if err := mgmt.Client.List(ctx, &recs, client.InNamespace(home), client.HasLabels{tofu.LabelIdentity}); err != nil {
		t.Fatal(err)
	}
	byUID := map[string][]string{}
	byIdentity := map[string]*corev1.ConfigMap{}
	for i := range recs.Items {
		r := &recs.Items[i]
		id := r.Data[tofu.KeyIdentity]
		if id == "" || r.Name != tofu.Name(id) || r.Data[tofu.KeyMachineNamespace] == "" || r.Data[tofu.KeyMachine] == "" || r.Data[tofu.KeyMachineUID] == "" {
			t.Errorf("trust-on-first-use record %s is not whole, or not named after its identity: %v", r.Name, r.Data)
			continue
		}
		byUID[r.Data[tofu.KeyMachineUID]] = append(byUID[r.Data[tofu.KeyMachineUID]], id)
		byIdentity[id] = r
	}
	for uid, ids := range byUID {
		if len(ids) > 1 {
			t.Errorf("Machine UID %s is bound to %d identities: %v", uid, len(ids), ids)
		}
	}
	for n, id := range identities {
		r := byIdentity[id]
		if r == nil {
			t.Errorf("TPM node %s joined, but its identity %s has no trust-on-first-use record", n.name, id)
			continue
		}
		delete(byIdentity, id)
		if r.Data[tofu.KeyMachineUID] != string(n.machineUID) || r.Data[tofu.KeyMachine] != n.name {
			t.Errorf("TPM node %s joined with identity %s, whose record names Machine %s/%s (UID %s), not its own (UID %s)",
				n.name, id, r.Data[tofu.KeyMachineNamespace], r.Data[tofu.KeyMachine], r.Data[tofu.KeyMachineUID], n.machineUID)
		}
	}
	for id, r := range byIdentity {
		t.Errorf("trust-on-first-use record of identity %s binds Machine %s/%s, which no TPM node joined with", id, r.Data[tofu.KeyMachineNamespace], r.Data[tofu.KeyMachine])
	}
	return st
}

// ekIdentity returns the stable identity (tpm.StableIdentity of the EK)
// that first-round evidence proves.
func ekIdentity(data attestor.Evidence) (string, error) {
	b64, err := tpm.EndorsementKeyAnnotation(data)
	if err != nil {
		return "", err
	}
	der, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return "", err
	}
	return tpm.StableIdentity(der), nil
}
