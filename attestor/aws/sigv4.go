package aws

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"
)

// AWS Signature Version 4, query-string (presigned) form, just what a
// presigned STS GetCallerIdentity request needs.

const (
	sigv4Algorithm  = "AWS4-HMAC-SHA256"
	amzDateFormat   = "20060102T150405Z"
	stsService      = "sts"
	emptyBodySHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
)

type credentials struct {
	AccessKeyID     string
	SecretAccessKey string
	SessionToken    string
}

// awsEscape percent-encodes everything but the RFC 3986 unreserved
// characters, as SigV4 requires.
func awsEscape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.' || c == '~' {
			b.WriteByte(c)
			continue
		}
		b.WriteString("%" + strings.ToUpper(hex.EncodeToString([]byte{c})))
	}
	return b.String()
}

func canonicalQuery(q url.Values) string {
	keys := make([]string, 0, len(q))
	for k := range q {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		vs := append([]string(nil), q[k]...)
		sort.Strings(vs)
		for _, v := range vs {
			parts = append(parts, awsEscape(k)+"="+awsEscape(v))
		}
	}
	return strings.Join(parts, "&")
}

func hmacSHA256(key []byte, data string) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(data))
	return m.Sum(nil)
}

// presignURL returns u (scheme, host, path; its query holds the request
// parameters) presigned for a GET with the given extra signed headers
// (lower-case names), valid for expires seconds from t.
func presignURL(u *url.URL, headers map[string]string, creds credentials, region, service string, t time.Time, expires int, payloadHash string) string {
	t = t.UTC()
	date := t.Format("20060102")
	scope := date + "/" + region + "/" + service + "/aws4_request"
	names := []string{"host"}
	for k := range headers {
		names = append(names, k)
	}
	sort.Strings(names)
	q := u.Query()
	q.Set("X-Amz-Algorithm", sigv4Algorithm)
	q.Set("X-Amz-Credential", creds.AccessKeyID+"/"+scope)
	q.Set("X-Amz-Date", t.Format(amzDateFormat))
	q.Set("X-Amz-Expires", strconv.Itoa(expires))
	q.Set("X-Amz-SignedHeaders", strings.Join(names, ";"))
	if creds.SessionToken != "" {
		q.Set("X-Amz-Security-Token", creds.SessionToken)
	}
	var ch strings.Builder
	for _, n := range names {
		v := u.Host
		if n != "host" {
			v = strings.TrimSpace(headers[n])
		}
		ch.WriteString(n + ":" + v + "\n")
	}
	path := u.EscapedPath()
	if path == "" {
		path = "/"
	}
	creq := strings.Join([]string{"GET", path, canonicalQuery(q), ch.String(), strings.Join(names, ";"), payloadHash}, "\n")
	sum := sha256.Sum256([]byte(creq))
	sts := strings.Join([]string{sigv4Algorithm, t.Format(amzDateFormat), scope, hex.EncodeToString(sum[:])}, "\n")
	key := hmacSHA256([]byte("AWS4"+creds.SecretAccessKey), date)
	key = hmacSHA256(key, region)
	key = hmacSHA256(key, service)
	key = hmacSHA256(key, "aws4_request")
	sig := hex.EncodeToString(hmacSHA256(key, sts))
	out := *u
	out.RawQuery = canonicalQuery(q) + "&X-Amz-Signature=" + sig
	return out.String()
}
