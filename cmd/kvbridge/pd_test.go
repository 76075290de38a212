package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
)

var tinyServe = []string{"serve", "kvbridge/tiny", "--host", "127.0.0.1", "--port", "0", "--num-gpu-blocks-override", "512", "--max-model-len", "4096"}

func serveArgs(extra ...string) []string {
	return append(append([]string(nil), tinyServe...), extra...)
}

// sideChannel picks a free side-channel port for each engine process.
var sideChannel = []string{"VLLM_NIXL_SIDE_CHANNEL_PORT=0"}

// TestCrossProcessPD runs the seed guide's topology as separate processes — a prefiller, a
// decoder and `kvbridge proxy` — over each transfer backend, and checks the output against a
// single engine's. The backend is forced with the guide's dotted `+` syntax.
func TestCrossProcessPD(t *testing.T) { crossProcessPD(t, []string{"SHM", "TCP"}) }

// TestCrossProcessPDBF16 is TestCrossProcessPD with bfloat16 matrix products (--dtype bfloat16)
// on every engine: P/D still gives the single engine's tokens exactly.
func TestCrossProcessPDBF16(t *testing.T) { crossProcessPD(t, []string{"SHM"}, "--dtype", "bfloat16") }

// TestCrossProcessPDBF16KV adds a bfloat16 KV cache (--kv-cache-dtype bfloat16: 2 bytes a
// value moved between the engines), over both backends.
func TestCrossProcessPDBF16KV(t *testing.T) {
	crossProcessPD(t, []string{"SHM", "TCP"}, "--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16")
}

// TestCrossProcessPDFP8KV adds an FP8 KV cache (--kv-cache-dtype fp8: 1 byte a value moved
// between the engines) to bfloat16 products, over both backends.
func TestCrossProcessPDFP8KV(t *testing.T) {
	crossProcessPD(t, []string{"SHM", "TCP"}, "--dtype", "bfloat16", "--kv-cache-dtype", "fp8")
}

// crossProcessPD runs the P/D topology over each backend with the extra serve flags.
func crossProcessPD(t *testing.T, backends []string, extra ...string) {
	serveArgs := func(more ...string) []string { return append(append(serveArgs(), extra...), more...) }
	single := startProcess(t, nil, serveArgs()...)
	prompts := []any{"Hi", "The KV cache of this prompt is computed on one process and read by another.",
		strings.Repeat("many words make many blocks ", 30), []int{5, 6, 7}}
	want := make([]string, len(prompts))
	for i, p := range prompts {
		status, raw := postJSON(t, single.url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": p, "max_tokens": 12, "temperature": 0})
		if status != 200 {
			t.Fatalf("single: %d %s", status, raw)
		}
		want[i] = completionText(t, raw)
	}
	for _, backend := range backends {
		t.Run(backend, func(t *testing.T) {
			cfg := func(role string) []string {
				return serveArgs("--kv-transfer-config.kv_connector", "NixlConnector", "--kv-transfer-config.kv_role", role,
					"--kv-transfer-config.kv_connector_extra_config.backends+", backend)
			}
			p := startProcess(t, sideChannel, cfg("kv_producer")...)
			d := startProcess(t, sideChannel, cfg("kv_consumer")...)
			px := startProcess(t, nil, "proxy", "--port", "0", "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", port(t, p.url),
				"--decoder-hosts", "127.0.0.1", "--decoder-ports", port(t, d.url))
			for i, prompt := range prompts {
				status, raw := postJSON(t, px.url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0})
				if status != 200 {
					t.Fatalf("proxy: %d %s\nP: %s\nD: %s", status, raw, p.log(), d.log())
				}
				if got := completionText(t, raw); got != want[i] {
					t.Errorf("prompt %d: P/D %q, single %q", i, got, want[i])
				}
			}
			if !d.waitLog(t, "backend="+backend) {
				t.Errorf("D did not report the %s backend:\n%s", backend, d.log())
			}
		})
	}
}

