package capi

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
)

// StatusFieldManager is the field manager of the controller's
// server-side applies of ClusterAttestations.
const StatusFieldManager = "node-attestation-controller"

// DefaultStatusPeriod is how often the ClusterAttestations are brought up
// to date; an object is written only when its status changed.
const DefaultStatusPeriod = 2 * time.Second

// maxDecisionMessage bounds the last decision's message in the status,
// maxConditionMessage a condition's.
const (
	maxDecisionMessage  = 1024
	maxConditionMessage = 8192
)

// truncate cuts s to at most n bytes (and a mark), on a rune boundary.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "..."
}

// Condition types of a ClusterAttestation (docs/status.md).
const (
	ConditionReady              = "Ready"
	ConditionOptedIn            = "OptedIn"
	ConditionWorkloadReachable  = "WorkloadReachable"
	ConditionSignersServed      = "SignersServed"
	ConditionLockdownApplied    = "LockdownApplied"
	ConditionServingCAPublished = "ServingCAPublished"
	ConditionScopedIdentity     = "ScopedIdentity"
	ConditionPolicyValid        = "PolicyValid"
	// ConditionPaused is Cluster API's convention: True while the
	// Cluster is paused.
	ConditionPaused = "Paused"
)

// servedSignerNames are the signer names of profiles a request can be
// signed or approved through, given the authorized providers: refused
// signer names and those of providers not authorized are left out.
func servedSignerNames(profiles []*engine.Profile, authorized []string) []string {
	var out []string
	for _, p := range profiles {
		if p.Serves(authorized) {
			out = append(out, p.SignerName)
		}
	}
	return out
}

// attestationStatus is what a ClusterAttestation says of a Cluster served.
func attestationStatus(s ClusterStatus, generation int64) v1alpha1.ClusterAttestationStatus {
	revoked := int32(min(s.RevokedNodes, math.MaxInt32))
	out := v1alpha1.ClusterAttestationStatus{
		ClusterName:         s.Cluster.Name,
		ObservedGeneration:  generation,
		PolicySource:        s.PolicySource,
		AuthorizedAttestors: s.AuthorizedAttestors,
		SignerNames:         s.SignerNames,
		RevokedNodes:        &revoked,
	}
	if !s.ServingCAExpiry.IsZero() {
		out.ServingCAExpiry = &metav1.Time{Time: s.ServingCAExpiry.UTC().Truncate(time.Second)}
	}
	if d := s.LastDecision; d.CSR != "" {
		out.LastDecision = &v1alpha1.LastDecision{Time: metav1.Time{Time: d.Time.UTC().Truncate(time.Second)}, CSR: d.CSR, Machine: d.Machine,
			Outcome: d.Outcome, Reason: d.Reason, Message: truncate(d.Message, maxDecisionMessage)}
	}
	policy := ClusterPolicy{Source: s.PolicySource}
	reachable, served := s.Connected, s.Synced && len(s.SignerNames) > 0
	for _, c := range []struct {
		typ string
		v   conditionValue
	}{
		{ConditionOptedIn, condf(true, "Enabled", "annotation %s is \"true\": the controller decides this Cluster's CSRs", AnnotationEnabled)},
		{ConditionPolicyValid, policyCondition(s)},
		{ConditionWorkloadReachable, reachableCondition(s)},
		{ConditionSignersServed, signersCondition(s, policy)},
		{ConditionLockdownApplied, lockdownCondition(s, policy)},
		{ConditionServingCAPublished, servingCACondition(s)},
		{ConditionScopedIdentity, scopedIdentityCondition(s)},
		{ConditionPaused, pausedCondition(s)},
		{ConditionReady, readyCondition(reachable, served)},
	} {
		st := metav1.ConditionFalse
		if c.v.ok {
			st = metav1.ConditionTrue
		}
		out.Conditions = append(out.Conditions, metav1.Condition{Type: c.typ, Status: st, ObservedGeneration: generation, Reason: c.v.reason, Message: c.v.message})
	}
	return out
}

// conditionValue is a condition of a ClusterAttestation before its type
// and generation are set.
type conditionValue struct {
	ok              bool
	reason, message string
}

func condf(ok bool, reason, format string, args ...any) conditionValue {
	return conditionValue{ok: ok, reason: reason, message: fmt.Sprintf(format, args...)}
}

