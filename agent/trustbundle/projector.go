package trustbundle

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
)

const (
	// Group is the API group of ClusterTrustBundle.
	Group = "certificates.k8s.io"
	// Resource is its resource name.
	Resource = "clustertrustbundles"
	// DefaultCommandTimeout bounds a post-update command.
	DefaultCommandTimeout = 30 * time.Second
	// DefaultRetryInitial is the first backoff after a failed write.
	DefaultRetryInitial = time.Second
	// DefaultRetryMax is the longest backoff after failed writes.
	DefaultRetryMax = 5 * time.Minute
	// DefaultResyncPeriod is how often a projection is read from the API
	// server (a LIST) and written again, without a change.
	DefaultResyncPeriod = 10 * time.Minute
)

// versions lists the ClusterTrustBundle versions this package reads,
// preferred first. Their fields (spec.signerName, spec.trustBundle) are the
// same in all of them.
func versions() []string { return []string{"v1", "v1beta1", "v1alpha1"} }

// Metrics receives what projections do; agent/metrics implements it. A
// projection is named by its Key (its path).
type Metrics interface {
	// Updated is called after a projection's file changed.
	Updated(projection string, certificates int, at time.Time)
	// Stale is called with whether a projection is stale: its file keeps
	// content its source no longer provides, or has not been confirmed yet.
	Stale(projection string, stale bool)
	// Synced is called when a projection's file was confirmed to match its
	// source (changed or not).
	Synced(projection string, at time.Time)
	// Rejected is called for every ClusterTrustBundle kept out of a
	// projection's watch cache (RejectedTooLarge, RejectedTooMany), once
	// per version of the object.
	Rejected(projection, reason string)
}

// Status is the state of one projection.
type Status struct {
	// Projection is the projection's key, its path.
	Projection string `json:"projection"`
	// Resource is the API version read, e.g. certificates.k8s.io/v1beta1.
	Resource string `json:"resource,omitempty"`
	// Sources are the ClusterTrustBundle objects the file holds.
	Sources []string `json:"sources,omitempty"`
	// Certificates is how many certificates the file holds.
	Certificates int `json:"certificates"`
	// LastUpdate is when the file last changed; LastSync when it was last
	// confirmed to match its source.
	LastUpdate time.Time `json:"lastUpdate,omitzero"`
	LastSync   time.Time `json:"lastSync,omitzero"`
	// Stale means the file keeps the last good content: the source is
	// gone, invalid or not readable, or not yet read.
	Stale bool `json:"stale"`
	// Reason says why the projection is stale, or what last went wrong
	// (a failed post-update command).
	Reason string `json:"reason,omitempty"`
}

// Projector keeps one projection current.
type Projector struct {
	// Config reaches the API server; Resource is the ClusterTrustBundle
	// version it serves (see Discover).
	Config   *rest.Config
	Resource schema.GroupVersionResource
	// Projection is what to select and where to write it.
	Projection config.TrustBundleProjection
	// Metrics and OnStatus, when set, are told about every change.
	Metrics  Metrics
	OnStatus func(Status)
	// Clock tells the time; nil means the real clock.
	Clock clock.PassiveClock
	// CommandTimeout bounds the post-update command; 0 means
	// DefaultCommandTimeout.
	CommandTimeout time.Duration
	// MaxBundles and MaxBytes cap the selected ClusterTrustBundles and the
	// sum of their spec.trustBundle sizes; 0 means no cap. Both apply
	// before an object is cached: the watch cache holds at most MaxBundles
	// objects, and an object whose spec.trustBundle alone is over MaxBytes
	// never enters it (see gate).
	MaxBundles int
	MaxBytes   int64
	// RetryInitial and RetryMax bound the backoff after a failed write;
	// ResyncPeriod is how often the file is checked against a LIST from
	// the API server without a change. 0 means the defaults.
	RetryInitial, RetryMax, ResyncPeriod time.Duration

	writer     *Writer
	rejections func() map[string]string // objects kept out of the cache, by name; nil: none
	// watching, when set, is given the informer before it starts (tests
	// watch what enters its store).
	watching   func(cache.SharedIndexInformer)
	commandErr string // of the last post-update command; Run's goroutine only
	mu         sync.Mutex
	status     Status
}

func (p *Projector) now() time.Time {
	if p.Clock != nil {
		return p.Clock.Now()
	}
	return time.Now()
}

// ListOptions returns the server-side selection of the projection.
func ListOptions(pr config.TrustBundleProjection) (metav1.ListOptions, error) {
	if pr.Name != "" {
		return metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", pr.Name).String()}, nil
	}
	opts := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("spec.signerName", pr.SignerName).String()}
	if pr.LabelSelector != nil {
		sel, err := metav1.LabelSelectorAsSelector(pr.LabelSelector)
		if err != nil {
			return opts, fmt.Errorf("invalid label selector: %w", err)
		}
		opts.LabelSelector = sel.String()
	}
	return opts, nil
}

