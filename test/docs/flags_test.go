package docs

import (
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	agentapp "sigs.k8s.io/kubelet-authenticator/agent/app"
	signerapp "sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

var (
	// backticked is a `...` span of a table cell.
	backticked = regexp.MustCompile("`([^`]+)`")
	// flagToken is the flag a backticked span starts with: --name or -n.
	flagToken = regexp.MustCompile(`^(--?[a-z][a-z0-9-]*)`)
	// stdFlag is a flag line of Go's flag package's PrintDefaults.
	stdFlag = regexp.MustCompile(`(?m)^  -([a-z][a-z0-9-]*)`)
)

// commandFlags returns the flags of c as a reader types them: --name and,
// where there is one, -shorthand, mapped to the flag's name. help is left
// out (every command has it), and so are the flags of test builds (build
// tag testattestors), whose usage says "test builds only": the docs
// describe the released binaries.
func commandFlags(c *cobra.Command) map[string]string {
	c.InitDefaultHelpFlag()
	c.InitDefaultVersionFlag()
	out := map[string]string{}
	c.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Name == "help" || strings.Contains(f.Usage, "test builds only") {
			return
		}
		out["--"+f.Name] = f.Name
		if f.Shorthand != "" {
			out["-"+f.Shorthand] = f.Name
		}
	})
	return out
}

// names returns the flag names of a commandFlags map.
func names(flags map[string]string) []string {
	var out []string
	for _, n := range flags {
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

// docTable returns the rows of the first Markdown table after heading in
// file, as cells.
func docTable(t *testing.T, file, heading, header string) [][]string {
	t.Helper()
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, file))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i := strings.Index(doc, "\n"+heading+"\n")
	if i < 0 {
		t.Fatalf("%s has no heading %q", file, heading)
	}
	j := strings.Index(doc[i:], "\n"+header+"\n")
	if j < 0 {
		t.Fatalf("%s: no table %q under %q", file, header, heading)
	}
	var rows [][]string
	for _, line := range strings.Split(doc[i+j+1:], "\n")[2:] {
		if !strings.HasPrefix(line, "|") {
			break
		}
		line = strings.ReplaceAll(line, `\|`, "\x00")
		var cells []string
		for _, c := range strings.Split(strings.Trim(line, "|"), "|") {
			cells = append(cells, strings.TrimSpace(strings.ReplaceAll(c, "\x00", "|")))
		}
		rows = append(rows, cells)
	}
	return rows
}

