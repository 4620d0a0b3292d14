package gcp

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"path"
	"strings"
)

// ProviderID reads the project, zone and instance name from the metadata
// server and returns the instance's provider ID, gce://<project>/<zone>/<instance
// name>, for a node whose configuration names none. It proves nothing: the
// verifier derives the provider ID from the signed token again.
func (a *Attestor) ProviderID(ctx context.Context) (string, error) {
	project, err := a.metadata(ctx, "project/project-id")
	if err != nil {
		return "", err
	}
	zone, err := a.metadata(ctx, "instance/zone")
	if err != nil {
		return "", err
	}
	name, err := a.metadata(ctx, "instance/name")
	if err != nil {
		return "", err
	}
	// instance/zone is projects/<project number>/zones/<zone>.
	zone = path.Base(zone)
	if project == "" || zone == "" || zone == "." || name == "" {
		return "", fmt.Errorf("the metadata server returned an incomplete instance (project %q, zone %q, name %q)", project, zone, name)
	}
	return "gce://" + project + "/" + zone + "/" + name, nil
}

func (a *Attestor) metadata(ctx context.Context, p string) (string, error) {
	r, err := http.NewRequestWithContext(ctx, http.MethodGet, a.endpoint+"/computeMetadata/v1/"+p, nil)
	if err != nil {
		return "", err
	}
	r.Header.Set("Metadata-Flavor", "Google")
	resp, err := a.client.Do(r)
	if err != nil {
		return "", fmt.Errorf("unable to reach the metadata server: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	if err != nil {
		return "", fmt.Errorf("unable to read %s from the metadata server: %w", p, err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("metadata server answered %s for %s", resp.Status, p)
	}
	return strings.TrimSpace(string(body)), nil
}