// policyCondition says whether the Cluster's policy is valid.
func policyCondition(s ClusterStatus) conditionValue {
	if s.PolicyErrors != "" {
		return condf(false, "Invalid", "%s", truncate(s.PolicyErrors, maxConditionMessage))
	}
	return condf(true, "Valid", "the Cluster's policy (%s) is valid", policySourceText(s.PolicySource))
}

// reachableCondition says whether the workload API server answers.
func reachableCondition(s ClusterStatus) conditionValue {
	switch {
	case s.Connected:
		return condf(true, "Ready", "the workload API server answers /readyz")
	case s.LastError != "":
		return condf(false, "Unreachable", "the workload API server does not answer /readyz: %s", s.LastError)
	default:
		return condf(false, "NotProbed", "the workload API server has not been reached yet")
	}
}

// signersCondition says whether the Cluster's CSRs are being decided.
func signersCondition(s ClusterStatus, policy ClusterPolicy) conditionValue {
	switch {
	case len(s.SignerNames) == 0:
		return condf(false, "NoAuthorizedAttestor", "%s names no attestor this controller serves (%q): every request is denied",
			policy.Setting("authorizedAttestors", AnnotationAuthorizedAttestors), strings.Join(s.AuthorizedAttestors, ","))
	case !s.Synced:
		return condf(false, "NotSynced", "the CSRs of the workload cluster are not listed yet")
	default:
		return condf(true, "Serving", "deciding the CSRs of %s", strings.Join(s.SignerNames, ", "))
	}
}

// readyCondition sums up: reachable, and its CSRs decided.
func readyCondition(reachable, served bool) conditionValue {
	switch {
	case reachable && served:
		return condf(true, "Serving", "the workload cluster is reachable and its CSRs are decided")
	case !reachable:
		return condf(false, "WorkloadUnreachable", "see condition %s", ConditionWorkloadReachable)
	default:
		return condf(false, "SignersNotServed", "see condition %s", ConditionSignersServed)
	}
}

// lockdownCondition says whether lockdown is applied as the policy asks.
func lockdownCondition(s ClusterStatus, policy ClusterPolicy) conditionValue {
	switch {
	case s.Lockdown && s.LockdownEnforced:
		return condf(true, "Enforced", "the bootstrap auto-approve bindings are kept disarmed (%d disarmed since the controller started)",
			s.LockdownRemoved)
	case s.Lockdown && s.LockdownError != "":
		return condf(false, "EnforcementFailed", "lockdown is asked for but not enforced yet (retried): %s", s.LockdownError)
	case s.Lockdown:
		return condf(false, "Pending", "lockdown is asked for and not enforced yet")
	case s.LockdownHeld != "":
		return condf(false, "RestoreHeld", "%s is not true, but the bootstrap auto-approve bindings lockdown disarmed are not restored: %s",
			policy.Setting("lockdown", AnnotationLockdown), s.LockdownHeld)
	case s.LockdownError != "":
		return condf(false, "RestoreFailed", "%s is not true, but restoring the bootstrap auto-approve bindings failed (retried): %s",
			policy.Setting("lockdown", AnnotationLockdown), s.LockdownError)
	default:
		return condf(false, "NotRequested", "%s is not true: kube-controller-manager's bootstrap auto-approval is left as it is",
			policy.Setting("lockdown", AnnotationLockdown))
	}
}

// servingCACondition says whether the serving CAs are published.
func servingCACondition(s ClusterStatus) conditionValue {
	expiry := s.ServingCAExpiry.UTC().Format(time.RFC3339)
	switch {
	case s.TrustBundlesPublished:
		return condf(true, "Published", "%d serving CA(s) published as ClusterTrustBundles; the signing one expires %s", s.ServingCAs, expiry)
	case s.TrustBundleError != "":
		return condf(false, "PublishFailed", "publishing the serving CAs as ClusterTrustBundles failed (retried): %s", s.TrustBundleError)
	default:
		return condf(false, "Pending", "the serving CAs are not published yet")
	}
}

// scopedIdentityCondition says whether the controller works through its own identity.
func scopedIdentityCondition(s ClusterStatus) conditionValue {
	switch {
	case s.ScopedIdentity:
		return condf(true, "TokenIssued", "working through the controller's own ServiceAccount in the workload cluster")
	case s.IdentityError != "":
		return condf(false, "Failed", "installing the controller's identity in the workload cluster failed (retried): %s", s.IdentityError)
	default:
		return condf(false, "NotInstalled", "working as the user of Secret %s (not an admin), or not connected yet",
			s.Cluster.Name+KubeconfigSecretSuffix)
	}
}

