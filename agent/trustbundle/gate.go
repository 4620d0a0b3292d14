package trustbundle

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"sync"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
)

// Reasons a ClusterTrustBundle is kept out of a projection's watch cache,
// as Metrics.Rejected is told them.
const (
	// RejectedTooLarge: its spec.trustBundle alone is over
	// agent.maxTrustBundleBytes.
	RejectedTooLarge = "too-large"
	// RejectedTooMany: the cache already holds agent.maxTrustBundles objects.
	RejectedTooMany = "too-many"
)

// rejection is why one object was kept out, at which resourceVersion.
type rejection struct {
	reason          string
	size            int
	resourceVersion string
}

func (r rejection) String(name string, maxBundles int, maxBytes int64) string {
	if r.reason == RejectedTooLarge {
		return fmt.Sprintf("ClusterTrustBundle %s holds %d bytes, over the limit of %d (agent.maxTrustBundleBytes)", name, r.size, maxBytes)
	}
	return fmt.Sprintf("ClusterTrustBundle %s is over the limit of %d objects (agent.maxTrustBundles)", name, maxBundles)
}

// maxRejectedNames bounds how many kept-out objects a gate remembers by
// name. The API server may hold any number of them; past this many, the
// gate only counts them (gateState.unnamed), which is enough to refuse the
// selection, and lists again when an object it cannot place is deleted.
const maxRejectedNames = 256

// gateState is what a projection's watch cache holds (admitted names) and
// what was kept out of it: by name, and past maxRejectedNames as a count.
type gateState struct {
	admitted map[string]bool
	rejected map[string]rejection
	unnamed  int
}

func newGateState() *gateState {
	return &gateState{admitted: map[string]bool{}, rejected: map[string]rejection{}}
}

// gate admits ClusterTrustBundles into a projection's watch cache. It sits
// in the list-watch path, after decoding and before the informer's store:
// an object the projection did not select, one whose spec.trustBundle is
// over maxBytes, and any beyond maxBundles objects never enter the store,
// so the agent (which also renews the client certificate) holds at most
// maxBundles objects of at most maxBytes each, however many the API
// server has. What was kept out is remembered by name, so that the
// projection refuses the selection (and keeps its last good content)
// rather than write it without them.
type gate struct {
	maxBundles int
	maxBytes   int64
	// admit says whether the projection selected o.
	admit func(o *clusterTrustBundle) bool
	// rejected is called for every object kept out (once per
	// resourceVersion); changed after the rejections changed.
	rejected func(reason string)
	changed  func()

	mu sync.Mutex
	// cur is what the store holds; next, during a list or a watch's
	// initial events, what it will hold once they are complete.
	cur, next *gateState
}

func newGate(maxBundles int, maxBytes int64, admit func(*clusterTrustBundle) bool, rejected func(string), changed func()) *gate {
	return &gate{maxBundles: maxBundles, maxBytes: maxBytes, admit: admit, rejected: rejected, changed: changed, cur: newGateState()}
}

// Rejections returns why each object kept out of the store was.
func (g *gate) Rejections() map[string]string {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make(map[string]string, len(g.cur.rejected)+1)
	for n, r := range g.cur.rejected {
		out[n] = r.String(n, g.maxBundles, g.maxBytes)
	}
	if g.cur.unnamed > 0 {
		// Not a valid object name, so it cannot collide with one.
		out["/unnamed"] = fmt.Sprintf("%d more ClusterTrustBundles over agent.maxTrustBundleBytes or agent.maxTrustBundles", g.cur.unnamed)
	}
	return out
}

// check decides on o against st: "" admits it.
func (g *gate) check(st *gateState, o *clusterTrustBundle) string {
	if g.maxBytes > 0 && int64(len(o.Spec.TrustBundle)) > g.maxBytes {
		return RejectedTooLarge
	}
	if g.maxBundles > 0 && !st.admitted[o.Name] && len(st.admitted) >= g.maxBundles {
		return RejectedTooMany
	}
	return ""
}

// place records o in st and reports whether it goes into the store. The
// caller holds g.mu and calls g.notify afterwards.
func (g *gate) place(st *gateState, o *clusterTrustBundle) (admitted, changed bool) {
	if reason := g.check(st, o); reason != "" {
		old, had := st.rejected[o.Name]
		if !had && len(st.rejected) >= maxRejectedNames {
			// Counted, not remembered: the count only grows until the next
			// list recomputes it.
			st.unnamed++
			delete(st.admitted, o.Name)
			g.rejected(reason)
			return false, st.unnamed == 1
		}
		r := rejection{reason: reason, size: len(o.Spec.TrustBundle), resourceVersion: o.ResourceVersion}
		st.rejected[o.Name] = r
		delete(st.admitted, o.Name)
		if !had || old.resourceVersion != r.resourceVersion {
			g.rejected(reason)
		}
		return false, !had || old.reason != r.reason
	}
	_, had := st.rejected[o.Name]
	delete(st.rejected, o.Name)
	st.admitted[o.Name] = true
	return true, had
}

// begin starts a new state for a list or a watch's initial events.
func (g *gate) begin() {
	g.mu.Lock()
	g.next = newGateState()
	g.mu.Unlock()
}

// commit makes the new state current: the store is replaced with it.
func (g *gate) commit() {
	g.mu.Lock()
	changed := g.next != nil && (!maps.Equal(g.next.rejected, g.cur.rejected) || g.next.unnamed != g.cur.unnamed)
	if g.next != nil {
		g.cur, g.next = g.next, nil
	}
	g.mu.Unlock()
	if changed {
		g.changed()
	}
}