func port(t *testing.T, url string) string {
	t.Helper()
	i := strings.LastIndexByte(url, ':')
	if i < 0 {
		t.Fatalf("no port in %s", url)
	}
	return url[i+1:]
}

// TestProducerKilledBeforeRead: P computes a prompt's KV and is killed with SIGKILL before D
// reads it. Under policy fail the client gets HTTP 500 in OpenAI's error JSON; under recompute,
// a normal 200 with the single engine's output. Never a hang.
func TestProducerKilledBeforeRead(t *testing.T) {
	prompt := strings.Repeat("a prompt long enough for several blocks ", 8)
	single := startProcess(t, nil, serveArgs()...)
	status, raw := postJSON(t, single.url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
	if status != 200 {
		t.Fatal(string(raw))
	}
	want := completionText(t, raw)
	for _, policy := range []string{"fail", "recompute"} {
		t.Run(policy, func(t *testing.T) {
			p := startProcess(t, sideChannel, serveArgs("--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`)...)
			d := startProcess(t, sideChannel, serveArgs("--kv-transfer-config",
				fmt.Sprintf(`{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":%q}`, policy))...)
			status, raw := postJSON(t, p.url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 1,
				"kv_transfer_params": map[string]any{"do_remote_decode": true}})
			if status != 200 {
				t.Fatal(string(raw))
			}
			var pr struct {
				KV map[string]any `json:"kv_transfer_params"`
			}
			if err := json.Unmarshal(raw, &pr); err != nil || pr.KV == nil {
				t.Fatalf("no params from P: %s", raw)
			}
			p.kill()
			<-p.done
			status, raw = postJSON(t, d.url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "kv_transfer_params": pr.KV})
			switch policy {
			case "fail":
				internalError(t, answer{status: status, body: raw})
			case "recompute":
				if status != 200 || completionText(t, raw) != want {
					t.Fatalf("dead producer under recompute: %d %s, want %q", status, raw, want)
				}
			}
			if !d.waitLog(t, "NIXL transfer failure") {
				t.Errorf("D did not log the failure:\n%s", d.log())
			}
		})
	}
}

// TestCLIErrors: a bad flag, value or config key exits with status 2 and a message naming it.
func TestCLIErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--no-such-flag"}, "no-such-flag"},
		{[]string{"serve", "kvbridge/tiny", "--tensor-parallel-size", "3"}, "--tensor-parallel-size 3: model: tensor parallelism: size 3 does not divide the 4 attention heads"},
		{[]string{"serve", "kvbridge/tiny", "--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"kv_lease_duration":"long"}}`}, "kv_lease_duration"},
		{[]string{"serve", "kvbridge/tiny", "--kv-transfer-config.kv_connector", "NixlConnector", "--kv-transfer-config.kv_role", "kv_producer", "--kv-transfer-config.kv_connector_extra_config.backends+", "UCX"}, "not available in this build"},
		{[]string{"serve", "kvbridge/tiny", "--kv-transfer-config", "{nope"}, "kv-transfer-config"},
		{[]string{"serve", "kvbridge/tiny", "--block-size", "0"}, "block-size"},
		{[]string{"serve", "kvbridge/tiny", "--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_rol":"kv_producer"}`}, "did you mean kv_role?"},
		{[]string{"serve", "kvbridge/tiny", "--kv-transfer-config.kv_connector", "NixlConnector", "--kv-transfer-config.kv_role", "kv_producer", "--kv-transfer-config.kv_conector_extra_config.kv_lease_duration", "60"}, "did you mean kv_connector_extra_config?"},
		{[]string{"serve", "kvbridge/tiny", "--kv-events-config", `{"enable_kv_cache_events":true,"endpont":"tcp://*:5557"}`}, `unknown key "endpont"`},
		{[]string{"serve", "kvbridge/tiny", "--kv-events-config", `{"enable_kv_cache_events":true,"publisher":"kafka"}`}, `publisher "kafka"`},
		{[]string{"serve", "kvbridge/tiny", "--kv-events-config.enable_kv_cache_events", "true", "--kv-events-config.hwm", "-1"}, "hwm -1"},
		{[]string{"check"}, "--proxy is required"},
		{[]string{"check", "--proxy", "localhost:8000"}, "not an http:// or https:// URL"},
		{[]string{"check", "--proxy", "http://127.0.0.1:1", "--requests", "0"}, "--requests"},
		{[]string{"serve", "kvbridge/tiny", "--log-format", "xml"}, "--log-format"},
		{[]string{"serve", "kvbridge/tiny", "--kv-transfer-port", "70000"}, "--kv-transfer-port"},
		{[]string{"proxy", "--log-level", "verbose"}, "--log-level"},
		{[]string{"serve", "kvbridge/tiny", "--write-timeout", "0s"}, "--write-timeout"},
		{[]string{"proxy", "--write-timeout", "-1s"}, "--write-timeout"},
		{[]string{"proxy", "--transfer-mode", "pushy"}, "--transfer-mode"},
		{[]string{"proxy", "--prefiller-hosts", "a", "b", "--prefiller-ports", "1"}, "2 prefiller hosts but 1"},
		{[]string{"proxy", "--multi-turn", "--conversation-store", "redis://127.0.0.1:1/0"}, "--conversation-store-key"},
		{[]string{"proxy", "--conversation-store-key", "k"}, "--conversation-store-key needs --multi-turn"},
		{[]string{"proxy", "--routing", "fastest"}, "--routing"},
		{[]string{"proxy", "--routing", "kv-aware"}, "needs --kv-events"},
		{[]string{"proxy", "--prefiller-ports", "1,2", "--prefiller-hosts", "a,b", "--kv-events", "tcp://a:5557"}, "--kv-events: 1 endpoints for 2 prefillers"},
		{[]string{"proxy", "--kv-events", "tcp://a:5557", "--kv-events-replay", "tcp://a:1,tcp://a:2"}, "--kv-events-replay"},
		{[]string{"proxy", "--kv-events", "tcp://a:5557", "--kv-events-dp", "0"}, "--kv-events-dp"},
		{[]string{"proxy", "--kv-events", "tcp://*:5557"}, "KV events endpoint"},
		{[]string{"proxy", "--kv-events", "tcp://a:5557", "--prefix-caching-hash-algo", "xxhash"}, "xxhash"},
		{[]string{"bench", "routing", "--prefillers", "0"}, "--prefillers"},
		{[]string{"bench", "routing", "--policies", "random"}, "--policies"},
		{[]string{"bench"}, "subcommand"},
		{[]string{"bench", "pd", "--hosts", "--backend", "SHM"}, "--backend SHM cannot cross hosts"},
		{[]string{"bench", "transfer", "--backends", "TCP,RDMA"}, "--backends"},
		{[]string{"bench", "pd", "--transfer-mode", "pull,teleport"}, "--transfer-mode"},
		{[]string{"bench", "transfer", "--ops", "SEND"}, "--ops"},
	} {
		cmd := exec.Command(os.Args[0], tc.args...)
		cmd.Env = append(os.Environ(), "KVBRIDGE_TEST_MAIN=1")
		out, err := cmd.CombinedOutput()
		ee, ok := err.(*exec.ExitError)
		if !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), tc.want) {
			t.Errorf("kvbridge %s: %v, output %q; want exit status 2 naming %q", strings.Join(tc.args, " "), err, out, tc.want)
		}
	}
	cmd := exec.Command(os.Args[0], "serve", "Qwen/Qwen3-0.6B", "--port", "0")
	cmd.Env = append(os.Environ(), "KVBRIDGE_TEST_MAIN=1", "HF_HOME="+t.TempDir(), "HF_HUB_CACHE=", "XDG_CACHE_HOME="+t.TempDir(), "HOME="+t.TempDir())
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "kvbridge/") {
		t.Errorf("a model missing from the cache: %v %s; want an error naming where it looked and the built-in models", err, out)
	}
}