// matches checks the selection again on the client: the projection must
// never take in an object it did not ask for.
func matches(pr config.TrustBundleProjection, sel labels.Selector, o *clusterTrustBundle) bool {
	if pr.Name != "" {
		return o.Name == pr.Name
	}
	return o.Spec.SignerName == pr.SignerName && sel.Matches(labels.Set(o.Labels))
}

// Run watches the selected objects and keeps the file current until ctx is
// done. A write in progress is finished, never cut short.
func (p *Projector) Run(ctx context.Context) error {
	opts, sel, err := selection(p.Projection)
	if err != nil {
		return err
	}
	client, err := newClient(p.Config, p.Resource.GroupVersion())
	if err != nil {
		return err
	}
	p.start()

	trigger := make(chan struct{}, 1)
	poke := func() {
		select {
		case trigger <- struct{}{}:
		default:
		}
	}
	admit := func(o *clusterTrustBundle) bool { return matches(p.Projection, sel, o) }
	informer, err := p.newInformer(client, opts, admit, poke)
	if err != nil {
		return err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		informer.RunWithContext(ctx)
	}()
	defer func() { <-done }()
	if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		return nil
	}
	poke()
	p.loop(ctx, trigger, func() map[string]string {
		var items []*clusterTrustBundle
		for _, item := range informer.GetStore().List() {
			if o, ok := item.(*clusterTrustBundle); ok {
				items = append(items, o)
			}
		}
		return admitted(admit, items)
	}, func(ctx context.Context) (map[string]string, error) {
		return p.confirm(ctx, client, opts, admit)
	})
	return nil
}

// selection returns the server-side selection of the projection and its
// label selector, checked again on the client.
func selection(pr config.TrustBundleProjection) (metav1.ListOptions, labels.Selector, error) {
	opts, err := ListOptions(pr)
	if err != nil {
		return opts, nil, err
	}
	sel := labels.Everything()
	if pr.LabelSelector != nil {
		if sel, err = metav1.LabelSelectorAsSelector(pr.LabelSelector); err != nil {
			return opts, nil, err
		}
	}
	return opts, sel, nil
}

// newInformer watches the selection through a gate (the caps, and admit
// checked again on the client), and pokes on every change.
func (p *Projector) newInformer(client rest.Interface, opts metav1.ListOptions, admit func(*clusterTrustBundle) bool,
	poke func()) (cache.SharedIndexInformer, error) {
	rejected := func(reason string) {
		if p.Metrics != nil {
			p.Metrics.Rejected(p.Projection.Key(), reason)
		}
	}
	g := newGate(p.MaxBundles, p.MaxBytes, admit, rejected, poke)
	p.rejections = g.Rejections
	informer := cache.NewSharedIndexInformer(g.listWatch(listWatch(client, opts)), &clusterTrustBundle{}, 0, cache.Indexers{})
	_ = informer.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		// Only explains a projection not read yet: after a first sync the
		// file stays right while the informer reconnects.
		p.publish(func(s *Status) {
			if s.Stale {
				s.Reason = fmt.Sprintf("unable to watch %s: %v", p.Resource.GroupResource(), err)
			}
		})
	})
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { poke() },
		UpdateFunc: func(any, any) { poke() },
		DeleteFunc: func(any) { poke() },
	}); err != nil {
		return nil, err
	}
	if p.watching != nil {
		p.watching(informer)
	}
	return informer, nil
}

// confirm reads the selected objects from the API server (a LIST), with
// the same caps as the watch's, on a gate of its own: an object the watch
// keeps out is not assembled here either.
func (p *Projector) confirm(ctx context.Context, client rest.Interface, opts metav1.ListOptions,
	admit func(*clusterTrustBundle) bool) (map[string]string, error) {
	list := &clusterTrustBundleList{}
	if err := client.Get().Resource(Resource).VersionedParams(&opts, metav1.ParameterCodec).Do(ctx).Into(list); err != nil {
		return nil, err
	}
	kept := newGate(p.MaxBundles, p.MaxBytes, admit, func(string) {}, func() {}).filterList(list.Items, true, true)
	items := make([]*clusterTrustBundle, len(kept))
	for i := range kept {
		items[i] = &kept[i]
	}
	return admitted(admit, items), nil
}

// admitted maps the admitted items' names to their trust bundles.
func admitted(admit func(*clusterTrustBundle) bool, items []*clusterTrustBundle) map[string]string {
	objects := map[string]string{}
	for _, o := range items {
		if admit(o) {
			objects[o.Name] = o.Spec.TrustBundle
		}
	}
	return objects
}

