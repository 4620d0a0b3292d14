package aws

import (
	"context"
	"encoding/json"
	"fmt"
)

// ProviderID reads the instance identity document through IMDSv2 and
// returns the instance's provider ID, aws:///<availability zone>/<instance
// ID>, for a node whose configuration names none. It proves nothing: the
// verifier derives the provider ID from the signed document again.
func (a *Attestor) ProviderID(ctx context.Context) (string, error) {
	token, err := a.imdsToken(ctx)
	if err != nil {
		return "", err
	}
	doc, err := a.imdsGet(ctx, token, "/latest/dynamic/instance-identity/document")
	if err != nil {
		return "", err
	}
	var iid InstanceIdentityDocument
	if err := json.Unmarshal(doc, &iid); err != nil {
		return "", fmt.Errorf("unable to parse the instance identity document: %w", err)
	}
	if iid.AvailabilityZone == "" || iid.InstanceID == "" {
		return "", fmt.Errorf("the instance identity document names no availability zone or instance ID")
	}
	return iid.ProviderID(), nil
}
