package main

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestVLLMShortFlags: vLLM's single-dash aliases and -O forms become the long flags.
func TestVLLMShortFlags(t *testing.T) {
	cases := []struct{ in, want []string }{
		{[]string{"serve", "M", "-tp", "1", "-dp=1", "-pp", "1"}, []string{"serve", "M", "--tensor-parallel-size", "1", "--data-parallel-size=1", "--pipeline-parallel-size", "1"}},
		{[]string{"serve", "M", "-O3"}, []string{"serve", "M", "--optimization-level=3"}},
		{[]string{"serve", "M", "-O", "2"}, []string{"serve", "M", "--optimization-level", "2"}},
		{[]string{"serve", "M", "-O=1"}, []string{"serve", "M", "--optimization-level=1"}},
		{[]string{"serve", "M", "-O.level", "3"}, []string{"serve", "M", "--compilation-config", `{"level":3}`}},
		{[]string{"serve", "M", "-O", `{"cudagraph_mode":"FULL"}`}, []string{"serve", "M", "--compilation-config", `{"cudagraph_mode":"FULL"}`}},
		// Other commands keep their own short flags.
		{[]string{"bench", "multi-turn", "-p", "2"}, []string{"bench", "multi-turn", "-p", "2"}},
	}
	for _, c := range cases {
		got, err := normalizeArgs(c.in)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("normalizeArgs(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
}

// TestConfigFile: --config FILE reads a YAML file as vLLM does — its flags go after the
// subcommand and model, so the command line wins; true is the bare flag, false drops it (YAML
// 1.1's yes/no/on/off included), lists repeat the values, mappings become JSON — and refuses a
// file that is not .yaml/.yml.
func TestConfigFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "serve.yaml")
	yaml := `port: 8100
max_model_len: 4096
enforce-eager: true
enable-prompt-tokens-details: yes
disable-log-stats: off
served-model-name: [a, b]
kv-transfer-config:
  kv_connector: NixlConnector
  kv_role: kv_producer
`
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := normalizeArgs([]string{"serve", "kvbridge/tiny", "--config", path, "--port", "9000"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"serve", "kvbridge/tiny", "--port", "8100", "--max-model-len", "4096", "--enforce-eager",
		"--enable-prompt-tokens-details", "--served-model-name", "a", "--served-model-name", "b", "--port", "9000",
		"--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`}
	if !slices.Equal(got, want) {
		t.Errorf("normalizeArgs = %q\nwant %q", got, want)
	}
	// The resulting command line parses, and the command line's --port wins.
	var f serveFlags
	cmd := serveCommand(func(_ context.Context, sf serveFlags) error { f = sf; return nil })
	cmd.SetArgs(got[1:])
	cmd.SetOut(io.Discard)
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	cfg, err := f.instanceConfig(slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Port != 9000 || cfg.MaxModelLen != 4096 || !cfg.PromptTokensDetails || cfg.DisableLogStats || !slices.Equal(cfg.ServedModelNames, []string{"a", "b"}) || cfg.KVTransfer == nil {
		t.Errorf("config from the file: %+v", cfg)
	}
	txt := filepath.Join(dir, "serve.json")
	_ = os.WriteFile(txt, []byte("{}"), 0o644)
	if _, err := normalizeArgs([]string{"serve", "M", "--config", txt}); err == nil || !strings.Contains(err.Error(), "yaml/yml") {
		t.Errorf("a .json config: %v", err)
	}
}

// TestServeVLLMFlags: flags that only tune vLLM's Python internals are accepted; those with an
// effect here set it; those that would change results are refused naming the flag (exit 2).
func TestServeVLLMFlags(t *testing.T) {
	parse := func(args ...string) (serveFlags, error) {
		var f serveFlags
		args, err := normalizeArgs(append([]string{"serve", "kvbridge/tiny"}, args...))
		if err != nil {
			return f, err
		}
		cmd := serveCommand(func(_ context.Context, sf serveFlags) error { f = sf; return nil })
		cmd.SetArgs(args[1:])
		cmd.SetOut(io.Discard)
		cmd.SetErr(io.Discard)
		return f, cmd.Execute()
	}
	f, err := parse("-tp", "1", "-dp", "1", "-O3", "--uvicorn-log-level", "warning", "--disable-log-requests", "--disable-log-stats",
		"--enable-force-include-usage", "--enable-prompt-tokens-details", "--gpu-memory-utilization", "0.9", "--max-logprobs", "5",
		"--trust-remote-code", "--dtype", "auto", "--enable-chunked-prefill", "--swap-space", "4", "-O.level", "3")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := f.instanceConfig(slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if !cfg.DisableLogStats || !cfg.ForceIncludeUsage || !cfg.PromptTokensDetails || cfg.MaxLogprobs != 5 {
		t.Errorf("config: %+v", cfg)
	}
	if f, _ := parse("-q", "int8"); func() string { c, _ := f.instanceConfig(slog.New(slog.DiscardHandler)); return c.Quantization }() != "int8" {
		t.Error("-q int8 does not reach the instance's config")
	}
	if f, _ := parse(); func() bool { c, _ := f.instanceConfig(slog.New(slog.DiscardHandler)); return c.PromptTokensDetails }() {
		t.Error("prompt tokens details on by default (vLLM has them off)")
	}
	for _, c := range []struct {
		args []string
		flag string
	}{
		{[]string{"-tp", "0"}, "--tensor-parallel-size 0"},
		{[]string{"-tp", "2", "--kv-transfer-config", `{"kv_connector":"NixlPushConnector","kv_role":"kv_producer","kv_connector_extra_config":{"push_layerwise":true}}`}, "layer-by-layer push needs a prefiller at TP 1"},
		{[]string{"-tp", "2", "--tp-cpus", "0-1|x"}, "--tp-cpus"},
		{[]string{"-dp", "0"}, "--data-parallel-size 0"},
		{[]string{"-pp", "2"}, "--pipeline-parallel-size 2"},
		{[]string{"-q", "awq"}, "--quantization awq"},
		{[]string{"--dtype", "float16"}, `--dtype "float16"`},
		{[]string{"--kv-cache-dtype", "fp8_inc"}, `--kv-cache-dtype "fp8_inc"`},
		{[]string{"--max-logprobs", "-3"}, "--max-logprobs -3"},
	} {
		f, err := parse(c.args...)
		if err == nil {
			_, err = f.instanceConfig(slog.New(slog.DiscardHandler))
		}
		if err == nil || !strings.Contains(err.Error(), c.flag) {
			t.Errorf("%q: %v, want an error naming %s", c.args, err, c.flag)
		}
	}
	// Through the whole command line: exit status 2 and the flag named.
	if code := run([]string{"serve", "kvbridge/tiny", "-tp", "3"}); code != 2 {
		t.Errorf("kvbridge serve -tp 3 (4 attention heads) exited %d, want 2", code)
	}
}

// TestProxyBadMaxConversationBytes: a size the proxy cannot read stops it with exit status 2.
func TestProxyBadMaxConversationBytes(t *testing.T) {
	for _, v := range []string{"0", "-1", "lots"} {
		if code := run([]string{"proxy", "--multi-turn", "--port", "0", "--max-conversation-bytes", v}); code != 2 {
			t.Errorf("kvbridge proxy --max-conversation-bytes %s exited %d, want 2", v, code)
		}
	}
}

// TestBenchMultiTurnFlags: the vLLM script's -v, --print-content, -e and --version parse, and
// --version prints the script's version line and exits 0.
func TestBenchMultiTurnFlags(t *testing.T) {
	cmd := newBenchMultiTurnCmd()
	var out strings.Builder
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"-v", "--print-content", "-e", "--version"})
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "Benchmark serving with multi-turn conversations 1.0") {
		t.Errorf("--version printed %q", out.String())
	}
	if code := run([]string{"bench", "multi-turn", "--version"}); code != 0 {
		t.Errorf("kvbridge bench multi-turn --version exited %d", code)
	}
}
