// Command oci builds the node-attestation-controller container image without
// a container engine: an OCI image index with one image per platform, each a
// single layer on an empty base holding the static controller binary,
// /etc/passwd and /etc/group with the non-root user 65532, an nsswitch.conf
// and a CA bundle for the outbound TLS clients (STS, JWKS). It writes an OCI
// image layout directory and the same layout as a tar archive (what
// `skopeo copy oci-archive:`, `podman load` and `docker load` read).
//
//	go run ./images/oci --version v0.1.0 --output bin/images/node-attestation-controller \
//	  --binary linux/amd64=bin/linux_amd64/node-attestation-controller \
//	  --binary linux/arm64=bin/linux_arm64/node-attestation-controller
//
// The output is reproducible: file times and the image's creation time are
// SOURCE_DATE_EPOCH (default 0), files are owned by root and written in a
// fixed order, so the same binaries give the same digests.
//
// --image names the image in the layout (what `make images` passes: the
// reference the Helm chart and the clusterctl components install), and
// --push also pushes it there, with the credentials of ~/.docker/config.json
// (docker login, podman login --authfile, crane auth login write them).
package main

import (
	"archive/tar"
	"bytes"
	"crypto/x509"
	"debug/elf"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/spf13/pflag"
)

// What the image holds and how it runs.
const (
	// Entrypoint is the controller binary's path in the image.
	Entrypoint = "/node-attestation-controller"
	// User is the numeric user and group the controller runs as (the
	// distroless "nonroot" user); the Deployment's runAsNonRoot needs a
	// numeric user to verify.
	User = "65532:65532"
	// CABundlePath is where Go's crypto/x509 looks first on Linux.
	CABundlePath = "/etc/ssl/certs/ca-certificates.crt"
	// RefNameAnnotation names the image in the layout's index.json.
	RefNameAnnotation = "org.opencontainers.image.ref.name"
	// Source is the image's org.opencontainers.image.source label.
	Source = "https://sigs.k8s.io/kubelet-authenticator"
)

// options are the command's flags.
type options struct {
	// binaries are "os/arch[/variant]=path" of static controller binaries.
	binaries []string
	// caBundle is a PEM file of root certificates copied into the image;
	// "" leaves it out.
	caBundle string
	// version is the image's version label, and its layout reference name
	// when image is empty.
	version string
	// image is the image's reference (registry/repository:tag): the
	// layout's reference name and where push pushes it.
	image string
	// push pushes the image index to image.
	push bool
	// output is the layout directory; the archive is output + ".tar".
	output string
	// created is the time of every file and of the image.
	created time.Time
}

func main() {
	o := options{caBundle: "/etc/ssl/certs/ca-certificates.crt", version: "v0.0.0-dev"}
	fs := pflag.NewFlagSet("oci", pflag.ContinueOnError)
	fs.StringArrayVar(&o.binaries, "binary", nil, "os/arch=path of a static node-attestation-controller binary; repeat once per platform.")
	fs.StringVar(&o.caBundle, "ca-bundle", o.caBundle, "PEM file of root CA certificates to install at "+CABundlePath+"; empty leaves it out.")
	fs.StringVar(&o.version, "version", o.version, "Version: the org.opencontainers.image.version label and the layout's reference name.")
	fs.StringVar(&o.image, "image", "", "Reference of the image (registry/repository:tag): the layout's reference name and where --push pushes it.")
	fs.BoolVar(&o.push, "push", false, "Push the image to --image, with the credentials of ~/.docker/config.json.")
	fs.StringVar(&o.output, "output", "", "Directory of the OCI image layout to write (replaced); the archive is written next to it as <output>.tar.")
	if err := fs.Parse(os.Args[1:]); err != nil {
		os.Exit(2)
	}
	var err error
	o.created, err = sourceDateEpoch(os.Getenv("SOURCE_DATE_EPOCH"))
	if err == nil {
		err = run(o)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "oci: error: %v\n", err)
		os.Exit(1)
	}
}

func sourceDateEpoch(v string) (time.Time, error) {
	if v == "" {
		return time.Unix(0, 0).UTC(), nil
	}
	s, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH %q is not a number of seconds: %w", v, err)
	}
	return time.Unix(s, 0).UTC(), nil
}

