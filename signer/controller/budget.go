package controller

import (
	"sync"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/client-go/tools/cache"
)

// budget counts the CSRs the informers cache, and their bytes as cached
// (after the transform), and says once when either reaches its bound: a
// workload cluster's requests are tenant input, and the controller stops
// serving a cluster rather than grow without bound for it.
type budget struct {
	maxObjects int
	maxBytes   int64
	over       func(objects int, bytes int64)

	mu       sync.Mutex
	objects  int
	bytes    int64
	exceeded bool
}

// size is what a cached CSR weighs: its protobuf size, close to what it
// holds in memory.
func size(obj any) (int64, bool) {
	switch o := obj.(type) {
	case *certificatesv1.CertificateSigningRequest:
		return int64(o.Size()), true
	case cache.DeletedFinalStateUnknown:
		return size(o.Obj)
	}
	return 0, false
}

func (b *budget) add(objects int, bytes int64) {
	b.mu.Lock()
	b.objects += objects
	b.bytes += bytes
	over := !b.exceeded && b.over != nil &&
		((b.maxObjects > 0 && b.objects >= b.maxObjects) || (b.maxBytes > 0 && b.bytes >= b.maxBytes))
	if over {
		b.exceeded = true
	}
	objs, n := b.objects, b.bytes
	b.mu.Unlock()
	if over {
		b.over(objs, n)
	}
}

// Cached returns the CSRs cached and their bytes.
func (c *Controller) Cached() (objects int, bytes int64) {
	c.budget.mu.Lock()
	defer c.budget.mu.Unlock()
	return c.budget.objects, c.budget.bytes
}

func (b *budget) handler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if n, ok := size(obj); ok {
				b.add(1, n)
			}
		},
		UpdateFunc: func(old, obj any) {
			o, ok1 := size(old)
			n, ok2 := size(obj)
			if ok1 && ok2 {
				b.add(0, n-o)
			}
		},
		DeleteFunc: func(obj any) {
			if n, ok := size(obj); ok {
				b.add(-1, -n)
			}
		},
	}
}
