package harness

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// auditPolicy records every request at level Metadata (who, what, which
// object, the response code), once it is answered; writes to
// CertificateSigningRequests also at level Request (their body: the
// request, conditions and certificate, all public), so that tests can tell
// from the API server's own record what was approved and issued.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Request
  verbs: ["create", "update", "patch"]
  resources:
  - group: certificates.k8s.io
    resources: ["certificatesigningrequests", "certificatesigningrequests/approval", "certificatesigningrequests/status"]
- level: Metadata
`

// WithAuditLog makes kube-apiserver write an audit log of every request
// (level Metadata; CSR writes at level Request) into the control plane's directory; AuditEvents reads it.
func WithAuditLog() Option {
	return func(o *options) { o.audit = true }
}

// auditArgs writes the audit policy into cp.Dir and returns the
// kube-apiserver flags that use it.
func (cp *ControlPlane) auditArgs() ([]string, error) {
	policy := filepath.Join(cp.Dir, "audit-policy.yaml")
	if err := os.WriteFile(policy, []byte(auditPolicy), 0o600); err != nil {
		return nil, err
	}
	return []string{"--audit-policy-file=" + policy, "--audit-log-path=" + cp.auditLogPath()}, nil
}

func (cp *ControlPlane) auditLogPath() string { return filepath.Join(cp.Dir, "audit.log") }

// AuditEvent is the part of a kube-apiserver audit event (audit.k8s.io/v1)
// tests look at.
type AuditEvent struct {
	AuditID    string `json:"auditID"`
	Stage      string `json:"stage"`
	Verb       string `json:"verb"`
	RequestURI string `json:"requestURI"`
	User       struct {
		Username string   `json:"username"`
		Groups   []string `json:"groups"`
	} `json:"user"`
	UserAgent string `json:"userAgent"`
	ObjectRef *struct {
		Resource    string `json:"resource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
		APIGroup    string `json:"apiGroup"`
		Subresource string `json:"subresource"`
	} `json:"objectRef"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
	// RequestObject is the body of a write to a CertificateSigningRequest
	// (JSON), nil for other requests.
	RequestObject            json.RawMessage `json:"requestObject,omitempty"`
	RequestReceivedTimestamp time.Time       `json:"requestReceivedTimestamp"`
}

// Code is the response's status code (0 when unknown).
func (e *AuditEvent) Code() int {
	if e.ResponseStatus == nil {
		return 0
	}
	return e.ResponseStatus.Code
}

// AuditEvents returns the requests kube-apiserver has answered so far, one
// event per request (its first of ResponseStarted, for watches, and
// ResponseComplete), in the order they were logged. The control plane must
// have been started WithAuditLog.
func (cp *ControlPlane) AuditEvents(tb testing.TB) []AuditEvent {
	tb.Helper()
	f, err := os.Open(cp.auditLogPath())
	if err != nil {
		tb.Fatalf("control plane %s has no audit log (start it WithAuditLog): %v", cp.Name, err)
	}
	defer f.Close()
	var out []AuditEvent
	seen := map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 4*1024*1024)
	for sc.Scan() {
		var e AuditEvent
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			continue // a line still being written
		}
		if seen[e.AuditID] || (e.Stage != "ResponseStarted" && e.Stage != "ResponseComplete" && e.Stage != "Panic") {
			continue
		}
		seen[e.AuditID] = true
		out = append(out, e)
	}
	if err := sc.Err(); err != nil {
		tb.Fatalf("unable to read the audit log of control plane %s: %v", cp.Name, err)
	}
	return out
}
