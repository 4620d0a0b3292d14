package gcp

import (
	"context"
	"fmt"
	"net/http"
	"path"
	"sigs.k8s.io/kubelet-authenticator/attestor/internal/metadata"
	"strings"
)

// ProviderID reads the project, zone and instance name from the metadata
// server and returns the instance's provider ID, gce://<project>/<zone>/<instance
// name>, for a node whose configuration names none. It proves nothing: the
// verifier derives the provider ID from the signed token again.
func (a *Attestor) ProviderID(ctx context.Context) (string, error) {
	project, err := a.metadata(ctx, "project/project-id", 4<<10)
	if err != nil {
		return "", err
	}
	zone, err := a.metadata(ctx, "instance/zone", 4<<10)
	if err != nil {
		return "", err
	}
	name, err := a.metadata(ctx, "instance/name", 4<<10)
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

// metadata returns the trimmed value at p under /computeMetadata/v1/.
func (a *Attestor) metadata(ctx context.Context, p string, limit int64) (string, error) {
	body, err := metadata.Get(ctx, a.client, http.MethodGet, a.endpoint+"/computeMetadata/v1/"+p,
		map[string]string{"Metadata-Flavor": "Google"}, limit)
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(body)), nil
}