// pausedCondition says whether the Cluster is paused, and what waits for
// it to be unpaused.
func pausedCondition(s ClusterStatus) conditionValue {
	if s.Paused {
		return condf(true, "Paused", "the Cluster is paused (spec.paused or annotation %s): its CSRs are still decided, "+
			"but deleted Machines' node names are revoked, and lockdown is lifted, only once it is unpaused", clusterv1.PausedAnnotation)
	}
	return condf(false, "NotPaused", "the Cluster is not paused")
}

// idleStatus is what a ClusterAttestation says of a Cluster not served:
// everything else is dropped by the apply.
func idleStatus(cluster types.NamespacedName, c idleCluster) v1alpha1.ClusterAttestationStatus {
	if !c.optedIn {
		msg := fmt.Sprintf("annotation %s is not \"true\": no CSR of this Cluster is decided", AnnotationEnabled)
		return v1alpha1.ClusterAttestationStatus{ClusterName: cluster.Name, ObservedGeneration: c.generation, Conditions: []metav1.Condition{
			{Type: ConditionOptedIn, Status: metav1.ConditionFalse, ObservedGeneration: c.generation, Reason: ReasonOptedOut, Message: msg},
			{Type: ConditionReady, Status: metav1.ConditionFalse, ObservedGeneration: c.generation, Reason: ReasonOptedOut, Message: msg},
		}}
	}
	out := v1alpha1.ClusterAttestationStatus{ClusterName: cluster.Name, ObservedGeneration: c.generation, Conditions: []metav1.Condition{
		{Type: ConditionOptedIn, Status: metav1.ConditionTrue, ObservedGeneration: c.generation, Reason: "Enabled",
			Message: fmt.Sprintf("annotation %s is \"true\"", AnnotationEnabled)},
		{Type: ConditionReady, Status: metav1.ConditionFalse, ObservedGeneration: c.generation, Reason: c.reason,
			Message: truncate(c.message, maxConditionMessage)},
	}}
	if c.bound != "" {
		out.Conditions = append(out.Conditions, metav1.Condition{Type: ConditionWorkloadWithinBounds, Status: metav1.ConditionFalse,
			ObservedGeneration: c.generation, Reason: c.bound, Message: truncate(c.message, maxConditionMessage)})
	}
	return out
}

// statusWriter keeps the ClusterAttestations of one leader's term.
type statusWriter struct {
	r *ClusterReconciler
	// written is the last status applied per Cluster (JSON), created the
	// Clusters whose object this term applied, conditions the conditions
	// last written (their transition times).
	written    map[types.NamespacedName]string
	created    map[types.NamespacedName]bool
	conditions map[types.NamespacedName][]metav1.Condition
	// noCRD is set while the CRD is not served (logged once).
	noCRD bool
}

// keepStatus writes the ClusterAttestations until ctx is done.
func (r *ClusterReconciler) keepStatus(ctx context.Context) {
	w := &statusWriter{r: r, written: map[types.NamespacedName]string{}, created: map[types.NamespacedName]bool{},
		conditions: map[types.NamespacedName][]metav1.Condition{}}
	logger := klog.FromContext(ctx)
	wait.UntilWithContext(ctx, func(ctx context.Context) { w.sync(ctx, logger) }, cmp.Or(r.StatusPeriod, DefaultStatusPeriod))
}

func (w *statusWriter) sync(ctx context.Context, logger klog.Logger) {
	w.r.mu.Lock()
	idle := maps.Clone(w.r.idle)
	w.r.mu.Unlock()
	seen := map[types.NamespacedName]bool{}
	failed := func(cluster types.NamespacedName, err error) bool {
		switch {
		case err == nil || ctx.Err() != nil:
		case meta.IsNoMatchError(err):
			if !w.noCRD {
				logger.Info("The ClusterAttestation CRD is not installed (deploy/crd): the Clusters' status is not written", "err", err.Error())
			}
			w.noCRD = true
			return true
		default:
			logger.Info("Unable to write the Cluster's status, will retry", "cluster", cluster, "err", err.Error())
		}
		return false
	}
	for _, s := range w.r.Statuses() {
		seen[s.Cluster] = true
		status := attestationStatus(s, s.ObservedGeneration)
		status.ServedBy = w.r.servedBy()
		if failed(s.Cluster, w.write(ctx, s.Cluster, s.ClusterUID, status, true)) {
			return
		}
	}
	for nn, c := range idle {
		if seen[nn] { // a controller still runs
			continue
		}
		seen[nn] = true
		status := idleStatus(nn, c)
		if c.optedIn {
			status.ServedBy = w.r.servedBy()
		}
		if failed(nn, w.write(ctx, nn, c.uid, status, c.optedIn)) {
			return
		}
	}
	if w.noCRD && len(seen) > 0 {
		logger.Info("The ClusterAttestation CRD is installed: writing the Clusters' status")
		w.noCRD = false
	}
	for nn := range w.written {
		if !seen[nn] { // deleted, or its Secrets are gone
			delete(w.written, nn)
			delete(w.created, nn)
			delete(w.conditions, nn)
		}
	}
}