// docFlags returns the flags a cell names: the backticked spans that start
// with a dash.
func docFlags(cell string) []string {
	var out []string
	for _, m := range backticked.FindAllStringSubmatch(cell, -1) {
		if f := flagToken.FindString(m[1]); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// compare checks that the documented flags are exactly the command's.
func compare(t *testing.T, where, command string, flags map[string]string, documented []string) {
	t.Helper()
	seen := map[string]bool{}
	for _, d := range documented {
		n, ok := flags[d]
		if !ok {
			t.Errorf("%s documents %s for %s, which has no such flag", where, d, command)
			continue
		}
		seen[n] = true
	}
	for _, n := range names(flags) {
		if !seen[n] {
			t.Errorf("%s does not document --%s of %s", where, n, command)
		}
	}
}

// TestFlagsAreDocumented: every flag of every command of both binaries,
// and of tpm-boot-policy, is in the docs (docs/node-configuration.md for
// the node, docs/deploy.md for the controller), and the docs name no flag
// a command does not have.
func TestFlagsAreDocumented(t *testing.T) {
	t.Run("kubelet-authenticator", func(t *testing.T) {
		const where = "docs/node-configuration.md (Commands and flags)"
		root := agentapp.NewCommand(io.Discard, io.Discard)
		rows := docTable(t, "docs/node-configuration.md", "## Commands and flags", "| command | flags |")
		documented := map[*cobra.Command][]string{}
		for _, row := range rows {
			var cmds []*cobra.Command
			for _, m := range backticked.FindAllStringSubmatch(row[0], -1) {
				if strings.HasPrefix(m[1], "-") { // a flag of the root command
					documented[root] = append(documented[root], docFlags("`"+m[1]+"`")...)
					continue
				}
				path := strings.Fields(m[1])
				if path[0] != root.Name() {
					continue
				}
				c, rest, err := root.Find(path[1:])
				if err != nil || len(rest) > 0 || c == root {
					t.Errorf("%s names the command %q, which does not exist", where, m[1])
					continue
				}
				cmds = append(cmds, c)
			}
			for _, c := range cmds {
				documented[c] = append(documented[c], docFlags(row[1])...)
			}
		}
		var walk func(c *cobra.Command)
		walk = func(c *cobra.Command) {
			if !slices.Contains([]string{"help", "completion"}, c.Name()) {
				compare(t, where, c.CommandPath(), commandFlags(c), documented[c])
			}
			for _, s := range c.Commands() {
				walk(s)
			}
		}
		walk(root)
	})

	t.Run("tpm-boot-policy", func(t *testing.T) {
		root, err := harness.RepoRoot()
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("go", "run", "./cmd/tpm-boot-policy", "--help")
		cmd.Dir = root
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			t.Fatalf("tpm-boot-policy --help: %v\n%s", err, out.String())
		}
		flags := map[string]string{}
		for _, m := range stdFlag.FindAllStringSubmatch(out.String(), -1) {
			flags["--"+m[1]] = m[1]
		}
		if len(flags) == 0 {
			t.Fatalf("tpm-boot-policy --help lists no flags:\n%s", out.String())
		}
		for _, row := range docTable(t, "docs/node-configuration.md", "## Commands and flags", "| command | flags |") {
			if row[0] == "`tpm-boot-policy`" {
				compare(t, "docs/node-configuration.md (Commands and flags)", "tpm-boot-policy", flags, docFlags(row[1]))
				return
			}
		}
		t.Error("docs/node-configuration.md (Commands and flags) has no row for `tpm-boot-policy`")
	})

	t.Run("node-attestation-controller", func(t *testing.T) {
		const where = "docs/deploy.md (Controller flags)"
		root := signerapp.NewCommand()
		rootFlags := commandFlags(root)
		var documented []string
		for _, row := range docTable(t, "docs/deploy.md", "## Controller flags", "| flag | default | meaning |") {
			documented = append(documented, docFlags(row[0])...)
		}
		compare(t, where, root.CommandPath(), rootFlags, documented)

		standalone, _, err := root.Find([]string{"standalone"})
		if err != nil || standalone == root {
			t.Fatalf("no standalone command: %v", err)
		}
		// The standalone table lists what standalone adds to the flags above.
		own := map[string]string{}
		for k, n := range commandFlags(standalone) {
			if _, shared := rootFlags[k]; !shared {
				own[k] = n
			}
		}
		documented = nil
		for _, row := range standaloneTable(t) {
			documented = append(documented, docFlags(row[0])...)
		}
		compare(t, where+" standalone", standalone.CommandPath(), own, documented)
	})
}

// standaloneTable is the second flag table of docs/deploy.md's Controller
// flags: what standalone adds.
func standaloneTable(t *testing.T) [][]string {
	t.Helper()
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, "docs", "deploy.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i := strings.Index(doc, "\n## Controller flags\n")
	j := strings.Index(doc[max(i, 0):], "\n`node-attestation-controller standalone`")
	if i < 0 || j < 0 {
		t.Fatal("docs/deploy.md: no Controller flags section with a paragraph on `node-attestation-controller standalone`")
	}
	rest := doc[i+j+1:]
	k := strings.Index(rest, "\n| flag | default | meaning |\n")
	if k < 0 {
		t.Fatal("docs/deploy.md: no flag table for standalone")
	}
	var rows [][]string
	for _, line := range strings.Split(rest[k+1:], "\n")[2:] {
		if !strings.HasPrefix(line, "|") {
			break
		}
		rows = append(rows, strings.Split(strings.Trim(line, "|"), "|"))
	}
	return rows
}
