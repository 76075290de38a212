package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"
)

// vllmShortFlags are vLLM's single-dash aliases of `vllm serve` flags.
var vllmShortFlags = map[string]string{
	"-tp":  "--tensor-parallel-size",
	"-pp":  "--pipeline-parallel-size",
	"-dp":  "--data-parallel-size",
	"-dpn": "--data-parallel-rank",
	"-dpr": "--data-parallel-start-rank",
	"-dpl": "--data-parallel-size-local",
	"-dpa": "--data-parallel-address",
	"-dpp": "--data-parallel-rpc-port",
	"-dpb": "--data-parallel-backend",
	"-dph": "--data-parallel-hybrid-lb",
	"-dpe": "--data-parallel-external-lb",
	"-dcp": "--decode-context-parallel-size",
	"-pcp": "--prefill-context-parallel-size",
	"-ep":  "--enable-expert-parallel",
	"-asc": "--api-server-count",
	"-q":   "--quantization",
	"-cc":  "--compilation-config",
}

// expandVLLMArgs rewrites what vLLM's FlexibleArgumentParser accepts and cobra does not, for
// `serve`: --config FILE (a YAML file of flag: value pairs, inserted after the subcommand and
// model so that the command line wins, as vLLM does), the single-dash aliases (-tp 2, -dp=2),
// and -O: -O3, -O=3 and -O 3 are --optimization-level, -O.key value and -O '{…}' are
// --compilation-config. Other commands are left as they are.
//
// For `bench`, only -tp is rewritten (`bench engine -tp 1,2`).
func expandVLLMArgs(args []string) ([]string, error) {
	if len(args) > 0 && args[0] == "bench" {
		out := slices.Clone(args)
		for i, a := range out {
			if a == "--" {
				break
			}
			if name, value, hasValue := strings.Cut(a, "="); name == "-tp" {
				out[i] = "--tensor-parallel-size"
				if hasValue {
					out[i] += "=" + value
				}
			}
		}
		return out, nil
	}
	if len(args) == 0 || args[0] != "serve" {
		return args, nil
	}
	args, err := pullConfigFile(args)
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			out = append(out, args[i:]...)
			break
		}
		name, value, hasValue := strings.Cut(a, "=")
		if long, ok := vllmShortFlags[name]; ok {
			if hasValue {
				out = append(out, long+"="+value)
			} else {
				out = append(out, long)
			}
			continue
		}
		switch {
		case a == "-O" && i+1 < len(args) && optimizationLevel.MatchString(args[i+1]):
			out = append(out, "--optimization-level")
		case a == "-O":
			out = append(out, "--compilation-config")
		case strings.HasPrefix(a, "-O."):
			out = append(out, "--compilation-config"+a[2:])
		case strings.HasPrefix(a, "-O="):
			out = append(out, "--optimization-level="+a[3:])
		case strings.HasPrefix(a, "-O") && !strings.HasPrefix(a, "--"):
			out = append(out, "--optimization-level="+a[2:])
		default:
			out = append(out, a)
		}
	}
	return out, nil
}

var optimizationLevel = regexp.MustCompile(`^[0-3]$`)

// pullConfigFile replaces --config FILE by the flags the file holds, placed after "serve" and
// the model (if the command line names one) and before the other arguments.
func pullConfigFile(args []string) ([]string, error) {
	idx, path := -1, ""
	for i, a := range args {
		switch {
		case a == "--config":
			if idx >= 0 {
				return nil, usageError("--config is given twice: more than one config file specified")
			}
			if i+1 >= len(args) {
				return nil, usageError("--config needs a file: no config file specified")
			}
			idx, path = i, args[i+1]
		case strings.HasPrefix(a, "--config="):
			if idx >= 0 {
				return nil, usageError("--config is given twice: more than one config file specified")
			}
			idx, path = i, strings.TrimPrefix(a, "--config=")
		}
	}
	if idx < 0 {
		return args, nil
	}
	rest := append(append([]string(nil), args[:idx]...), args[idx+1:]...)
	if !strings.HasPrefix(args[idx], "--config=") {
		rest = append(append([]string(nil), args[:idx]...), args[idx+2:]...)
	}
	flags, err := loadConfigFile(path)
	if err != nil {
		return nil, err
	}
	at := 1 // after "serve"
	if len(rest) > 1 && !strings.HasPrefix(rest[1], "-") {
		at = 2 // after the model
	}
	out := append(append(append([]string(nil), rest[:at]...), flags...), rest[at:]...)
	return out, nil
}

// yaml11Bool matches the plain scalars YAML 1.1 (PyYAML's safe_load, which vLLM uses) reads as
// booleans.
var yaml11Bool = regexp.MustCompile(`^(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)$`)

// loadConfigFile reads a vLLM config file: a YAML mapping of flag names to values, turned into
// arguments as vLLM's load_config_file does — true is the bare flag, false leaves it out, a list
// gives the flag then each item, anything else the flag then the value. Mappings (such as
// kv-transfer-config) are passed as JSON.
func loadConfigFile(path string) ([]string, error) {
	if ext := strings.TrimPrefix(filepath.Ext(path), "."); ext != "yaml" && ext != "yml" {
		return nil, usageError("--config %s: the config file must be of a yaml/yml type, %q supplied", path, ext)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, usageError("--config: unable to read the config file: %v", err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, usageError("--config %s: %v", path, err)
	}
	if len(doc.Content) == 0 {
		return nil, nil
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, usageError("--config %s: the file must be a mapping of flag names to values", path)
	}
	var out []string
	for i := 0; i+1 < len(root.Content); i += 2 {
		key, val := root.Content[i].Value, root.Content[i+1]
		flag := "--" + key
		v, err := yamlValue(val)
		if err != nil {
			return nil, usageError("--config %s: key %s: %v", path, key, err)
		}
		switch v := v.(type) {
		case bool:
			if v {
				out = append(out, flag)
			}
		case []any:
			if len(v) > 0 {
				out = append(out, flag)
				for _, item := range v {
					out = append(out, scalarString(item))
				}
			}
		case map[string]any:
			b, err := json.Marshal(v)
			if err != nil {
				return nil, usageError("--config %s: key %s: %v", path, key, err)
			}
			out = append(out, flag, string(b))
		case nil:
			out = append(out, flag, "None")
		default:
			out = append(out, flag, scalarString(v))
		}
	}
	return out, nil
}

// yamlValue decodes a node with YAML 1.1's booleans.
func yamlValue(n *yaml.Node) (any, error) {
	switch n.Kind {
	case yaml.ScalarNode:
		if n.Style == 0 && n.Tag == "!!str" && yaml11Bool.MatchString(n.Value) {
			switch strings.ToLower(n.Value) {
			case "yes", "true", "on":
				return true, nil
			}
			return false, nil
		}
	case yaml.SequenceNode:
		out := make([]any, 0, len(n.Content))
		for _, c := range n.Content {
			v, err := yamlValue(c)
			if err != nil {
				return nil, err
			}
			out = append(out, v)
		}
		return out, nil
	case yaml.AliasNode:
		return yamlValue(n.Alias)
	}
	var v any
	if err := n.Decode(&v); err != nil {
		return nil, err
	}
	return v, nil
}

// scalarString writes a scalar as Python's str() would for a command-line value.
func scalarString(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case bool:
		if v {
			return "True"
		}
		return "False"
	case map[string]any, []any:
		b, _ := json.Marshal(v)
		return string(b)
	}
	return fmt.Sprint(v)
}
