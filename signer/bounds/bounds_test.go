package bounds

import (
	"encoding/binary"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestBounds(t *testing.T) {
	limits := Limits{MaxResponseBytes: 1 << 20, MaxEventBytes: 64 << 10, RequestTimeout: 300 * time.Millisecond, WatchIdleTimeout: time.Second}
	chunk := strings.Repeat("x", 32<<10)
	drip := func(w http.ResponseWriter, n int, every time.Duration, s string) {
		for range n {
			if _, err := io.WriteString(w, s); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			time.Sleep(every)
		}
	}
	for _, tc := range []struct {
		name    string
		path    string
		handler http.HandlerFunc
		limit   string // "" when within bounds
	}{
		{name: "within bounds", path: "/api", handler: func(w http.ResponseWriter, _ *http.Request) {
			_, _ = io.WriteString(w, strings.Repeat(chunk, 32)) // exactly the bound
		}},
		{name: "declared too large", path: "/api", handler: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", "50331648")
			drip(w, 1, 0, chunk)
		}, limit: LimitResponseSize},
		{name: "streamed too large", path: "/api", handler: func(w http.ResponseWriter, _ *http.Request) {
			drip(w, 1536, 0, chunk)
		}, limit: LimitResponseSize},
		{name: "slow drip", path: "/api", handler: func(w http.ResponseWriter, _ *http.Request) {
			drip(w, 100, 20*time.Millisecond, "x")
		}, limit: LimitTimeout},
		{name: "slow headers", path: "/api", handler: func(w http.ResponseWriter, _ *http.Request) {
			time.Sleep(time.Second)
		}, limit: LimitTimeout},
		{name: "watch within bounds", path: "/api?watch=true", handler: func(w http.ResponseWriter, _ *http.Request) {
			drip(w, 20, 100*time.Millisecond, `{"type":"BOOKMARK"}`+"\n") // 2s in all, an event every 100ms
		}},
		{name: "watch event too large", path: "/api?watch=true", handler: func(w http.ResponseWriter, _ *http.Request) {
			drip(w, 100, 0, chunk)
		}, limit: LimitEventSize},
		{name: "watch event dripped", path: "/api?watch=true", handler: func(w http.ResponseWriter, _ *http.Request) {
			drip(w, 100, 20*time.Millisecond, "x")
		}, limit: LimitEventTimeout},
		{name: "watch of blank lines", path: "/api?watch=true", handler: func(w http.ResponseWriter, _ *http.Request) {
			drip(w, 100, 20*time.Millisecond, "\n")
		}, limit: LimitWatchIdle},
		{name: "protobuf frame too large", path: "/api?watch=true", handler: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/vnd.kubernetes.protobuf;stream=watch")
			var h [4]byte
			binary.BigEndian.PutUint32(h[:], 1<<30)
			_, _ = w.Write(h[:])
			drip(w, 1, 0, chunk)
		}, limit: LimitEventSize},
		// A watch the API server refuses (while it starts, before its
		// authorizer has its policy) is answered with one Status, not a
		// stream: in protobuf, its "k8s\x00" magic is no frame length.
		{name: "watch refused in protobuf", path: "/api?watch=true", handler: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/vnd.kubernetes.protobuf")
			w.WriteHeader(http.StatusForbidden)
			_, _ = io.WriteString(w, "k8s\x00\n\x0c\n\x02v1\x12\x06Status")
		}},
		{name: "watch refused too large", path: "/api?watch=true", handler: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/vnd.kubernetes.protobuf")
			w.WriteHeader(http.StatusInternalServerError)
			drip(w, 1536, 0, chunk)
		}, limit: LimitResponseSize},
		{name: "protobuf frames within bounds", path: "/api?watch=true", handler: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/vnd.kubernetes.protobuf;stream=watch")
			for range 10 {
				var h [4]byte
				binary.BigEndian.PutUint32(h[:], uint32(len(chunk)))
				_, _ = w.Write(h[:])
				drip(w, 1, 100*time.Millisecond, chunk)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewTLSServer(tc.handler)
			defer srv.Close()
			var mu sync.Mutex
			var reported []*ExceededError
			rt := limits.Wrap(func(e *ExceededError) {
				mu.Lock()
				reported = append(reported, e)
				mu.Unlock()
			})(srv.Client().Transport)
			req, _ := http.NewRequest(http.MethodGet, srv.URL+tc.path, nil)
			var err error
			var n int64
			resp, err := rt.RoundTrip(req)
			if err == nil {
				n, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			var e *ExceededError
			switch {
			case tc.limit == "" && err != nil:
				t.Fatalf("read %d bytes, then %v", n, err)
			case tc.limit == "":
			case !errors.As(err, &e):
				t.Fatalf("read %d bytes, then %v; want an *ExceededError", n, err)
			case e.Limit != tc.limit:
				t.Fatalf("exceeded %s, want %s: %v", e.Limit, tc.limit, e)
			}
			if n > limits.MaxResponseBytes {
				t.Errorf("read %d bytes of one answer", n)
			}
			mu.Lock()
			defer mu.Unlock()
			if want := min(len(tc.limit), 1); len(reported) != want {
				t.Errorf("reported %d times, want %d: %v", len(reported), want, reported)
			}
		})
	}
}