// write applies status to cluster's ClusterAttestation when it changed;
// create makes the object (owned by the Cluster of uid) when this term has
// not, otherwise a missing object is left missing.
func (w *statusWriter) write(ctx context.Context, cluster types.NamespacedName, uid types.UID, status v1alpha1.ClusterAttestationStatus, create bool) error {
	key, err := json.Marshal(status)
	if err != nil {
		return err
	}
	if w.written[cluster] == string(key) {
		return nil
	}
	if _, ok := w.conditions[cluster]; !ok {
		// The transition times of the conditions written before (another
		// leader, an earlier term) are kept.
		prev := &v1alpha1.ClusterAttestation{}
		err := w.r.APIReader.Get(ctx, cluster, prev)
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			return err
		default:
			w.conditions[cluster] = prev.Status.Conditions
		}
	}
	conds := slices.Clone(w.conditions[cluster])
	for _, c := range status.Conditions {
		meta.SetStatusCondition(&conds, c)
	}
	conds = slices.DeleteFunc(conds, func(c metav1.Condition) bool {
		return !slices.ContainsFunc(status.Conditions, func(n metav1.Condition) bool { return n.Type == c.Type })
	})
	applied := status
	applied.Conditions = conds

	if create && !w.created[cluster] {
		obj := &v1alpha1.ClusterAttestation{ObjectMeta: metav1.ObjectMeta{
			Namespace: cluster.Namespace, Name: cluster.Name,
			Labels:          map[string]string{clusterv1.ClusterNameLabel: cluster.Name},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: cluster.Name, UID: uid}},
		}}
		ac, err := applyConfiguration(obj)
		if err != nil {
			return err
		}
		if err := w.r.Client.Apply(ctx, ac, client.FieldOwner(StatusFieldManager), client.ForceOwnership); err != nil {
			return fmt.Errorf("unable to apply ClusterAttestation %s: %w", cluster, err)
		}
		w.created[cluster] = true
	}
	obj := &v1alpha1.ClusterAttestation{ObjectMeta: metav1.ObjectMeta{Namespace: cluster.Namespace, Name: cluster.Name}, Status: applied}
	ac, err := applyConfiguration(obj)
	if err != nil {
		return err
	}
	err = w.r.Client.Status().Apply(ctx, ac, client.FieldOwner(StatusFieldManager), client.ForceOwnership)
	if apierrors.IsNotFound(err) {
		// Deleted by someone (made again next time), or a Cluster that
		// opted out never had one.
		delete(w.created, cluster)
		if !create {
			w.written[cluster] = string(key)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("unable to apply the status of ClusterAttestation %s: %w", cluster, err)
	}
	w.written[cluster], w.conditions[cluster] = string(key), conds
	return nil
}

// applyConfiguration is what the controller applies of obj (as its
// field manager StatusFieldManager): the metadata it sets, or through the
// status client the status. The spec is left to whoever writes it.
func applyConfiguration(obj *v1alpha1.ClusterAttestation) (runtime.ApplyConfiguration, error) {
	obj.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return nil, err
	}
	if md, ok := m["metadata"].(map[string]any); ok {
		delete(md, "creationTimestamp")
	}
	return client.ApplyConfigurationFromUnstructured(&unstructured.Unstructured{Object: m}), nil
}

// policySourceText says where a policy was read from, for a person.
func policySourceText(src v1alpha1.PolicySource) string {
	if src == v1alpha1.PolicySourceAnnotations {
		return "the Cluster's deprecated annotations"
	}
	return "the ClusterAttestation's spec"
}
