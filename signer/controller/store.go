package controller

import (
	"bytes"
	"sync"
	"sync/atomic"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/client-go/tools/cache"

	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
)

// csrStore caches the CSRs of one signer name. A reflector (watched signer
// names) or the periodic list (the others, sweep.go) fills it; it cuts each
// request to what the signer reads (forgetUnread) before keeping it, and
// tells the controller of every change as it is stored: pending requests
// are queued, and the cache budget is kept.
//
// It takes the place of an informer, whose event buffers (a growing ring
// per handler) and goroutines (four per informer and two per handler)
// would be most of what an idle workload cluster costs: a store fed
// straight by its reflector needs nothing running but the reflector.
type csrStore struct {
	cache.Indexer
	// changed is told of each change: old is nil when obj is new, obj nil
	// when old was deleted.
	changed func(old, obj *certificatesv1.CertificateSigningRequest)
	synced  atomic.Bool

	// nodes holds the node name each cached request waiting on a
	// challenge asks for, parsed once as the request is stored: the
	// waiting index reads it for the old and the new version of every
	// change, which would otherwise parse the request's PKCS#10 again each
	// time. It is keyed by the cached value itself (what the index is
	// handed), so that an entry can never describe another version of a
	// request, and an entry goes when its value leaves the store.
	mu    sync.Mutex
	nodes map[*certificatesv1.CertificateSigningRequest]requested
}

// requested is the node name a request asks for, ok false when its
// spec.request names none (checks.RequestedNodeName).
type requested struct {
	node string
	ok   bool
}

func newCSRStore(changed func(old, obj *certificatesv1.CertificateSigningRequest)) *csrStore {
	s := &csrStore{changed: changed, nodes: map[*certificatesv1.CertificateSigningRequest]requested{}}
	s.Indexer = cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{byRequester: requesterKeys, waiting: s.waitingKeys})
	return s
}

// byRequester indexes CSRs, decided ones too, by requester.
const byRequester = "requester"

func requesterKeys(obj any) ([]string, error) {
	if csr, ok := obj.(*certificatesv1.CertificateSigningRequest); ok {
		return []string{csr.Spec.Username}, nil
	}
	return nil, nil
}

// waiting indexes the CSRs waiting on a challenge (engine.WaitingOnChallenge):
// all of them under one key, and each under its requester's and under its
// requester's and the node name it asks for. These are the only requests
// the pending bounds count, so that counting them reads none of the many
// decided ones a fleet's shared bootstrap token leaves in the cache, and
// only they are parsed for a node name.
const waiting = "waiting"

func waitingKey(username, nodeName string) string {
	switch {
	case username == "":
		return "all"
	case nodeName == "":
		return "requester:" + username
	}
	return "node:" + username + "\x00" + nodeName
}

func (s *csrStore) waitingKeys(obj any) ([]string, error) {
	csr, ok := obj.(*certificatesv1.CertificateSigningRequest)
	if !ok || !engine.WaitingOnChallenge(csr) {
		return nil, nil
	}
	keys := []string{waitingKey("", ""), waitingKey(csr.Spec.Username, "")}
	s.mu.Lock()
	r, known := s.nodes[csr]
	s.mu.Unlock()
	if !known {
		r = requestedNode(csr)
	}
	if r.ok {
		keys = append(keys, waitingKey(csr.Spec.Username, r.node))
	}
	return keys, nil
}

func requestedNode(csr *certificatesv1.CertificateSigningRequest) requested {
	node, ok := checks.RequestedNodeName(csr.Spec.Request)
	return requested{node: node, ok: ok}
}

// remember parses the node name csr asks for, when it waits on a
// challenge, before it is stored in place of old (nil when it is new). A
// new version of a request with the same spec.request takes old's.
func (s *csrStore) remember(csr, old *certificatesv1.CertificateSigningRequest) {
	if !engine.WaitingOnChallenge(csr) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r, known := s.nodes[old]
	if !known || !bytes.Equal(old.Spec.Request, csr.Spec.Request) {
		r = requestedNode(csr)
	}
	s.nodes[csr] = r
}

// forget drops what was remembered of old, a value that left the store.
func (s *csrStore) forget(old *certificatesv1.CertificateSigningRequest) {
	s.mu.Lock()
	delete(s.nodes, old)
	s.mu.Unlock()
}

// cut returns obj as cached, nil when it is no CSR.
func cut(obj any) *certificatesv1.CertificateSigningRequest {
	csr, ok := obj.(*certificatesv1.CertificateSigningRequest)
	if !ok {
		return nil
	}
	out, _ := forgetUnread(csr)
	return out.(*certificatesv1.CertificateSigningRequest)
}

func (s *csrStore) cached(key string) *certificatesv1.CertificateSigningRequest {
	obj, ok, _ := s.GetByKey(key)
	if !ok {
		return nil
	}
	csr, _ := obj.(*certificatesv1.CertificateSigningRequest)
	return csr
}

// Add implements cache.ReflectorStore.
func (s *csrStore) Add(obj any) error { return s.Update(obj) }

// Update implements cache.ReflectorStore.
func (s *csrStore) Update(obj any) error {
	csr := cut(obj)
	if csr == nil {
		return nil
	}
	old := s.cached(csr.Name)
	s.remember(csr, old)
	if err := s.Indexer.Update(csr); err != nil {
		s.forget(csr)
		return err
	}
	if old != nil && old != csr {
		s.forget(old)
	}
	s.changed(old, csr)
	return nil
}

// Delete implements cache.ReflectorStore.
func (s *csrStore) Delete(obj any) error {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	csr, ok := obj.(*certificatesv1.CertificateSigningRequest)
	if !ok {
		return nil
	}
	old := s.cached(csr.Name)
	if old == nil {
		return nil
	}
	if err := s.Indexer.Delete(old); err != nil {
		return err
	}
	s.forget(old)
	s.changed(old, nil)
	return nil
}

// Replace implements cache.ReflectorStore: the store holds list, and the
// controller is told what was added, changed and deleted.
func (s *csrStore) Replace(list []any, resourceVersion string) error {
	olds := map[string]*certificatesv1.CertificateSigningRequest{}
	for _, obj := range s.List() {
		if csr, ok := obj.(*certificatesv1.CertificateSigningRequest); ok {
			olds[csr.Name] = csr
		}
	}
	csrs := make([]*certificatesv1.CertificateSigningRequest, 0, len(list))
	items := make([]any, 0, len(list))
	nodes := map[*certificatesv1.CertificateSigningRequest]requested{}
	for _, obj := range list {
		if csr := cut(obj); csr != nil {
			csrs = append(csrs, csr)
			items = append(items, csr)
			if engine.WaitingOnChallenge(csr) {
				nodes[csr] = requestedNode(csr)
			}
		}
	}
	// The index is built anew from items alone: what was remembered of
	// the values replaced goes with them.
	s.mu.Lock()
	s.nodes = nodes
	s.mu.Unlock()
	if err := s.Indexer.Replace(items, resourceVersion); err != nil {
		return err
	}
	for _, csr := range csrs {
		old := olds[csr.Name]
		delete(olds, csr.Name)
		s.changed(old, csr)
	}
	for _, old := range olds {
		s.changed(old, nil)
	}
	s.synced.Store(true)
	return nil
}

// Resync implements cache.ReflectorStore; the controller queues pending
// requests again on a timer of its own (Config.ResyncPeriod).
func (s *csrStore) Resync() error { return nil }

// HasSynced reports whether the store was filled once.
func (s *csrStore) HasSynced() bool { return s.synced.Load() }
