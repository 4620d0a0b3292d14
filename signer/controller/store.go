package controller

import (
	"sync/atomic"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/client-go/tools/cache"
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
}

func newCSRStore(changed func(old, obj *certificatesv1.CertificateSigningRequest)) *csrStore {
	return &csrStore{
		Indexer: cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{byRequester: requesterKeys, waiting: waitingKeys}),
		changed: changed,
	}
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
	if err := s.Indexer.Update(csr); err != nil {
		return err
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
	for _, obj := range list {
		if csr := cut(obj); csr != nil {
			csrs = append(csrs, csr)
			items = append(items, csr)
		}
	}
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