// loop syncs the selected objects (from selected, what the watch holds) on
// every trigger and, after a failed write, with exponential backoff
// (RetryInitial to RetryMax). Every ResyncPeriod it reads the objects from
// the API server (confirm) and syncs those: a file changed or removed
// behind the agent's back is put back. LastSync is when the file last
// matched what the server sent (a watch event or the periodic read); a
// watch that went quiet is caught by the periodic read, and while the
// server cannot be read LastSync ages.
func (p *Projector) loop(ctx context.Context, trigger <-chan struct{}, selected func() map[string]string,
	confirm func(context.Context) (map[string]string, error)) {
	retryInitial, retryMax, resyncPeriod := p.RetryInitial, p.RetryMax, p.ResyncPeriod
	if retryInitial <= 0 {
		retryInitial = DefaultRetryInitial
	}
	if retryMax <= 0 {
		retryMax = DefaultRetryMax
	}
	if resyncPeriod <= 0 {
		resyncPeriod = DefaultResyncPeriod
	}
	resync := time.NewTicker(resyncPeriod)
	defer resync.Stop()
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	defer retry.Stop()
	backoff := time.Duration(0)
	for {
		objects := map[string]string(nil)
		select {
		case <-ctx.Done():
			return
		case <-trigger:
		case <-retry.C:
		case <-resync.C:
			var err error
			if objects, err = confirm(ctx); err != nil {
				p.publish(func(s *Status) {
					s.Reason = fmt.Sprintf("unable to confirm with the API server (last sync %s): %v", lastSync(s.LastSync), err)
				})
				continue
			}
		}
		if objects == nil {
			objects = selected()
		}
		if err := p.sync(ctx, objects); err != nil {
			backoff = min(max(2*backoff, retryInitial), retryMax)
			retry.Reset(backoff)
			continue
		}
		backoff = 0
		retry.Stop()
	}
}

// start reads what the projection's directory holds from an earlier run,
// cleans up after an interrupted write and publishes the initial status:
// stale until the first sync.
func (p *Projector) start() {
	pr := p.Projection
	p.writer = NewWriter(pr.Path)
	p.status = Status{Projection: pr.Key(), Resource: p.Resource.GroupVersion().String(), Stale: true, Reason: "not read from the API server yet"}
	if current, err := p.writer.Read(); err != nil {
		p.status.Reason = err.Error()
	} else if current != nil {
		p.status.Certificates = Count(current)
		if fi, err := os.Stat(p.writer.Path()); err == nil {
			p.status.LastUpdate = fi.ModTime()
		}
	}
	if err := p.writer.Cleanup(); err != nil {
		p.status.Reason = err.Error()
	}
	p.publish(nil)
}

// overLimit says how a selection exceeds the caps, or "" when it does not.
func overLimit(n int, size int64, maxBundles int, maxBytes int64) string {
	switch {
	case maxBundles > 0 && n > maxBundles:
		return fmt.Sprintf("refusing %d ClusterTrustBundles: over the limit of %d (agent.maxTrustBundles)", n, maxBundles)
	case maxBytes > 0 && size > maxBytes:
		return fmt.Sprintf("refusing %d bytes of trust bundles: over the limit of %d (agent.maxTrustBundleBytes)", size, maxBytes)
	}
	return ""
}

func lastSync(t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return t.UTC().Format(time.RFC3339)
}

// sync writes the bundle of objects, or keeps the last good content. It
// returns the error of a failed write (worth retrying); a source that is
// missing or invalid is not an error here, its next change triggers a sync.
func (p *Projector) sync(ctx context.Context, objects map[string]string) error {
	if p.rejections != nil {
		if rejected := p.rejections(); len(rejected) > 0 {
			reasons := slices.Sorted(maps.Values(rejected))
			if len(reasons) > 3 {
				reasons = append(reasons[:3], fmt.Sprintf("and %d more", len(rejected)-3))
			}
			p.publish(func(s *Status) {
				s.Stale, s.Reason = true, "refusing the selection: "+strings.Join(reasons, "; ")+"; keeping the last good content"
			})
			return nil
		}
	}
	size := int64(0)
	for _, tb := range objects {
		size += int64(len(tb))
	}
	if over := overLimit(len(objects), size, p.MaxBundles, p.MaxBytes); over != "" {
		p.publish(func(s *Status) { s.Stale, s.Reason = true, over+"; keeping the last good content" })
		return nil
	}
	sources := make([]string, 0, len(objects))
	for n := range objects {
		sources = append(sources, n)
	}
	slices.Sort(sources)
	b, err := Assemble(objects)
	if err != nil {
		reason := err.Error()
		if len(objects) == 0 {
			reason = "no ClusterTrustBundle matches; keeping the last good content"
			if p.Projection.Name != "" {
				reason = fmt.Sprintf("ClusterTrustBundle %s not found; keeping the last good content", p.Projection.Name)
			}
		} else {
			reason = "invalid trust bundle, keeping the last good content: " + reason
		}
		p.publish(func(s *Status) { s.Stale, s.Reason = true, reason })
		return nil
	}
	changed, err := p.writer.Write(b.PEM)
	now := p.now()
	if err != nil {
		p.publish(func(s *Status) { s.Stale, s.Reason = true, err.Error() })
		return err
	}
	if p.Metrics != nil {
		p.Metrics.Synced(p.Projection.Key(), now)
	}
	if changed {
		if p.Metrics != nil {
			p.Metrics.Updated(p.Projection.Key(), b.Certificates, now)
		}
		p.commandErr = ""
		if err := p.runCommand(ctx); err != nil {
			p.commandErr = err.Error()
		}
	}
	p.publish(func(s *Status) {
		s.Sources, s.Certificates, s.LastSync, s.Stale, s.Reason = sources, b.Certificates, now, false, p.commandErr
		if changed {
			s.LastUpdate = now
		}
	})
	return nil
}

