package controller

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	certificatesv1 "k8s.io/api/certificates/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// csrWriteLog records the controller's writes of CSRs as the API server
// answered them: "PUT first 200".
type csrWriteLog struct {
	next http.RoundTripper
	mu   sync.Mutex
	log  []string
}

func (l *csrWriteLog) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := l.next.RoundTrip(req)
	if req.Method == http.MethodGet || !strings.Contains(req.URL.Path, "/certificatesigningrequests/") || err != nil {
		return resp, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.log = append(l.log, fmt.Sprintf("%s %s %d", req.Method, strings.SplitN(req.URL.Path, "/certificatesigningrequests/", 2)[1], resp.StatusCode))
	return resp, err
}

func (l *csrWriteLog) take() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.log
	l.log = nil
	return out
}

// TestChallengeWrite: against a real kube-apiserver, a challenge is written
// by an update of the request conditional on the version decided on. The
// request's spec and its other metadata stay as filed, and a write from a
// copy older than the stored request is refused (Conflict: the request is
// decided again). Where the controller's user may patch requests but not
// update them (deploy/workload applied by hand before it granted update),
// the API server's 403 turns it to a merge patch, and the join still gets
// its challenge; the next challenge is patched without asking again.
func TestChallengeWrite(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "challenge-write")
	ctx := context.Background()
	// A user with the rules deploy/workload gave before update.
	const patchOnly = "patch-only-controller"
	role := &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: patchOnly},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"certificatesigningrequests"}, Verbs: []string{"get", "list", "watch", "patch"}},
			{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"certificatesigningrequests/approval", "certificatesigningrequests/status"},
				Verbs: []string{"update", "patch"}},
			{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"signers"}, Verbs: []string{"approve", "sign"}},
		},
	}
	if _, err := cp.Client.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cp.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: patchOnly},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: patchOnly},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: patchOnly}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The requests are filed with a bootstrap token's identity.
	if _, err := cp.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "bootstrappers"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "system:node-bootstrapper"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: attestor.BootstrappersGroup}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	bootstrap := rest.CopyConfig(cp.AdminConfig)
	bootstrap.Impersonate = rest.ImpersonationConfig{UserName: "system:bootstrap:abcdef", Groups: []string{attestor.BootstrappersGroup}}
	filer, err := kubernetes.NewForConfig(bootstrap)
	if err != nil {
		t.Fatal(err)
	}
	rigAs := func(user string) (*rig, *csrWriteLog) {
		t.Helper()
		writes := &csrWriteLog{}
		cfg := rest.CopyConfig(cp.AdminConfig)
		cfg.Impersonate.UserName = user
		cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { writes.next = rt; return writes })
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		r := newRig(t, false, func(c *Config) { c.Client = cs })
		r.filer = filer
		return r, writes
	}
	req := signertest.Request{NodeName: "node-1", ProviderID: pid}
	_, reqKey := req.Build(t)
	req.Key = reqKey
	// file files name, with the requester's own metadata or without,
	// waits for the controller's cache to hold it and decides it once; it
	// returns the copy decided on.
	file := func(r *rig, name string, metadata bool) *certificatesv1.CertificateSigningRequest {
		t.Helper()
		filed := r.fileWith(name, req, challengeEvidence{Version: "v1", ProviderID: pid}, func(c *certificatesv1.CertificateSigningRequest) {
			if metadata {
				c.Labels = map[string]string{"example.com/keep": "label"}
				c.Annotations = map[string]string{"example.com/keep": "annotation"}
				c.Finalizers = []string{"example.com/keep"}
			}
		})
		live := r.get(filed.Name)
		harness.WaitFor(t, 10*time.Second, func() (bool, error) {
			cached, err := r.c.Get(r.signer, name)
			return err == nil && cached.ResourceVersion == live.ResourceVersion, nil
		})
		cached, err := r.c.Get(r.signer, name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.c.sync(r.ctx, key{signer: r.signer, name: name}); err != nil {
			t.Fatal(err)
		}
		return cached
	}
	challenged := func(r *rig, name string, metadata bool) {
		t.Helper()
		got := r.get(name)
		if got.Annotations[attestor.AnnotationChallenge] == "" || got.Annotations[attestor.AnnotationChallengeSeal] == "" {
			t.Fatalf("%s not challenged: %v", name, got.Annotations)
		}
		if metadata && (got.Labels["example.com/keep"] != "label" || got.Annotations["example.com/keep"] != "annotation" ||
			!slices.Equal(got.Finalizers, []string{"example.com/keep"})) {
			t.Errorf("%s's metadata after the challenge: labels %v, annotations %v, finalizers %v, want the requester's kept", name, got.Labels, got.Annotations, got.Finalizers)
		}
		if len(got.Spec.Request) == 0 || got.Spec.SignerName != r.signer || got.Spec.Username == "" || len(got.Spec.Usages) == 0 {
			t.Errorf("%s's spec after the challenge: %d request bytes, signer %q, user %q, usages %v, want it as filed", name, len(got.Spec.Request),
				got.Spec.SignerName, got.Spec.Username, got.Spec.Usages)
		}
	}

	admin, writes := rigAs("")
	before := file(admin, "by-update", false)
	if got := writes.take(); !slices.Equal(got, []string{"PUT by-update 200"}) {
		t.Errorf("the challenge was written by %v, want one update", got)
	}
	challenged(admin, "by-update", false)
	// A write from the copy decided on, now older than the stored request.
	_, err = admin.c.annotate(ctx, before, map[string]string{attestor.AnnotationChallenge: "stale"})
	if !apierrors.IsConflict(err) {
		t.Errorf("a challenge written from an old copy: %v, want a conflict", err)
	}
	if got := admin.get("by-update").Annotations[attestor.AnnotationChallenge]; got == "stale" {
		t.Error("a challenge written from an old copy was stored")
	}
	writes.take()
	// The cache cut the requester's own metadata: an update from it would
	// write that away, so it is a patch.
	file(admin, "with-metadata", true)
	if got := writes.take(); !slices.Equal(got, []string{"PATCH with-metadata 200"}) {
		t.Errorf("the challenge of a request with metadata the cache cut was written by %v, want one patch", got)
	}
	challenged(admin, "with-metadata", true)

	limited, writes := rigAs(patchOnly)
	file(limited, "by-patch", false)
	if got := writes.take(); !slices.Equal(got, []string{"PUT by-patch 403", "PATCH by-patch 200"}) {
		t.Errorf("the challenge was written by %v, want an update refused, then a patch", got)
	}
	challenged(limited, "by-patch", false)
	file(limited, "by-patch-again", false)
	if got := writes.take(); !slices.Equal(got, []string{"PATCH by-patch-again 200"}) {
		t.Errorf("the next challenge was written by %v, want a patch alone", got)
	}
	challenged(limited, "by-patch-again", false)

	// The role is given update again (deploy/workload applied anew): once
	// updateRetryAfter has passed, the challenge is an update again.
	role.Rules[0].Verbs = append(role.Rules[0].Verbs, "update")
	if _, err := cp.Client.RbacV1().ClusterRoles().Update(ctx, role, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 10*time.Second, func() (bool, error) {
		r, err := cp.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User:               patchOnly,
			ResourceAttributes: &authorizationv1.ResourceAttributes{Group: "certificates.k8s.io", Resource: "certificatesigningrequests", Verb: "update"},
		}}, metav1.CreateOptions{})
		return err == nil && r.Status.Allowed, err
	})
	limited.clock.Step(updateRetryAfter)
	file(limited, "by-update-again", false)
	if got := writes.take(); !slices.Equal(got, []string{"PUT by-update-again 200"}) {
		t.Errorf("the challenge after the role was granted update again was written by %v, want one update", got)
	}
	challenged(limited, "by-update-again", false)
}
