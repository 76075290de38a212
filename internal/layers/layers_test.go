package layers

import (
	"go/build"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/kvbridge/kvbridge/"

// allowed is the "imports (kvbridge)" column of docs/architecture.md's package table: the
// kvbridge packages each package's non-test files may import. A package missing here fails the
// test, so that a new package is placed in the table before it lands.
var allowed = map[string][]string{
	// command
	"cmd/kvbridge": {"bench/bidibench", "bench/enginebench", "bench/multiturn", "bench/pdbench", "bench/quality", "bench/routebench", "bench/soak",
		"bench/xferbench", "check", "demo", "conversation", "instance", "proxy", "connector", "openai", "engine",
		"kvcache", "kvevents", "model", "transfer", "internal/buildinfo", "internal/blockhash"},
	// runs
	"check":             {"internal/promtext"},
	"demo":              {"stack", "conversation", "apiclient", "model", "plot"},
	"bench/bidibench":   {"conversation", "stack", "apiclient", "stats", "plot", "model", "kvcache", "engine", "model/kernel"},
	"bench/pdbench":     {"stack", "apiclient", "stats", "instance", "netns", "proxy", "model", "kvcache", "engine", "model/kernel"},
	"bench/soak":        {"stack", "apiclient", "faultproxy", "connector", "instance", "proxy", "model"},
	"bench/enginebench": {"model", "model/kernel", "kvcache", "stack", "internal/procmem"},
	"bench/quality":     {"model", "model/kernel", "kvcache", "stack"},
	"bench/xferbench":   {"transfer", "stats"},
	"bench/routebench":  {"stack", "apiclient", "stats", "instance", "proxy", "connector", "kvevents", "kvcache", "model", "internal/blockhash"},
	"bench/multiturn":   {"apiclient", "stats", "model", "model/tokenizer", "plot"},
	// workload
	"conversation": {"stack", "apiclient", "stats", "instance", "proxy", "model", "model/tokenizer", "kvcache"},
	// assembly
	"stack":    {"instance", "proxy", "connector", "faultproxy", "kvevents", "model"},
	"instance": {"openai", "connector", "engine", "kvcache", "kvevents", "metrics", "model", "model/kernel", "transfer", "internal/procmem", "internal/blockhash"},
	// serving
	"openai":    {"engine", "metrics", "model", "model/tokenizer", "internal/buildinfo", "internal/httpdeadline"},
	"proxy":     {"internal/httpdeadline", "internal/blockhash", "internal/msgpackcheck"},
	"connector": {"engine", "kvcache", "metrics", "transfer", "internal/kvlease", "internal/msgpackcheck"},
	// core
	"engine":   {"kvcache", "model", "model/tokenizer"},
	"metrics":  {"stats"},
	"transfer": {"internal/msgpackcheck", "transfer/internal/wire"},
	// base
	"kvcache":         {"internal/blockhash"},
	"kvevents":        {"kvcache"},
	"model":           {"model/kernel", "model/tokenizer"},
	"model/kernel":    {},
	"model/tokenizer": {},
	// leaves
	"stats": {}, "plot": {}, "apiclient": {}, "faultproxy": {}, "netns": {},
	"internal/msgpackcheck": {}, "internal/kvlease": {}, "internal/blockhash": {}, "internal/procmem": {}, "internal/buildinfo": {}, "internal/httpdeadline": {},
	"internal/fixture": {"internal/promtext", "internal/blockhash"}, "internal/promtext": {}, "transfer/internal/wire": {},
	// tests only
	"reliability": {}, "deploy/kubernetes": {}, "deploy/grafana": {}, "internal/layers": {},
}

// TestLayering: every kvbridge package imports only what docs/architecture.md's table allows,
// every package is in the table (and named in the document), and the table names no package
// that does not exist.
func TestLayering(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "architecture.md"))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		if name := d.Name(); path != root && (strings.HasPrefix(name, ".") || name == "testdata") {
			return filepath.SkipDir
		}
		pkg, err := build.ImportDir(path, 0)
		if err != nil {
			if _, ok := err.(*build.NoGoError); ok {
				return nil
			}
			t.Errorf("%s: %v", path, err)
			return nil
		}
		rel, _ := filepath.Rel(root, path)
		rel = filepath.ToSlash(rel)
		seen[rel] = true
		allow, ok := allowed[rel]
		if !ok {
			t.Errorf("package %s is not in the layering table: add it to docs/architecture.md and to allowed", rel)
			return nil
		}
		if !strings.Contains(string(doc), "`"+rel+"`") {
			t.Errorf("package %s is not named in docs/architecture.md", rel)
		}
		for _, imp := range pkg.Imports {
			dep, ok := strings.CutPrefix(imp, module)
			if ok && !slices.Contains(allow, dep) {
				t.Errorf("%s imports %s, which docs/architecture.md does not allow (allowed: %s)", rel, dep, strings.Join(allow, ", "))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for pkg := range allowed {
		if !seen[pkg] {
			t.Errorf("the layering table names %s, which is no package", pkg)
		}
	}
}
