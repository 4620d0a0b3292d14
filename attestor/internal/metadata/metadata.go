// Package metadata is the one way the node halves of the cloud attestors
// talk to their provider's instance metadata service: send a request, read
// a bounded body, and treat any answer but 200 as an error.
package metadata

import (
	"context"
	"fmt"
	"io"
	"net/http"
)

// Get sends method url with header through client and returns the body of
// a 200 answer, read up to limit bytes. Errors name what was asked for.
func Get(ctx context.Context, client *http.Client, method, url string, header map[string]string, limit int64) ([]byte, error) {
	r, err := http.NewRequestWithContext(ctx, method, url, nil)
	if err != nil {
		return nil, err
	}
	for k, v := range header {
		r.Header.Set(k, v)
	}
	resp, err := client.Do(r)
	if err != nil {
		return nil, fmt.Errorf("unable to reach the metadata service: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, limit))
	if err != nil {
		return nil, fmt.Errorf("unable to read %s %s: %w", method, r.URL.Path, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("metadata service answered %s for %s %s", resp.Status, method, r.URL.Path)
	}
	return body, nil
}
