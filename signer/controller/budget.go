package controller

import (
	"sync"

	certificatesv1 "k8s.io/api/certificates/v1"
)

// budget counts the CSRs the stores cache, and their bytes as cached
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

// changed counts a change to a store (csrStore): old is nil when obj is
// new, obj nil when old was deleted. A CSR weighs its protobuf size as
// cached, close to what it holds in memory.
func (b *budget) changed(old, obj *certificatesv1.CertificateSigningRequest) {
	var objects int
	var n int64
	if old != nil {
		objects--
		n -= int64(old.Size())
	}
	if obj != nil {
		objects++
		n += int64(obj.Size())
	}
	b.add(objects, n)
}
