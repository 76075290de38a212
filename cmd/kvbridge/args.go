package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// errUsage marks command-line errors; main exits with status 2 for them.
var errUsage = errors.New("usage")

// usageError formats a command-line error that makes kvbridge exit with status 2.
func usageError(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errUsage, fmt.Sprintf(format, args...))
}

// jsonFlags are the flags that take a JSON object and may also be given key by key with dotted
// names, as vLLM's FlexibleArgumentParser allows:
//
//	--kv-transfer-config '{"kv_role":"kv_producer"}'
//	--kv-transfer-config.kv_role kv_producer
//	--kv-transfer-config.kv_connector_extra_config.backends+ TCP
var jsonFlags = []string{"kv-transfer-config", "kv-events-config", "compilation-config"}

// multiValueFlags take one or more values like argparse's nargs="+": "--decoder-hosts a b" is
// rewritten to "--decoder-hosts a --decoder-hosts b".
var multiValueFlags = []string{
	"served-model-name",
	"prefiller-hosts", "prefiller-host", "prefiller-ports", "prefiller-port",
	"decoder-hosts", "decoder-host", "decoder-ports", "decoder-port",
}

// normalizeArgs rewrites vLLM-style arguments into what the flag parser understands: underscores
// in flag names become dashes (--max_model_len is --max-model-len), and the dotted and JSON forms
// of each JSON flag are merged into one --flag '<json>' argument. Dotted values are decoded as JSON
// when they parse (numbers, booleans, lists, objects), then as human-readable integers (1k, 2M),
// else kept as strings; a trailing + appends comma-separated strings to a list.
func normalizeArgs(args []string) ([]string, error) {
	args, err := expandVLLMArgs(args)
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(args))
	merged := map[string]map[string]any{}
	var order []string
	add := func(flag string, m map[string]any) {
		if _, ok := merged[flag]; !ok {
			merged[flag] = map[string]any{}
			order = append(order, flag)
		}
		mergeJSON(merged[flag], m)
	}
	for i := 0; i < len(args); i++ {
		arg := args[i]
		if arg == "--" {
			out = append(out, args[i:]...)
			break
		}
		if !strings.HasPrefix(arg, "--") {
			out = append(out, arg)
			continue
		}
		name, value, hasValue := strings.Cut(arg[2:], "=")
		base, path, dotted := strings.Cut(name, ".")
		base = strings.ReplaceAll(base, "_", "-")
		if !isJSONFlag(base) && !dotted && !hasValue && slices.Contains(multiValueFlags, base) {
			j := i + 1
			for ; j < len(args) && !strings.HasPrefix(args[j], "-"); j++ {
				out = append(out, "--"+base, args[j])
			}
			if j == i+1 {
				return nil, usageError("flag --%s needs at least one value", base)
			}
			i = j - 1
			continue
		}
		if !isJSONFlag(base) {
			if dotted {
				return nil, usageError("unknown flag --%s (only %s accept dotted keys)", name, strings.Join(jsonFlagNames(), ", "))
			}
			if hasValue {
				out = append(out, "--"+base+"="+value)
			} else {
				out = append(out, "--"+base)
			}
			continue
		}
		if !hasValue {
			if i+1 >= len(args) {
				return nil, usageError("flag --%s needs a value", name)
			}
			i++
			value = args[i]
		}
		if !dotted {
			var m map[string]any
			if err := json.Unmarshal([]byte(value), &m); err != nil || m == nil {
				return nil, usageError("--%s must be a JSON object: %v", base, jsonErr(err))
			}
			add(base, m)
			continue
		}
		m, err := dottedValue(path, value)
		if err != nil {
			return nil, usageError("--%s.%s: %v", base, path, err)
		}
		add(base, m)
	}
	for _, flag := range order {
		data, err := json.Marshal(merged[flag])
		if err != nil {
			return nil, usageError("--%s: %v", flag, err)
		}
		out = append(out, "--"+flag, string(data))
	}
	return out, nil
}

func isJSONFlag(name string) bool { return slices.Contains(jsonFlags, name) }

func jsonFlagNames() []string {
	names := make([]string, len(jsonFlags))
	for i, f := range jsonFlags {
		names[i] = "--" + f
	}
	return names
}

func jsonErr(err error) error {
	if err == nil {
		return errors.New("got null")
	}
	return err
}

// dottedValue turns "a.b+" and a value into {"a":{"b":[...]}}.
func dottedValue(path, raw string) (map[string]any, error) {
	appendList := strings.HasSuffix(path, "+")
	path = strings.TrimSuffix(path, "+")
	keys := strings.Split(path, ".")
	for _, k := range keys {
		if k == "" {
			return nil, errors.New("empty key in dotted name")
		}
	}
	var v any
	if appendList {
		items := []any{}
		for _, s := range strings.Split(raw, ",") {
			items = append(items, s)
		}
		v = items
	} else {
		v = scalarValue(raw)
	}
	for i := len(keys) - 1; i >= 1; i-- {
		v = map[string]any{keys[i]: v}
	}
	return map[string]any{keys[0]: v}, nil
}

var humanInt = regexp.MustCompile(`^(\d+(?:\.\d+)?)([kKmMgGtT])$`)

// scalarValue decodes a dotted value the way vLLM does: JSON first, then 1k/2M style integers,
// else the string itself.
func scalarValue(raw string) any {
	var v any
	if err := json.Unmarshal([]byte(raw), &v); err == nil {
		return v
	}
	if m := humanInt.FindStringSubmatch(strings.TrimSpace(raw)); m != nil {
		f, _ := strconv.ParseFloat(m[1], 64)
		switch m[2] {
		case "k":
			return int64(f * 1e3)
		case "m":
			return int64(f * 1e6)
		case "g":
			return int64(f * 1e9)
		case "t":
			return int64(f * 1e12)
		}
		if n, err := strconv.ParseInt(m[1], 10, 64); err == nil {
			shift := map[string]uint{"K": 10, "M": 20, "G": 30, "T": 40}[m[2]]
			return n << shift
		}
	}
	return raw
}

// mergeJSON merges src into dst: objects merge key by key, lists append, anything else replaces.
func mergeJSON(dst, src map[string]any) {
	for k, v := range src {
		switch sv := v.(type) {
		case map[string]any:
			if dv, ok := dst[k].(map[string]any); ok {
				mergeJSON(dv, sv)
				continue
			}
		case []any:
			if dv, ok := dst[k].([]any); ok {
				dst[k] = append(dv, sv...)
				continue
			}
		}
		dst[k] = v
	}
}