// run builds the index and writes the layout and the archive.
func run(o options) error {
	if o.output == "" {
		return errors.New("--output is required")
	}
	refName := o.version
	var ref name.Reference
	if o.image != "" {
		var err error
		if ref, err = name.NewTag(o.image, name.StrictValidation); err != nil {
			return fmt.Errorf("--image %q: want registry/repository:tag: %w", o.image, err)
		}
		refName = ref.Name()
	} else if o.push {
		return errors.New("--push needs --image")
	}
	idx, err := buildIndex(o)
	if err != nil {
		return err
	}
	if err := os.RemoveAll(o.output); err != nil {
		return err
	}
	p, err := layout.Write(o.output, empty.Index)
	if err != nil {
		return fmt.Errorf("unable to write the image layout: %w", err)
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(map[string]string{RefNameAnnotation: refName})); err != nil {
		return fmt.Errorf("unable to write the image layout: %w", err)
	}
	if err := writeArchive(o.output, o.output+".tar", o.created); err != nil {
		return err
	}
	d, err := idx.Digest()
	if err != nil {
		return err
	}
	fmt.Printf("%s %s\n%s.tar\n", o.output, d, o.output)
	if o.push {
		if err := remote.WriteIndex(ref, idx, remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
			return fmt.Errorf("unable to push %s: %w", ref, err)
		}
		fmt.Printf("pushed %s@%s\n", ref, d)
	}
	return nil
}

// buildIndex returns the multi-platform image index of o.binaries.
func buildIndex(o options) (v1.ImageIndex, error) {
	if len(o.binaries) == 0 {
		return nil, errors.New("no --binary given")
	}
	var ca []byte
	if o.caBundle != "" {
		var err error
		if ca, err = readCABundle(o.caBundle); err != nil {
			return nil, err
		}
	}
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	seen := map[string]bool{}
	for _, b := range o.binaries {
		plat, path, ok := strings.Cut(b, "=")
		if !ok || path == "" {
			return nil, fmt.Errorf("--binary %q: want os/arch=path", b)
		}
		p, err := v1.ParsePlatform(plat)
		if err != nil || p.OS == "" || p.Architecture == "" {
			return nil, fmt.Errorf("--binary %q: want os/arch=path", b)
		}
		if p.Architecture == "arm64" && p.Variant == "" {
			p.Variant = "v8"
		}
		if seen[p.String()] {
			return nil, fmt.Errorf("--binary %q: platform %s given twice", b, p)
		}
		seen[p.String()] = true
		img, err := buildImage(*p, path, ca, o)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: p}})
	}
	return idx, nil
}

// buildImage returns the image of one platform.
func buildImage(p v1.Platform, binPath string, ca []byte, o options) (v1.Image, error) {
	bin, err := os.ReadFile(binPath)
	if err != nil {
		return nil, fmt.Errorf("unable to read the controller binary: %w", err)
	}
	if err := checkBinary(bin, p); err != nil {
		return nil, fmt.Errorf("%s: %w", binPath, err)
	}
	rootfs, err := rootFS(bin, ca, o.created)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(rootfs)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("unable to make the layer: %w", err)
	}
	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	created := v1.Time{Time: o.created}
	img, err = mutate.Append(img, mutate.Addendum{
		Layer:     layer,
		MediaType: types.OCILayer,
		History:   v1.History{Created: created, CreatedBy: "images/oci: node-attestation-controller " + o.version},
	})
	if err != nil {
		return nil, fmt.Errorf("unable to add the layer: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Variant = p.OS, p.Architecture, p.Variant
	cf.Created = created
	cf.Author = Source
	cf.Config.User = User
	cf.Config.Entrypoint = []string{Entrypoint}
	cf.Config.WorkingDir = "/"
	cf.Config.Labels = map[string]string{
		"org.opencontainers.image.title":    "node-attestation-controller",
		"org.opencontainers.image.version":  o.version,
		"org.opencontainers.image.source":   Source,
		"org.opencontainers.image.licenses": "Apache-2.0",
	}
	return mutate.ConfigFile(img, cf)
}

// elfMachines maps GOARCH to the ELF machine its binaries are for.
var elfMachines = map[string]elf.Machine{
	"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64, "ppc64le": elf.EM_PPC64, "s390x": elf.EM_S390,
}

// checkBinary makes sure bin is a static Linux ELF executable for p: an
// empty base has no dynamic loader and no libc.
func checkBinary(bin []byte, p v1.Platform) error {
	if p.OS != "linux" {
		return fmt.Errorf("only linux images are built, not %s", p.OS)
	}
	want, ok := elfMachines[p.Architecture]
	if !ok {
		return fmt.Errorf("architecture %s is not supported", p.Architecture)
	}
	f, err := elf.NewFile(bytes.NewReader(bin))
	if err != nil {
		return fmt.Errorf("not an ELF executable: %w", err)
	}
	defer f.Close()
	if f.Machine != want {
		return fmt.Errorf("built for %s, not for %s (%s)", f.Machine, p.Architecture, want)
	}
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return fmt.Errorf("ELF type %s, want an executable", f.Type)
	}
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return errors.New("dynamically linked (it names an interpreter); build with CGO_ENABLED=0")
		}
	}
	return nil
}

