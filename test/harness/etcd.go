package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"testing"
	"time"
)

// CompactEtcd compacts the control plane's etcd at its current revision,
// as kube-apiserver's own compactor does every --etcd-compaction-interval,
// and returns that revision: every older one is gone, so a watch from an
// older resource version is answered 410 Gone ("too old resource
// version") by a kube-apiserver that reads etcd directly
// (--watch-cache=false). It talks to etcd's gRPC gateway (JSON over HTTP).
func (cp *ControlPlane) CompactEtcd(tb testing.TB) int64 {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var rng struct {
		Header struct {
			Revision string `json:"revision"`
		} `json:"header"`
	}
	// Any range answers with the store's current revision in its header.
	if err := cp.etcdCall(ctx, "/v3/kv/range", map[string]any{"key": "AA==", "count_only": true}, &rng); err != nil {
		tb.Fatalf("control plane %s: unable to read etcd's revision: %v", cp.Name, err)
	}
	rev, err := strconv.ParseInt(rng.Header.Revision, 10, 64)
	if err != nil {
		tb.Fatalf("control plane %s: etcd revision %q: %v", cp.Name, rng.Header.Revision, err)
	}
	if err := cp.etcdCall(ctx, "/v3/kv/compaction", map[string]any{"revision": strconv.FormatInt(rev, 10), "physical": true}, nil); err != nil {
		tb.Fatalf("control plane %s: unable to compact etcd at revision %d: %v", cp.Name, rev, err)
	}
	return rev
}

// etcdCall posts req as JSON to path of etcd's gRPC gateway and decodes
// the answer into resp (when not nil).
func (cp *ControlPlane) etcdCall(ctx context.Context, path string, req, resp any) error {
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, cp.etcdURL+path, bytes.NewReader(body))
	if err != nil {
		return err
	}
	r.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(r)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	if err != nil {
		return err
	}
	if res.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s: %s", path, res.Status, b)
	}
	if resp == nil {
		return nil
	}
	return json.Unmarshal(b, resp)
}
