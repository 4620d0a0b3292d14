//go:build !linux

package serving

import (
	"errors"
	"net"
)

// DefaultRouteAddress is implemented on Linux only.
func DefaultRouteAddress() (net.IP, error) {
	return nil, errors.New("address discovery is implemented on Linux only")
}