// readCABundle reads a PEM file and checks that it holds certificates.
func readCABundle(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("unable to read the CA bundle: %w", err)
	}
	n, rest := 0, b
	for {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		if _, err := x509.ParseCertificate(block.Bytes); err != nil {
			return nil, fmt.Errorf("CA bundle %s: %w", path, err)
		}
		n++
	}
	if n == 0 {
		return nil, fmt.Errorf("CA bundle %s holds no certificate", path)
	}
	return b, nil
}

// Files of the image besides the binary and the CA bundle.
const (
	passwd = "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
	group  = "root:x:0:\nnonroot:x:65532:\n"
	// nsswitch makes Go's resolver read /etc/hosts (which kubelet mounts)
	// before asking DNS, as glibc would.
	nsswitch = "hosts: files dns\n"
)

// rootFS returns the layer's tar: every entry owned by root, dated
// created, directories before their contents.
func rootFS(bin, ca []byte, created time.Time) ([]byte, error) {
	type entry struct {
		name string
		mode int64
		data []byte
		dir  bool
	}
	entries := []entry{
		{name: "etc/", mode: 0o755, dir: true},
		{name: "etc/group", mode: 0o644, data: []byte(group)},
		{name: "etc/nsswitch.conf", mode: 0o644, data: []byte(nsswitch)},
		{name: "etc/passwd", mode: 0o644, data: []byte(passwd)},
	}
	if ca != nil {
		entries = append(entries,
			entry{name: "etc/ssl/", mode: 0o755, dir: true},
			entry{name: "etc/ssl/certs/", mode: 0o755, dir: true},
			entry{name: strings.TrimPrefix(CABundlePath, "/"), mode: 0o644, data: ca},
		)
	}
	entries = append(entries,
		entry{name: "home/", mode: 0o755, dir: true},
		entry{name: "home/nonroot/", mode: 0o700, dir: true},
		entry{name: strings.TrimPrefix(Entrypoint, "/"), mode: 0o755, data: bin},
		entry{name: "tmp/", mode: 0o1777, dir: true},
	)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Mode: e.mode, ModTime: created, Format: tar.FormatPAX, Typeflag: tar.TypeReg, Size: int64(len(e.data))}
		if e.dir {
			h.Typeflag, h.Size = tar.TypeDir, 0
		}
		if e.name == "home/nonroot/" {
			h.Uid, h.Gid = 65532, 65532
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// writeArchive writes the layout directory dir as a tar archive at path:
// oci-layout first, then index.json, then the blobs, in name order.
func writeArchive(dir, path string, created time.Time) error {
	var names []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		names = append(names, filepath.ToSlash(rel))
		return nil
	})
	if err != nil {
		return err
	}
	rank := func(n string) int {
		switch n {
		case "oci-layout":
			return 0
		case "index.json":
			return 1
		}
		return 2
	}
	slices.SortFunc(names, func(a, b string) int {
		if c := rank(a) - rank(b); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	for _, n := range names {
		if err := addFile(tw, filepath.Join(dir, filepath.FromSlash(n)), n, created); err != nil {
			f.Close()
			return fmt.Errorf("unable to write %s: %w", path, err)
		}
	}
	if err := tw.Close(); err != nil {
		f.Close()
		return fmt.Errorf("unable to write %s: %w", path, err)
	}
	return f.Close()
}

func addFile(tw *tar.Writer, src, name string, created time.Time) error {
	fi, err := os.Stat(src)
	if err != nil {
		return err
	}
	h := &tar.Header{Name: name, Mode: 0o644, ModTime: created, Format: tar.FormatPAX, Typeflag: tar.TypeReg, Size: fi.Size()}
	if fi.IsDir() {
		h.Name, h.Mode, h.Typeflag, h.Size = name+"/", 0o755, tar.TypeDir, 0
		return tw.WriteHeader(h)
	}
	if err := tw.WriteHeader(h); err != nil {
		return err
	}
	r, err := os.Open(src)
	if err != nil {
		return err
	}
	defer r.Close()
	_, err = io.Copy(tw, r)
	return err
}
