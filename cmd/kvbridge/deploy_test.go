package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// TestDeployArgs: every kvbridge command line in deploy/kubernetes — the engines', the proxies',
// the overlays' patches — parses with this CLI: its subcommand, flags and value types exist.
// (deploy/kubernetes's own test checks what the values mean.)
func TestDeployArgs(t *testing.T) {
	var files []string
	for _, pattern := range []string{"*", "*/*", "*/*/*"} {
		m, err := filepath.Glob(filepath.Join("../../deploy/kubernetes", pattern+".yaml"))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	varRef := regexp.MustCompile(`\$\([A-Za-z_][A-Za-z0-9_]*\)`)
	n := 0
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for doc := range strings.SplitSeq(string(data), "\n---") {
			var w struct {
				Spec struct {
					Template struct {
						Spec struct {
							Containers []struct {
								Name string   `json:"name"`
								Args []string `json:"args"`
							} `json:"containers"`
						} `json:"spec"`
					} `json:"template"`
				} `json:"spec"`
			}
			if err := yaml.Unmarshal([]byte(doc), &w); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			for _, c := range w.Spec.Template.Spec.Containers {
				if len(c.Args) == 0 || (c.Args[0] != "serve" && c.Args[0] != "proxy") {
					continue
				}
				n++
				// $(VAR) comes from the pod's environment (ConfigMaps); a value of the right
				// shape will do here.
				args := make([]string, len(c.Args))
				for i, a := range c.Args {
					v := "kvbridge/tiny"
					if i > 0 && c.Args[i-1] == "--kv-transfer-config" {
						v = `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`
					}
					args[i] = varRef.ReplaceAllString(a, v)
				}
				args, err := normalizeArgs(args)
				if err == nil {
					var cmd, rest = newRootCmd(), []string(nil)
					if cmd, rest, err = cmd.Find(args); err == nil {
						if err = cmd.ParseFlags(rest); err == nil {
							err = cmd.ValidateArgs(cmd.Flags().Args())
						}
					}
				}
				if err != nil {
					t.Errorf("%s, container %s: kvbridge %s: %v", f, c.Name, strings.Join(c.Args, " "), err)
				}
			}
		}
	}
	if n < 3 {
		t.Errorf("found %d kvbridge command lines in deploy/kubernetes; the engines, the proxy and its multi-turn patch have them", n)
	}
}