// filterList keeps out of items what the gate does not admit; first says
// the list starts a new state, last that it completes it.
func (g *gate) filterList(items []clusterTrustBundle, first, last bool) []clusterTrustBundle {
	if first {
		g.begin()
	}
	g.mu.Lock()
	st := g.next
	if st == nil { // a page without its first one: count against the current state
		st = g.cur
	}
	kept := items[:0]
	for i := range items {
		o := &items[i]
		if !g.admit(o) {
			continue
		}
		if ok, _ := g.place(st, o); ok {
			kept = append(kept, *o)
		}
	}
	clear(items[len(kept):])
	g.mu.Unlock()
	if last {
		g.commit()
	}
	return kept
}

// filterEvent turns one watch event into the events the store gets
// (none, the same, or a Deleted for an object that may no longer stay)
// and whether the reflector must list again: a deletion made room for
// an object kept out for their number.
func (g *gate) filterEvent(e watch.Event, initial bool) (out []watch.Event, relist bool) {
	o, ok := e.Object.(*clusterTrustBundle)
	if !ok {
		return []watch.Event{e}, false
	}
	g.mu.Lock()
	st := g.cur
	if initial && g.next != nil {
		st = g.next
	}
	changed := false
	switch e.Type {
	case watch.Bookmark:
		g.mu.Unlock()
		if initial && o.Annotations[metav1.InitialEventsAnnotationKey] == "true" {
			g.commit()
		}
		return []watch.Event{e}, false
	case watch.Added, watch.Modified:
		if !g.admit(o) {
			// Deselected (a label changed): out of the store if it was in.
			_, had := st.rejected[o.Name]
			changed = had
			delete(st.rejected, o.Name)
			if st.admitted[o.Name] {
				delete(st.admitted, o.Name)
				out = append(out, watch.Event{Type: watch.Deleted, Object: o})
			}
			break
		}
		wasIn := st.admitted[o.Name]
		var admitted bool
		admitted, changed = g.place(st, o)
		switch {
		case admitted:
			out = append(out, e)
		case wasIn:
			// Grew over the cap: the store must not keep the old version.
			o = o.DeepCopyObject().(*clusterTrustBundle)
			o.Spec.TrustBundle = ""
			out = append(out, watch.Event{Type: watch.Deleted, Object: o})
		}
	case watch.Deleted:
		_, had := st.rejected[o.Name]
		changed = had
		delete(st.rejected, o.Name)
		delete(st.admitted, o.Name)
		out = append(out, e)
		tooMany := g.maxBundles > 0 && len(st.admitted) < g.maxBundles &&
			slices.ContainsFunc(slices.Collect(maps.Values(st.rejected)), func(r rejection) bool { return r.reason == RejectedTooMany })
		// With objects kept out unnamed, only a list can tell what remains
		// kept out, and whether one of them now fits.
		relist = tooMany || st.unnamed > 0
	default:
		out = append(out, e)
	}
	notify := changed && st == g.cur
	g.mu.Unlock()
	if notify {
		g.changed()
	}
	return out, relist
}

// listWatch wraps lw's list and watch with the gate.
func (g *gate) listWatch(lw *cache.ListWatch) *cache.ListWatch {
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			obj, err := lw.ListWithContextFunc(ctx, o)
			if err != nil {
				return obj, err
			}
			if l, ok := obj.(*clusterTrustBundleList); ok {
				l.Items = g.filterList(l.Items, o.Continue == "", l.Continue == "")
			}
			return obj, nil
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			initial := o.SendInitialEvents != nil && *o.SendInitialEvents
			w, err := lw.WatchFuncWithContext(ctx, o)
			if err != nil {
				return nil, err
			}
			if initial {
				g.begin()
			}
			gw := &gatedWatch{in: w, out: make(chan watch.Event), stop: make(chan struct{})}
			go gw.run(g, initial)
			return gw, nil
		},
	}
}

// gatedWatch passes a watch's events through the gate.
type gatedWatch struct {
	in   watch.Interface
	out  chan watch.Event
	stop chan struct{}
	once sync.Once
}

func (w *gatedWatch) Stop() {
	w.once.Do(func() {
		close(w.stop)
		w.in.Stop()
	})
}

func (w *gatedWatch) ResultChan() <-chan watch.Event { return w.out }

func (w *gatedWatch) run(g *gate, initial bool) {
	defer close(w.out)
	send := func(e watch.Event) bool {
		select {
		case w.out <- e:
			return true
		case <-w.stop:
			return false
		}
	}
	for {
		var e watch.Event
		var ok bool
		select {
		case <-w.stop:
			return
		case e, ok = <-w.in.ResultChan():
			if !ok {
				return
			}
		}
		events, relist := g.filterEvent(e, initial)
		for _, out := range events {
			if !send(out) {
				return
			}
		}
		if e.Type == watch.Bookmark && initial {
			if o, isCTB := e.Object.(*clusterTrustBundle); isCTB && o.Annotations[metav1.InitialEventsAnnotationKey] == "true" {
				initial = false
			}
		}
		if relist {
			// Room for an object kept out for the number of objects: an
			// expired watch makes the reflector list again.
			send(watch.Event{Type: watch.Error, Object: &metav1.Status{Status: metav1.StatusFailure, Code: http.StatusGone,
				Reason: metav1.StatusReasonExpired, Message: "a ClusterTrustBundle kept out for agent.maxTrustBundles may fit now"}})
			return
		}
	}
}
