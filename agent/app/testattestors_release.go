//go:build !testattestors

package app

// testAttestors is empty in release builds: they never contain the null
// rubber-stamp attestor.
func testAttestors() map[string]attestorFactory { return nil }
