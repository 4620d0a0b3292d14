package trustbundle

import (
	"fmt"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
)

func ctb(name, rv string, size int) *clusterTrustBundle {
	return &clusterTrustBundle{ObjectMeta: metav1.ObjectMeta{Name: name, ResourceVersion: rv}, Spec: clusterTrustBundleSpec{TrustBundle: strings.Repeat("x", size)}}
}

// TestGate: what enters the store, what is kept out and counted, on lists
// (paged) and watch events, the decisions as values without a server.
func TestGate(t *testing.T) {
	counted := map[string]int{}
	changes := 0
	g := newGate(2, 100, func(o *clusterTrustBundle) bool { return !strings.HasPrefix(o.Name, "other") },
		func(r string) { counted[r]++ }, func() { changes++ })

	// A list in two pages: the oversized and the unselected are dropped,
	// the third admissible object is over the count.
	page1 := []clusterTrustBundle{*ctb("a", "1", 10), *ctb("big", "2", 101), *ctb("other", "3", 10)}
	if kept := g.filterList(page1, true, false); len(kept) != 1 || kept[0].Name != "a" {
		t.Fatalf("page 1 kept %v", kept)
	}
	if len(g.Rejections()) != 0 {
		t.Fatal("rejections visible before the list is complete")
	}
	page2 := []clusterTrustBundle{*ctb("b", "4", 100), *ctb("c", "5", 10)}
	if kept := g.filterList(page2, false, true); len(kept) != 1 || kept[0].Name != "b" {
		t.Fatalf("page 2 kept %v", kept)
	}
	r := g.Rejections()
	if len(r) != 2 || !strings.Contains(r["big"], "agent.maxTrustBundleBytes") || !strings.Contains(r["c"], "agent.maxTrustBundles") {
		t.Fatalf("rejections %q", r)
	}
	if counted[RejectedTooLarge] != 1 || counted[RejectedTooMany] != 1 || changes != 1 {
		t.Fatalf("counted %v, %d changes", counted, changes)
	}

	for _, c := range []struct {
		name   string
		event  watch.Event
		want   []watch.EventType
		relist bool
		count  map[string]int
	}{
		{"same version of big again: not counted twice", watch.Event{Type: watch.Modified, Object: ctb("big", "2", 101)}, nil, false, map[string]int{RejectedTooLarge: 1}},
		{"new version of big: counted", watch.Event{Type: watch.Modified, Object: ctb("big", "6", 150)}, nil, false, map[string]int{RejectedTooLarge: 2}},
		{"a grows over the cap: out of the store", watch.Event{Type: watch.Modified, Object: ctb("a", "7", 101)}, []watch.EventType{watch.Deleted}, false, map[string]int{RejectedTooLarge: 3}},
		{"b shrinks: stays", watch.Event{Type: watch.Modified, Object: ctb("b", "8", 5)}, []watch.EventType{watch.Modified}, false, nil},
		{"c fits now that a left", watch.Event{Type: watch.Modified, Object: ctb("c", "9", 5)}, []watch.EventType{watch.Modified}, false, nil},
		{"d over the count", watch.Event{Type: watch.Added, Object: ctb("d", "10", 5)}, nil, false, map[string]int{RejectedTooMany: 2}},
		{"b deleted: room for d, list again", watch.Event{Type: watch.Deleted, Object: ctb("b", "11", 5)}, []watch.EventType{watch.Deleted}, true, nil},
		{"an unselected object never enters", watch.Event{Type: watch.Added, Object: ctb("other-2", "12", 5)}, nil, false, nil},
	} {
		out, relist := g.filterEvent(c.event, false)
		var types []watch.EventType
		for _, e := range out {
			types = append(types, e.Type)
			if o := e.Object.(*clusterTrustBundle); len(o.Spec.TrustBundle) > 100 {
				t.Errorf("%s: an oversized object passed to the store", c.name)
			}
		}
		if strings.Join(eventTypes(types), ",") != strings.Join(eventTypes(c.want), ",") || relist != c.relist {
			t.Errorf("%s: events %v relist %t, want %v %t", c.name, types, relist, c.want, c.relist)
		}
		for reason, n := range c.count {
			if counted[reason] != n {
				t.Errorf("%s: %s counted %d, want %d", c.name, reason, counted[reason], n)
			}
		}
	}
}

func eventTypes(ts []watch.EventType) []string {
	out := make([]string, len(ts))
	for i, t := range ts {
		out[i] = string(t)
	}
	return out
}

// TestGateRemembersBoundedNames: however many objects are kept out, the
// gate remembers at most maxRejectedNames of them by name, still refuses
// the selection for the rest, and lists again on a deletion to learn what
// remains.
func TestGateRemembersBoundedNames(t *testing.T) {
	g := newGate(1, 100, func(*clusterTrustBundle) bool { return true }, func(string) {}, func() {})
	const n = 4 * maxRejectedNames
	items := []clusterTrustBundle{*ctb("ok", "1", 10)}
	for i := range n {
		items = append(items, *ctb(fmt.Sprintf("big-%d", i), fmt.Sprint(i+2), 101))
	}
	if kept := g.filterList(items, true, true); len(kept) != 1 || kept[0].Name != "ok" {
		t.Fatalf("kept %d objects, want only ok", len(kept))
	}
	if named := len(g.cur.rejected); named != maxRejectedNames {
		t.Fatalf("%d rejections remembered by name, want %d", named, maxRejectedNames)
	}
	r := g.Rejections()
	if len(r) != maxRejectedNames+1 || !strings.Contains(r["/unnamed"], fmt.Sprintf("%d more", n-maxRejectedNames)) {
		t.Fatalf("%d rejections, unnamed %q", len(r), r["/unnamed"])
	}
	// Any deletion while some are unnamed asks for a list.
	if _, relist := g.filterEvent(watch.Event{Type: watch.Deleted, Object: ctb("big-3", "9999", 101)}, false); !relist {
		t.Error("a deletion with unnamed rejections did not ask for a list")
	}
	// The list that follows finds them gone and forgets the count.
	if kept := g.filterList([]clusterTrustBundle{*ctb("ok", "1", 10)}, true, true); len(kept) != 1 {
		t.Fatalf("kept %d", len(kept))
	}
	if r := g.Rejections(); len(r) != 0 {
		t.Fatalf("%d rejections remain after a clean list", len(r))
	}
}
