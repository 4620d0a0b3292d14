package checks

import "crypto/x509"

// CheckSubject returns the node name of a subject that is exactly
// CN=system:node:<name>, O=system:nodes, and a failure per problem
// otherwise. It is the subject rule of Check, for other certificate kinds
// (serving) that share it.
func CheckSubject(x *x509.CertificateRequest) (string, []*Failure) { return checkSubject(x) }

// CheckNotCA returns a failure when the request asks for a CA certificate
// (basicConstraints cA=true, or nameConstraints).
func CheckNotCA(x *x509.CertificateRequest) *Failure { return checkCA(x) }
