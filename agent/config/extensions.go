package config

import (
	"bytes"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"sync"

	"sigs.k8s.io/yaml"

	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
)

// extensions are the dotted paths of sections the release schema does not
// have, registered by test builds (RegisterExtension) or belonging to a
// test-only provider of the provider table.
var extensions struct {
	sync.Mutex
	paths []string
}

// RegisterExtension adds a section the release schema does not have, by
// its path ("tpm", "simulator"). Only files with a test build tag call it,
// from init; Load then moves the section into NodeConfig.Extensions.
func RegisterExtension(path ...string) {
	extensions.Lock()
	defer extensions.Unlock()
	extensions.paths = append(extensions.paths, strings.Join(path, "."))
}

func extensionPaths() []string {
	extensions.Lock()
	paths := append([]string(nil), extensions.paths...)
	extensions.Unlock()
	for _, d := range providers.All() {
		if d.TestOnly && d.NodeSection != "" {
			paths = append(paths, d.NodeSection)
		}
	}
	return paths
}

// decode parses a configuration document strictly (no unknown fields, no
// duplicate keys) into c; the sections of registered extensions go to
// c.Extensions.
func decode(data []byte, c *NodeConfig) error {
	paths := extensionPaths()
	if len(paths) == 0 {
		return yaml.UnmarshalStrict(data, c)
	}
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return err
	}
	var doc any
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.UseNumber()
	if err := dec.Decode(&doc); err != nil {
		return err
	}
	ext := map[string]json.RawMessage{}
	for _, p := range paths {
		v, ok := cut(doc, strings.Split(p, "."))
		if !ok {
			continue
		}
		raw, err := json.Marshal(v)
		if err != nil {
			return err
		}
		ext[p] = raw
	}
	if js, err = json.Marshal(doc); err != nil {
		return err
	}
	strict := json.NewDecoder(bytes.NewReader(js))
	strict.DisallowUnknownFields()
	if err := strict.Decode(c); err != nil {
		return err
	}
	if len(ext) > 0 {
		c.Extensions = ext
	}
	return nil
}

// cut removes the value at path from doc and returns it.
func cut(doc any, path []string) (any, bool) {
	m, ok := doc.(map[string]any)
	if !ok {
		return nil, false
	}
	if len(path) > 1 {
		return cut(m[path[0]], path[1:])
	}
	v, ok := m[path[0]]
	delete(m, path[0])
	return v, ok
}

// Extension decodes the extension section at path into out, strictly. It
// reports whether the configuration has the section.
func (c *NodeConfig) Extension(path string, out any) (bool, error) {
	raw, ok := c.Extensions[path]
	if !ok {
		return false, nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(out); err != nil {
		return true, fmt.Errorf("%s: %w", path, err)
	}
	return true, nil
}

// ProviderSection returns the node configuration of provider d: the field
// of NodeConfig whose key is d.NodeSection, or for a section the release
// schema does not have (a test-only provider's), the extension decoded into
// d's node configuration type. Nil when the provider takes none.
func (c *NodeConfig) ProviderSection(d providers.Descriptor) (any, error) {
	if d.NodeSection == "" || d.NewNodeConfig == nil {
		return nil, nil
	}
	v := reflect.ValueOf(c).Elem()
	for i := 0; i < v.NumField(); i++ {
		if name, _, _ := strings.Cut(v.Type().Field(i).Tag.Get("json"), ","); name == d.NodeSection {
			return v.Field(i).Interface(), nil
		}
	}
	out := d.NewNodeConfig()
	if _, err := c.Extension(d.NodeSection, out); err != nil {
		return nil, err
	}
	return out, nil
}