// runCommand runs the post-update command. It is not cut short by ctx (a
// reload or stop waits for it), only by CommandTimeout.
func (p *Projector) runCommand(ctx context.Context) error {
	argv := p.Projection.PostUpdateCommand
	if len(argv) == 0 {
		return nil
	}
	timeout := p.CommandTimeout
	if timeout == 0 {
		timeout = DefaultCommandTimeout
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), "TRUST_BUNDLE_PATH="+p.Projection.Path)
	out, err := cmd.CombinedOutput()
	if err != nil {
		msg := strings.TrimSpace(string(out))
		if len(msg) > 512 {
			msg = msg[len(msg)-512:]
		}
		return fmt.Errorf("post-update command %q failed: %w: %s", argv[0], err, msg)
	}
	return nil
}

// publish applies change (if any) to the status and reports it.
func (p *Projector) publish(change func(*Status)) {
	p.mu.Lock()
	wasStale := p.status.Stale
	if change != nil {
		change(&p.status)
	}
	s := p.status
	s.Sources = slices.Clone(s.Sources)
	p.mu.Unlock()
	if p.Metrics != nil && (change == nil || wasStale != s.Stale) {
		p.Metrics.Stale(s.Projection, s.Stale)
	}
	if p.OnStatus != nil {
		p.OnStatus(s)
	}
}

// Manager runs every projection of a configuration against one API server.
type Manager struct {
	// Config reaches the API server as the node.
	Config *rest.Config
	// Projections are the configured projections.
	Projections []config.TrustBundleProjection
	// Metrics and OnStatus are passed to every Projector.
	Metrics  Metrics
	OnStatus func(Status)
	// RetryMax caps the wait between discovery attempts; 0 means a minute.
	RetryMax time.Duration
	// MaxBundles and MaxBytes are every Projector's caps.
	MaxBundles int
	MaxBytes   int64
}

// Run discovers the ClusterTrustBundle API (retrying until the server
// answers) and runs the projections until ctx is done.
func (m *Manager) Run(ctx context.Context) error {
	if len(m.Projections) == 0 {
		return nil
	}
	retryMax := m.RetryMax
	if retryMax == 0 {
		retryMax = time.Minute
	}
	var gvr schema.GroupVersionResource
	var err error
	for wait := time.Second; ; wait = min(2*wait, retryMax) {
		if gvr, err = Discover(ctx, m.Config); err == nil {
			break
		}
		for _, pr := range m.Projections {
			if m.OnStatus != nil {
				m.OnStatus(Status{Projection: pr.Key(), Stale: true, Reason: err.Error()})
			}
			if m.Metrics != nil {
				m.Metrics.Stale(pr.Key(), true)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, len(m.Projections))
	for i, pr := range m.Projections {
		p := &Projector{Config: m.Config, Resource: gvr, Projection: pr, Metrics: m.Metrics, OnStatus: m.OnStatus, MaxBundles: m.MaxBundles, MaxBytes: m.MaxBytes}
		wg.Go(func() { errs[i] = p.Run(ctx) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// RemoveStale removes the files of projections at previous paths that
// current no longer has (see Writer.Remove). A directory that a current
// projection uses is left alone, whatever its file name.
func RemoveStale(previous []string, current []config.TrustBundleProjection) error {
	inUse := map[string]bool{}
	for _, pr := range current {
		inUse[filepath.Dir(filepath.Clean(pr.Path))] = true
	}
	var errs []error
	for _, path := range previous {
		if path == "" || !filepath.IsAbs(path) || inUse[filepath.Dir(filepath.Clean(path))] {
			continue
		}
		if err := NewWriter(filepath.Clean(path)).Remove(); err != nil {
			errs = append(errs, fmt.Errorf("unable to remove the former projection %s: %w", path, err))
		}
	}
	return errors.Join(errs...)
}
