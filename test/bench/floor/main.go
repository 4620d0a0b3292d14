// Command floor is the benchmark baseline for the exec plugin's cached path:
// the least a Go exec credential plugin can do, print a fixed ExecCredential.
package main

import "os"

const credential = `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"expirationTimestamp":"2099-01-01T00:00:00Z","clientCertificateData":"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n","clientKeyData":"-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n"}}` //nolint:lll // a fixed ExecCredential, byte for byte

func main() {
	os.Stdout.WriteString(credential + "\n")
}
