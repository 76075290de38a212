package main

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
)

// TestNormalizeArgsSeedGuide checks the argument forms the seed guide writes.
func TestNormalizeArgsSeedGuide(t *testing.T) {
	tests := []struct {
		name string
		in   []string
		rest []string
		json map[string]any
	}{
		{
			name: "json",
			in:   []string{"serve", "Qwen/Qwen3-0.6B", "--port", "8100", "--enforce-eager", "--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_load_failure_policy":"fail"}`},
			rest: []string{"serve", "Qwen/Qwen3-0.6B", "--port", "8100", "--enforce-eager"},
			json: map[string]any{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_load_failure_policy": "fail"},
		},
		{
			name: "dotted and append",
			in: []string{"serve", "M", "--kv-transfer-config.kv_connector", "NixlConnector", "--kv-transfer-config.kv_role", "kv_producer",
				"--kv-transfer-config.kv_connector_extra_config.backends+", "TCP", "--kv-transfer-config.kv_connector_extra_config.backends+=SHM,TCP"},
			rest: []string{"serve", "M"},
			json: map[string]any{"kv_connector": "NixlConnector", "kv_role": "kv_producer",
				"kv_connector_extra_config": map[string]any{"backends": []any{"TCP", "SHM", "TCP"}}},
		},
		{
			name: "dotted values are typed",
			in:   []string{"--kv-transfer-config.kv_connector_extra_config.kv_lease_duration=60", "--kv-transfer-config.kv_connector_extra_config.bidirectional_kv_xfer", "true"},
			json: map[string]any{"kv_connector_extra_config": map[string]any{"kv_lease_duration": 60.0, "bidirectional_kv_xfer": true}},
		},
		{
			name: "json then dotted merge",
			in:   []string{"--kv_transfer_config", `{"kv_role":"kv_consumer","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}`, "--kv-transfer-config.kv_connector", "NixlConnector", "--max_model_len", "4096"},
			rest: []string{"--max-model-len", "4096"},
			json: map[string]any{"kv_role": "kv_consumer", "kv_connector": "NixlConnector", "kv_connector_extra_config": map[string]any{"bidirectional_kv_xfer": true}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, err := normalizeArgs(tt.in)
			if err != nil {
				t.Fatal(err)
			}
			n := len(out)
			if n < 2 || out[n-2] != "--kv-transfer-config" {
				t.Fatalf("normalizeArgs(%q) = %q: no --kv-transfer-config at the end", tt.in, out)
			}
			var got map[string]any
			if err := json.Unmarshal([]byte(out[n-1]), &got); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.json) {
				t.Errorf("config = %v, want %v", got, tt.json)
			}
			if rest := out[:n-2]; !reflect.DeepEqual(rest, tt.rest) && !(len(rest) == 0 && len(tt.rest) == 0) {
				t.Errorf("other args = %q, want %q", rest, tt.rest)
			}
		})
	}
}

func TestNormalizeArgsErrors(t *testing.T) {
	for _, in := range [][]string{
		{"--kv-transfer-config"},
		{"--kv-transfer-config", "[1,2]"},
		{"--kv-transfer-config", "not json"},
		{"--kv-transfer-config.", "x"},
		{"--kv-transfer-config.a..b", "x"},
		{"--port.x", "1"},
	} {
		if _, err := normalizeArgs(in); !errors.Is(err, errUsage) {
			t.Errorf("normalizeArgs(%q) error = %v, want a usage error", in, err)
		}
	}
}

func TestScalarValue(t *testing.T) {
	for in, want := range map[string]any{"60": 60.0, "true": true, "1k": int64(1000), "2K": int64(2048), "1G": int64(1 << 30), "abc": "abc", `["A"]`: []any{"A"}} {
		if got := scalarValue(in); !reflect.DeepEqual(got, want) {
			t.Errorf("scalarValue(%q) = %#v, want %#v", in, got, want)
		}
	}
}

func TestNormalizeArgsMultiValue(t *testing.T) {
	in := []string{"proxy", "--port", "8192", "--prefiller-hosts", "10.0.0.1", "10.0.0.2", "--prefiller-ports", "8000", "8000", "--decoder_host", "h"}
	want := []string{"proxy", "--port", "8192", "--prefiller-hosts", "10.0.0.1", "--prefiller-hosts", "10.0.0.2",
		"--prefiller-ports", "8000", "--prefiller-ports", "8000", "--decoder-host", "h"}
	got, err := normalizeArgs(in)
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("normalizeArgs(%q) = %q, %v; want %q", in, got, err, want)
	}
	if _, err := normalizeArgs([]string{"--decoder-ports", "--port", "1"}); !errors.Is(err, errUsage) {
		t.Errorf("--decoder-ports without a value: error = %v, want a usage error", err)
	}
}

// FuzzNormalizeArgs: arbitrary argument lists are rewritten or refused with a usage error;
// a JSON flag always comes out as one valid JSON object.
func FuzzNormalizeArgs(f *testing.F) {
	f.Add("serve\x00M\x00--kv-transfer-config.kv_role\x00kv_producer\x00--kv-transfer-config.kv_connector_extra_config.backends+\x00TCP")
	f.Add("--kv-transfer-config\x00{\"a\":1}\x00--kv-transfer-config.a+=x,y\x00--decoder-hosts\x00a\x00b")
	f.Add("--kv_transfer_config.\x00x")
	f.Fuzz(func(t *testing.T, joined string) {
		out, err := normalizeArgs(strings.Split(joined, "\x00"))
		if err != nil {
			if !errors.Is(err, errUsage) {
				t.Fatalf("error %v is not a usage error", err)
			}
			return
		}
		for i, a := range out {
			if a == "--" {
				break // what follows is positional, passed through as given
			}
			if a == "--kv-transfer-config" && i+1 < len(out) {
				var m map[string]any
				if json.Unmarshal([]byte(out[i+1]), &m) != nil {
					t.Fatalf("--kv-transfer-config value %q is not a JSON object", out[i+1])
				}
			}
		}
	})
}

// TestFormatBytes: the size flag's default is written as a user would type it, and reads back.
func TestFormatBytes(t *testing.T) {
	for n, want := range map[int64]string{1 << 30: "1G", 512 << 20: "512M", 3 << 10: "3K", 1000: "1000", 1 << 40: "1T"} {
		got := formatBytes(n)
		back, err := parseBytes(got)
		if got != want || err != nil || back != n {
			t.Errorf("formatBytes(%d) = %q, read back as %d (%v); want %q", n, got, back, err, want)
		}
	}
}
