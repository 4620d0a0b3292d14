package main

import (
	"archive/tar"
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/google/go-containerregistry/pkg/v1/validate"
)

const testVersion = "v1.2.3-imagetest"

// TestImage builds the controller as released (CGO_ENABLED=0, the version
// set by ldflags as make build sets it), builds its image, and reads the
// archive back as a registry client would: a valid OCI layout whose index
// names the version, one image for the platform, running as 65532 with the
// controller as entrypoint, and a layer whose binary prints the version.
func TestImage(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the controller")
	}
	if runtime.GOOS != "linux" || elfMachines[runtime.GOARCH] == 0 {
		t.Skipf("images are built for linux on %v", "amd64, arm64, ppc64le, s390x")
	}
	start := time.Now()
	bin := buildController(t)
	t.Logf("controller built in %s", time.Since(start).Round(time.Millisecond))
	dir := t.TempDir()
	o := options{
		binaries: []string{"linux/" + runtime.GOARCH + "=" + bin},
		caBundle: writeCA(t, dir),
		version:  testVersion,
		output:   filepath.Join(dir, "out", "node-attestation-controller"),
		created:  time.Unix(1700000000, 0).UTC(),
	}
	start = time.Now()
	if err := run(o); err != nil {
		t.Fatal(err)
	}
	t.Logf("image built in %s", time.Since(start).Round(time.Millisecond))

	// Read the archive, not the directory: it is what gets shipped.
	extracted := filepath.Join(dir, "extracted")
	untar(t, o.output+".tar", extracted)
	p, err := layout.FromPath(extracted)
	if err != nil {
		t.Fatal(err)
	}
	top, err := p.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	im, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 || im.Manifests[0].MediaType != types.OCIImageIndex || im.Manifests[0].Annotations[RefNameAnnotation] != testVersion {
		t.Fatalf("index.json %+v, want one image index named %s", im.Manifests, testVersion)
	}
	idx, err := top.ImageIndex(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	if err := validate.Index(idx); err != nil {
		t.Fatalf("invalid image index: %v", err)
	}
	manifests, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(manifests.Manifests) != 1 {
		t.Fatalf("%d images, want 1", len(manifests.Manifests))
	}
	desc := manifests.Manifests[0]
	if desc.MediaType != types.OCIManifestSchema1 || desc.Platform == nil || desc.Platform.OS != "linux" || desc.Platform.Architecture != runtime.GOARCH {
		t.Errorf("image descriptor %+v, want an OCI manifest for linux/%s", desc, runtime.GOARCH)
	}
	img, err := idx.Image(desc.Digest)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.OS != "linux" || cf.Architecture != runtime.GOARCH || cf.Config.User != "65532:65532" ||
		len(cf.Config.Entrypoint) != 1 || cf.Config.Entrypoint[0] != Entrypoint ||
		cf.Config.Labels["org.opencontainers.image.version"] != testVersion || !cf.Created.Equal(o.created) {
		t.Errorf("config %+v", cf)
	}
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers %d (%v), want 1", len(layers), err)
	}
	if mt, _ := layers[0].MediaType(); mt != types.OCILayer {
		t.Errorf("layer media type %s, want %s", mt, types.OCILayer)
	}

	files := layerFiles(t, layers[0])
	for name, want := range map[string]int64{"node-attestation-controller": 0o755, "etc/passwd": 0o644, "etc/group": 0o644, strings.TrimPrefix(CABundlePath, "/"): 0o644} {
		f, ok := files[name]
		switch {
		case !ok:
			t.Errorf("the layer has no %s", name)
		case f.hdr.Mode != want || f.hdr.Uid != 0 || f.hdr.Gid != 0 || !f.hdr.ModTime.Equal(o.created):
			t.Errorf("%s: mode %o owner %d:%d time %s, want %o root:root %s", name, f.hdr.Mode, f.hdr.Uid, f.hdr.Gid, f.hdr.ModTime, want, o.created)
		}
	}
	if !strings.Contains(string(files["etc/passwd"].data), ":65532:65532:") {
		t.Errorf("etc/passwd has no user 65532:\n%s", files["etc/passwd"].data)
	}

	// The binary in the layer is the controller, and says its version.
	exe := filepath.Join(dir, "from-layer")
	if err := os.WriteFile(exe, files["node-attestation-controller"].data, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"--version"}, {"version"}} {
		out, err := exec.Command(exe, args...).CombinedOutput()
		if err != nil || !strings.Contains(string(out), testVersion) {
			t.Errorf("node-attestation-controller %s: %v: %q, want %s", args[0], err, out, testVersion)
		}
	}

	// The same input gives the same image.
	o2 := o
	o2.output = filepath.Join(dir, "again", "node-attestation-controller")
	if err := run(o2); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(o.output + ".tar")
	b, _ := os.ReadFile(o2.output + ".tar")
	if !bytes.Equal(a, b) {
		t.Error("two builds of the same binary differ")
	}
}

// TestImageRejects checks that what cannot run on an empty base, or on the
// platform it is labelled for, is refused.
func TestImageRejects(t *testing.T) {
	if runtime.GOOS != "linux" || elfMachines[runtime.GOARCH] == 0 {
		t.Skip("needs a linux host binary")
	}
	self, err := os.Executable() // a test binary: static only with CGO_ENABLED=0
	if err != nil {
		t.Fatal(err)
	}
	other := "arm64"
	if runtime.GOARCH == "arm64" {
		other = "amd64"
	}
	dynamic := ""
	for _, p := range []string{"/bin/true", "/usr/bin/true"} {
		if f, err := os.Stat(p); err == nil && !f.IsDir() {
			dynamic = p
			break
		}
	}
	dir := t.TempDir()
	for _, tc := range []struct {
		name, binary, want string
	}{
		{"wrong architecture", "linux/" + other + "=" + self, "built for"},
		{"not linux", "windows/" + runtime.GOARCH + "=" + self, "only linux"},
		{"not ELF", "linux/" + runtime.GOARCH + "=" + writeFile(t, dir, "script", "#!/bin/sh\n"), "not an ELF"},
		{"dynamically linked", "linux/" + runtime.GOARCH + "=" + dynamic, "dynamically linked"},
		{"no path", "linux/" + runtime.GOARCH, "want os/arch=path"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if strings.HasSuffix(tc.binary, "=") {
				t.Skip("no dynamically linked binary here")
			}
			_, err := buildIndex(options{binaries: []string{tc.binary}, version: "v0"})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
	_, err = buildIndex(options{binaries: []string{"linux/" + runtime.GOARCH + "=" + self}, caBundle: writeFile(t, dir, "empty.pem", "")})
	if err == nil || !strings.Contains(err.Error(), "no certificate") {
		t.Errorf("empty CA bundle: %v", err)
	}
}

func buildController(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "node-attestation-controller")
	cmd := exec.Command("go", "build",
		"-ldflags", "-s -w -X sigs.k8s.io/kubelet-authenticator/version.gitVersion="+testVersion,
		"-o", out, "sigs.k8s.io/kubelet-authenticator/cmd/node-attestation-controller")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, b)
	}
	return out
}

func writeCA(t *testing.T, dir string) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test root"}, NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return writeFile(t, dir, "ca.pem", string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})))
}

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func untar(t *testing.T, archive, dir string) {
	t.Helper()
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		if h.Typeflag == tar.TypeDir {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

type file struct {
	hdr  *tar.Header
	data []byte
}

func layerFiles(t *testing.T, l v1.Layer) map[string]file {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	out := map[string]file{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out[h.Name] = file{hdr: h, data: b}
	}
}
