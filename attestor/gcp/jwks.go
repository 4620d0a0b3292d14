package gcp

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/go-jose/go-jose/v4"
)

// keySet caches a JWKS: it is fetched when first needed, again when older
// than refresh, and again (at most once per minRefresh) when a token names a
// key it does not hold, so Google's key rotation needs no restart.
type keySet struct {
	url        string
	client     httpDoer
	refresh    time.Duration
	minRefresh time.Duration

	mu      sync.Mutex
	keys    map[string]*jose.JSONWebKey
	fetched time.Time
}

// key returns the key with kid at time now (the verifier's clock). A nil
// key with a nil error means the JWKS has no such key; an error means the
// JWKS could not be read.
func (s *keySet) key(ctx context.Context, kid string, now time.Time) (*jose.JSONWebKey, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	stale := s.keys == nil || now.Sub(s.fetched) >= s.refresh
	if k, ok := s.keys[kid]; ok && !stale {
		return k, nil
	}
	if !stale && now.Sub(s.fetched) < s.minRefresh {
		return nil, nil
	}
	if err := s.fetch(ctx, now); err != nil {
		if k, ok := s.keys[kid]; ok {
			return k, nil // keep using what we have while the JWKS is unreachable
		}
		return nil, err
	}
	return s.keys[kid], nil
}

func (s *keySet) fetch(ctx context.Context, now time.Time) error {
	r, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url, nil)
	if err != nil {
		return err
	}
	resp, err := s.client.Do(r)
	if err != nil {
		return fmt.Errorf("unable to fetch JWKS %s: %w", s.url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("JWKS %s answered %s", s.url, resp.Status)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("unable to read JWKS %s: %w", s.url, err)
	}
	var set jose.JSONWebKeySet
	if err := json.Unmarshal(body, &set); err != nil {
		return fmt.Errorf("unable to parse JWKS %s: %w", s.url, err)
	}
	keys := map[string]*jose.JSONWebKey{}
	for i := range set.Keys {
		k := &set.Keys[i]
		if k.KeyID == "" || !k.IsPublic() || (k.Use != "" && k.Use != "sig") {
			continue
		}
		keys[k.KeyID] = k
	}
	s.keys, s.fetched = keys, now
	return nil
}
